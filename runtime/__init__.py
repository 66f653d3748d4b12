"""dsv4.runtime: run an exported DeepSeek-V4 (torch-free: numpy, iree.runtime, tokenizers).

    from dsv4.runtime import Engine, SamplingParams
    eng = Engine("out/default")
    print(eng.generate("The list data type", max_new_tokens=32).text)

Public names (imported lazily, so ``import dsv4.runtime`` loads nothing heavy):
Engine, SamplingParams, GenerationResult, StreamChunk, ScoreResult, EngineError, ArtifactError,
RequestError, ExportConfig. Modules: engine (requests, step loop), module (the IREE context),
batching, text, sampling. The export directory's contract (config.json, the .irpa shards, the
errors) is dsv4.contract, below this package.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Engine", "SamplingParams", "GenerationResult", "StreamChunk", "ScoreResult", "EngineError",
           "ArtifactError", "RequestError", "ExportConfig"]

_WHERE = {
    "Engine": ".engine", "GenerationResult": ".engine", "StreamChunk": ".engine", "ScoreResult": ".engine",
    "SamplingParams": ".sampling", "EngineError": "dsv4.contract.errors", "ArtifactError": "dsv4.contract.errors",
    "RequestError": "dsv4.contract.errors", "ExportConfig": "dsv4.contract.artifact",
}


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'dsv4.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
