"""Shared test fixtures: the one-thread switch and the cache of exported models.

Exports take minutes on 2 cores, so each export fixture builds once and caches the result under
`.cache/<tag>-<key>/`, the key hashing GRAPH_SOURCES (the one list of what shapes an exported
graph), the fixture's own key parts (config, export arguments, weights) and the compiler version.
Delete `.cache/` to force fresh exports. Tests that build or run a compiled export carry the
`slow` marker: `pytest -m "not slow"` is the fast tier, plain `pytest` (`make test`) runs all."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def graph_sources() -> list[Path]:
    """Every file that can change an exported graph or its parameters: the model package (the
    checkpoint loaders included, minus its assets), the exporter and the contract (config.json and the .irpa
    shards), Python and MLIR templates."""
    files = []
    for top in ("contract", "model", "export"):
        for f in (REPO / top).rglob("*"):
            rel = f.relative_to(REPO)
            if (f.suffix == ".py" or ".mlir" in f.name) and "assets" not in rel.parts and "__pycache__" not in rel.parts:
                files.append(f)
    return sorted(files)


def export_key(key_parts: Iterable[Any]) -> str:
    import iree.compiler

    h = hashlib.sha256()
    for f in graph_sources():
        h.update(f.relative_to(REPO).as_posix().encode())
        h.update(f.read_bytes())
    for part in key_parts:
        if isinstance(part, Path):  # a weights/tokenizer file: its bytes
            h.update(part.name.encode())
            h.update(part.read_bytes())
        else:
            h.update(json.dumps(part, sort_keys=True, default=repr).encode())
    h.update(str(getattr(iree.compiler, "__version__", "")).encode())
    return h.hexdigest()[:16]


def cached_export(tag: str, build: Callable[[Path], Any], key_parts: Iterable[Any]) -> Path:
    """`.cache/<tag>-<key>`, made by `build(directory)` (an export_model call) when missing."""
    cache = REPO / ".cache" / f"{tag}-{export_key(key_parts)}"
    if not (cache / "config.json").is_file():
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir=cache.parent))
        try:
            build(tmp)
            if cache.exists():
                shutil.rmtree(cache)
            tmp.rename(cache)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return cache


# fixtures holding a compiled export of a real model (minutes to build, minutes of tests on top)
EXPORT_FIXTURES = ("art", "tiny_export", "export_dir", "bench_export", "serve_export", "k512", "batchinv_export",
                   "noweights_export")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that needs an export fixture is `slow`; tests that compile by themselves carry
    the marker explicitly."""
    for item in items:
        if any(f in getattr(item, "fixturenames", ()) for f in EXPORT_FIXTURES):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: OpenMP threads only add synchronization (and spin-waiting on a busy 2-core box).
    Opt in per module with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
