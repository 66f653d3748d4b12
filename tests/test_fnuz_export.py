"""The gfx942 hand-off (the FNUZ/OCP mix-up that breaks FP8 models on MI300X), on conftest's tiny
quantized export (FP8 linears, MXFP4 experts; llvm-cpu and gfx942):

* config.json gives gfx942 its own model.fnuz-* shards holding exactly the e4m3fnuz re-encoding of
  every FP8 weight (same bits, block scale x2), while the model-* shards hold the e4m3fn bytes;
* the gfx942 flavour of the graph (model.fnuz.mlir, kept by the export), compiled for llvm-cpu and
  run here on the fnuz shards, computes what the e4m3fn module computes.

Both are slow: they read the export (minutes to build on 2 cores, cached under .cache/)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_q_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [3, 17, 100, 250, 511, 7, 42, 300, 5, 64, 128, 256, 1, 2]
NEW_TOKENS = 8


def _irpa(paths: "tuple[Path, ...]") -> dict[str, bytes]:
    """Every parameter of .irpa shards: name (without the 'model.' scope) -> raw bytes."""
    import iree.runtime as rt

    index = rt.ParameterIndex()
    for p in paths:
        index.load(str(p))
    return {k.removeprefix("model."): bytes(e.file_view) for k, e in index.items()}


def _scale(s: torch.Tensor) -> torch.Tensor:
    """A block scale's value: E8M0 bytes are powers of two, 2^(byte - 127)."""
    return torch.exp2(s.double() - 127) if s.dtype == torch.uint8 else s.double()


def test_gfx942_gets_the_fnuz_weights(tiny_q_export: Path, tmp_path: Path) -> None:
    """config.json names the model.fnuz-* shards for gfx942 only, they hold exactly the e4m3fnuz
    re-encoding of every FP8 weight of the model the export was made from (formats.fp8_fn_to_fnuz,
    checked against its float64 decode), and everything else byte for byte. Swapping the two archives
    fails here."""
    from dsv4.contract.artifact import ExportConfig
    from dsv4.model.quant.formats import fp8_fn_to_fnuz

    config = ExportConfig.load(tiny_q_export)
    targets = config.targets
    fn_files, fnuz_files = config.parameters, config.parameters_for("gfx942")
    assert targets["gfx942"]["fp8_dtype"] == "float8_e4m3fnuz" and "parameters" not in targets["llvm-cpu"]
    assert targets["gfx942"]["parameters"] == [f.name for f in fnuz_files]
    assert all(f.name.startswith("model.fnuz-") for f in fnuz_files)
    assert config.parameters_for("llvm-cpu") == fn_files and not set(fn_files) & set(fnuz_files)
    fn, fnuz = _irpa(fn_files), _irpa(fnuz_files)
    assert fn.keys() == fnuz.keys()
    model = tiny_q_model(tmp_path)
    weights = {f"{n}.weight": (m.weight.data, m.scale.data) for n, m in model.named_modules()
               if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dtype == torch.float8_e4m3fn}
    assert len(weights) > 10
    for name, (w, s) in weights.items():
        scale = name.removesuffix("weight") + "scale"
        w2, s2 = fp8_fn_to_fnuz(w, s)
        # the re-encoding is value-preserving: fnuz bits decode to half the fn value, the scale doubles
        assert torch.equal(w2.double() * 2, w.double()) and torch.equal(_scale(s2), _scale(s) * 2), name
        assert fn[name] == w.contiguous().view(torch.uint8).numpy().tobytes(), name
        assert fn[scale] == s.contiguous().numpy().tobytes(), scale
        assert fnuz[name] == w2.contiguous().view(torch.uint8).numpy().tobytes(), name
        assert fnuz[scale] == s2.contiguous().numpy().tobytes() != fn[scale], scale
    converted = {*weights, *(n.removesuffix("weight") + "scale" for n in weights)}
    assert all(fn[k] == fnuz[k] for k in fn.keys() - converted)  # everything else byte for byte


@pytest.fixture(scope="module")
def fnuz_on_cpu(tiny_q_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The gfx942 flavour of the graph compiled for llvm-cpu, as an export directory of its own whose
    llvm-cpu target reads the model.fnuz-* shards (the vmfb is cached next to the export)."""
    from dsv4.export.compile import compile_mlir

    vmfb = tiny_q_export / "model.fnuz.llvm-cpu.vmfb"
    if not vmfb.is_file():
        tmp = vmfb.with_suffix(".tmp")
        compile_mlir(tiny_q_export / "model.fnuz.mlir", "llvm-cpu", tmp)
        tmp.rename(vmfb)
    out = tmp_path_factory.mktemp("fnuz_on_cpu")
    cfg = json.loads((tiny_q_export / "config.json").read_text())
    cfg["targets"]["llvm-cpu"] = {**cfg["targets"]["llvm-cpu"], "vmfb": vmfb.name,
                                  "parameters": cfg["targets"]["gfx942"]["parameters"],
                                  "fp8_dtype": "float8_e4m3fnuz"}
    (out / "config.json").write_text(json.dumps(cfg))
    for f in tiny_q_export.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    return out


def _run(export_dir: Path) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Prefill logits of PROMPT, the next decode step's logits, and a greedy continuation."""
    from dsv4.runtime.engine import Engine

    eng = Engine(export_dir)
    n, i64 = len(PROMPT), np.int64
    state = [eng.module.zeros(s) for s in eng.config.state]
    pre, arg = eng.module("prefill_bs1", np.array([PROMPT], i64), np.zeros(1, i64), np.array([n], i64),
                          np.zeros(1, i64), *state)
    dec, _ = eng.module("decode_bs1", arg.reshape(1, 1).astype(i64), np.array([n], i64), np.ones(1, i64),
                        np.zeros(1, i64), *state)
    return pre, dec, list(eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True).tokens)


def test_gfx942_flavour_runs_on_llvm_cpu_like_the_fn_one(fnuz_on_cpu: Path, tiny_q_export: Path) -> None:
    """fnuz values are exactly fn values / 2 and the scale doubles, so the decoded weights, and the
    logits, are the fn flavour's exactly: bit-equal prefill and decode logits, the same greedy tokens."""
    from dsv4.runtime.engine import Engine

    assert all(p.name.startswith("model.fnuz-") for p in Engine(fnuz_on_cpu).parameters_paths)
    want, got = _run(tiny_q_export), _run(fnuz_on_cpu)
    for a, b in zip(want[:2], got[:2]):
        assert a.shape == b.shape and np.abs(a).max() > 0
        assert np.array_equal(a, b), float(np.abs(a - b).max())
    assert got[2] == want[2] and len(set(want[2])) > 1
