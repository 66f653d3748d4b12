"""Weights as sharded .irpa files (dsv4.runtime.weights), config.json's weights fields, exports
without weights, `dsv4 weights random`, the torch loader from .irpa and the streamed release
checkpoint.

The .irpa writer is checked against independent readers: IREE's own parameter index and
iree-turbine's ParameterArchive (which decodes dtype and shape from the metadata), and end to end
by running a compiled module from re-sharded weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dsv4.runtime import ArtifactError, ExportConfig
from dsv4.runtime.artifact import TensorSpec, check_irpa
from dsv4.runtime.weights import (check_weights, checked, open_weights, plan_shards, shard_names, storage_dtype,
                                  write_shards)


def _sample_tensors() -> list[tuple[str, np.ndarray, str]]:
    rng = np.random.default_rng(0)
    return [
        ("model.a", rng.standard_normal((7, 5)).astype(np.float32), "float32"),
        ("model.b", rng.integers(0, 1 << 16, (3, 129), dtype=np.uint16), "bfloat16"),
        ("model.c", rng.integers(0, 256, (1000,), dtype=np.uint8), "float8_e4m3fn"),
        ("model.d", np.array(42, dtype=np.int64), "int64"),  # 0-d
        ("model.e", np.zeros((0, 4), dtype=np.float32), "float32"),  # empty
        ("model.f", rng.integers(0, 9, (300, 2), dtype=np.int64), "int64"),
        ("model.g", rng.integers(0, 256, (2, 3, 4), dtype=np.uint8), "uint8"),
    ]


# ------------------------------------------------------------------------------------------------
# 1. the sharded .irpa writer and reader
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shard_bytes", [1 << 30, 4096, 1])
def test_write_shards_round_trip(tmp_path: Path, shard_bytes: int) -> None:
    """Every tensor comes back bit for bit, with its shape and dtype, whatever the split; the file
    count is the one plan_shards predicts from the sizes alone; IREE's index and turbine's reader
    (an independent decoder of the metadata) agree."""
    import torch
    from iree.turbine.aot import ParameterArchive

    ts = _sample_tensors()
    names = write_shards(tmp_path, iter(ts), prefix="model", shard_bytes=shard_bytes)
    counts = plan_shards([a.nbytes for _, a, _ in ts], shard_bytes)
    assert names == shard_names("model", len(counts)) and sorted(p.name for p in tmp_path.iterdir()) == names
    # 4096: a..e fit (64-byte aligned: 192 + 832 + 1024 + 64 + 0), f (4800 bytes) gets its own, g too
    assert counts == {1 << 30: [7], 4096: [5, 1, 1], 1: [1] * 7}[shard_bytes]
    assert [check_irpa(tmp_path / n) for n in names] == counts
    w = open_weights([tmp_path / n for n in names])
    assert list(w) == [n for n, _, _ in ts]
    for name, arr, dtype in ts:
        got = w.tensor(name)
        assert got.dtype == storage_dtype(dtype) and got.shape == arr.shape and np.array_equal(got, arr), name
        assert w.spec(name) == (arr.shape, dtype) and w.nbytes(name) == arr.nbytes
        assert not w[name].flags.writeable  # a view of the read-only map, not a copy
    turbine = {k: e.as_tensor() for n in names for k, e in ParameterArchive(tmp_path / n).items()}
    for name, arr, dtype in ts:
        t = turbine[name]
        assert t.dtype == getattr(torch, dtype) and tuple(t.shape) == arr.shape
        assert t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() == arr.tobytes()


def test_write_shards_names_errors_and_partial_files(tmp_path: Path) -> None:
    ts = _sample_tensors()
    assert write_shards(tmp_path, ts, names=["w.irpa"]) == ["w.irpa"]
    with pytest.raises(ValueError, match=r"took 7 shard\(s\).*2 file name"):
        write_shards(tmp_path / "x", ts, shard_bytes=1, names=["a.irpa", "b.irpa"])
    assert list((tmp_path / "x").iterdir()) == []

    def boom():
        yield ts[0]
        raise RuntimeError("generator failed")

    with pytest.raises(RuntimeError):
        write_shards(tmp_path / "y", boom())
    assert list((tmp_path / "y").iterdir()) == []  # no half-written archive left behind
    with pytest.raises(ValueError, match="model.b: expected a numpy array stored as uint16 for bfloat16"):
        write_shards(tmp_path / "z", [("model.b", np.zeros(3, np.float32), "bfloat16")])


def test_tensor_view_checks_shape_and_dtype(tmp_path: Path) -> None:
    write_shards(tmp_path, _sample_tensors()[:2])
    w = open_weights(tmp_path / "model-00001-of-00001.irpa")
    assert w.tensor("model.a", (7, 5), "float32").shape == (7, 5)
    with pytest.raises(ArtifactError, match=r"model.a is float32 \[7, 5\], expected float32 \[35\]"):
        w.tensor("model.a", (35,), "float32")
    assert w.file_of("model.b").name == "model-00001-of-00001.irpa"


def test_duplicate_key_across_shards_is_refused(tmp_path: Path) -> None:
    a = write_shards(tmp_path, _sample_tensors()[:1], prefix="p")
    b = write_shards(tmp_path, _sample_tensors()[:1], prefix="q")
    with pytest.raises(ArtifactError, match=r"model.a is also in p-00001-of-00001.irpa"):
        open_weights([tmp_path / a[0], tmp_path / b[0]])


def test_check_weights_and_checked_stream() -> None:
    specs = [TensorSpec(n, tuple(a.shape), dt) for n, a, dt in _sample_tensors()]
    found = {s.name: s.nbytes for s in specs}
    assert check_weights(found, specs) == []
    found.pop("model.a")
    found["model.b"] += 2
    found["model.zz"] = 1
    assert check_weights(found, specs) == ["missing: model.a (float32 [7, 5])",
                                           "size: model.b has 776 bytes, bfloat16 [3, 129] needs 774",
                                           "extra: model.zz is not in config.json's weights"]
    assert [n for n, _, _ in checked(_sample_tensors(), specs)] == [s.name for s in specs]
    with pytest.raises(ValueError, match="never came"):
        list(checked(_sample_tensors()[1:], specs))
    bad = [("model.a", np.zeros((5, 7), np.float32), "float32")]
    with pytest.raises(ValueError, match=r"model.a: got float32 \[5, 7\], the inventory says float32 \[7, 5\]"):
        list(checked(bad, specs))


# ------------------------------------------------------------------------------------------------
# config.json: parameters list, weights inventory, flavours, exports without weights
# ------------------------------------------------------------------------------------------------


def _toy_export(tmp_path_factory) -> Path:
    from test_runtime import _build_toy_export

    return _build_toy_export(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    """test_runtime's toy export (a one-layer LM following the export ABI, turbine-written model.irpa)."""
    return _toy_export(tmp_path_factory)


def _reshard(src: Path, dst: Path, shard_bytes: int, drop: str | None = None) -> Path:
    """A copy of the toy export whose weights are re-written by write_shards into several files,
    with config.json's parameters list and weights inventory."""
    shutil.copytree(src, dst)
    old = open_weights(dst / "model.irpa")
    tensors = [(k, old.tensor(k), old.spec(k)[1]) for k in old]
    specs = [TensorSpec(k, a.shape, dt).to_json() for k, a, dt in tensors]
    names = write_shards(dst, [t for t in tensors if t[0] != drop], shard_bytes=shard_bytes)
    del old
    (dst / "model.irpa").unlink()
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(parameters=names, weights={"tensors": specs, "shard_bytes": shard_bytes})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_resharded_weights_run_the_compiled_module(toy, tmp_path: Path) -> None:
    """The toy module runs from write_shards' files exactly as from turbine's model.irpa (IREE reads
    our archives), and the old single-file form (`"parameters": "model.irpa"`) still loads."""
    from dsv4.runtime.engine import Engine

    d = _reshard(toy, tmp_path / "sharded", shard_bytes=256)
    cfg = ExportConfig.load(d)
    assert len(cfg.parameters) >= 2 and cfg.parameters_for("llvm-cpu") == cfg.parameters
    assert cfg.weights is not None and cfg.shard_bytes == 256
    ref = Engine(toy)
    assert ref.parameters_paths == (toy / "model.irpa",) and ExportConfig.load(toy).weights is None
    eng = Engine(d)
    prompt = [5, 9, 11, 3, 7]
    got, want = eng.generate(prompt, max_new_tokens=12).tokens, ref.generate(prompt, max_new_tokens=12).tokens
    assert got == want and len(set(want)) > 2


def test_weights_not_matching_the_inventory_are_named(toy, tmp_path: Path) -> None:
    from dsv4.runtime.engine import Engine

    d = _reshard(toy, tmp_path / "short", shard_bytes=1 << 20, drop="wq")
    with pytest.raises(ArtifactError, match=r"do not match config.json's inventory: missing: wq \(float32 \[16, 16\]\)"):
        Engine(d)


def test_export_without_weights_gives_one_clear_error(toy, tmp_path: Path, capsys) -> None:
    """An export made with --no-weights (config.json + vmfb, no .irpa): Engine and `dsv4 generate`
    name the missing file and the command that writes weights; the config still reads with
    weights=False (what `dsv4 weights random` does)."""
    from dsv4.runtime.cli import main
    from dsv4.runtime.engine import Engine

    d = _reshard(toy, tmp_path / "nw", shard_bytes=256)
    files = ExportConfig.load(d).parameters
    for f in files:
        f.unlink()
    msg = rf"{files[0].name} is missing from {d} \(and {len(files) - 1} more weight file\(s\)\).*dsv4 weights random {d}"
    with pytest.raises(ArtifactError, match=msg):
        Engine(d)
    assert ExportConfig.load(d, weights=False).missing_weights() == list(files)
    assert main(["generate", str(d), "--prompt-ids", "5,9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dsv4 weights random" in err[0] and files[0].name in err[0]


def test_config_weight_fields(tmp_path: Path) -> None:
    """parameters as a list or the old string; per-target flavours; bad fields are named."""
    from test_runtime import _config, _write_export

    specs = [["model.w", [4, 128], "float8_e4m3fn"], ["model.s", [1, 1], "uint8"], ["model.n", [4], "float32"]]
    cfg = _config(parameters=["model-00001-of-00001.irpa"], weights={"tensors": specs, "shard_bytes": 1 << 30})
    cfg["targets"]["gfx942"] = {"vmfb": "model.gfx942.vmfb", "parameters": ["model.fnuz-00001-of-00001.irpa"],
                                "fp8_dtype": "float8_e4m3fnuz"}
    files = ("model-00001-of-00001.irpa", "model.fnuz-00001-of-00001.irpa", "model.llvm-cpu.vmfb")
    c = ExportConfig.load(_write_export(tmp_path / "ok", cfg, files))
    base, fnuz = c.weight_groups()
    assert base.targets == ("llvm-cpu",) and base.fp8_dtype is None and base.specs == c.weights
    assert fnuz.targets == ("gfx942",) and fnuz.files == (tmp_path / "ok" / files[1],)
    assert [s.dtype for s in fnuz.specs] == ["float8_e4m3fnuz", "uint8", "float32"]
    assert c.parameters_for("gfx942") == fnuz.files and c.parameters_for("llvm-cpu") == base.files
    for change, match in [
        (dict(parameters=[]), "parameters: must be a file name or a non-empty list"),
        (dict(parameters=["../x.irpa"]), "parameters: must be a file name"),
        (dict(weights={"tensors": specs}), "weights.shard_bytes"),
        (dict(weights={"tensors": [["a", [2], "float7"]], "shard_bytes": 1}), r"weights.tensors\[0\] \(a\): unknown dtype"),
        (dict(weights={"tensors": [["a", [2]]], "shard_bytes": 1}), r"weights.tensors\[0\]: must be \[name, shape"),
        (dict(weights={"tensors": [specs[0], specs[0]], "shard_bytes": 1}), "model.w is listed twice"),
    ]:
        with pytest.raises(ArtifactError, match=match):
            ExportConfig.from_dict({**cfg, **change}, tmp_path)
    bad = json.loads(json.dumps(cfg))
    bad["targets"]["gfx942"]["fp8_dtype"] = "float8_e5m2"
    with pytest.raises(ArtifactError, match="targets.gfx942.fp8_dtype"):
        ExportConfig.from_dict(bad, tmp_path)
