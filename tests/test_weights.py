"""Weights as sharded .irpa files (dsv4.contract.weights), config.json's weights fields, exports
without weights, `dsv4 weights random`, the torch loader from .irpa and the streamed release
checkpoint (that last one: tests/test_checkpoint_stream.py).

The .irpa writer is checked against independent readers: IREE's own parameter index and
iree-turbine's ParameterArchive (which decodes dtype and shape from the metadata), and end to end
by running a compiled module from re-sharded weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import tiny_q_cfg, tiny_q_model

from dsv4.runtime import ArtifactError, ExportConfig
from dsv4.contract.artifact import TensorSpec, shard_names
from dsv4.contract.weights import (check_irpa, check_weights, checked, open_weights, plan_shards, storage_dtype,
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
    from test_engine_toy import _build_toy_export

    return _build_toy_export(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    """test_engine_toy's toy export (a one-layer LM following the export ABI, turbine-written model.irpa)."""
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
    from dsv4.cli import main
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


# ------------------------------------------------------------------------------------------------
# 2. `dsv4 weights random`
# ------------------------------------------------------------------------------------------------


def _tiny_inventory() -> tuple[dict, list[TensorSpec]]:
    import torch

    from dsv4.model.checkpoint.irpa import param_inventory
    from dsv4.model.config import ModelConfig
    from dsv4.model.model import Transformer

    cfg = ModelConfig.preset("tiny")
    with torch.device("meta"):
        model = Transformer(cfg, quantized=True)
    return cfg.to_dict(), param_inventory(model)


def _no_weights_export(d: Path, shard_bytes: int = 1 << 16, fnuz: bool = True) -> Path:
    """config.json of the tiny quantized model as an export made with --no-weights: llvm-cpu reads
    the e4m3fn files, gfx942 its own e4m3fnuz ones; no .irpa yet."""
    from test_runtime import _config, _write_export

    from dsv4.contract.artifact import with_fp8
    from dsv4.contract.weights import planned_names

    model, specs = _tiny_inventory()
    cfg = _config(model=model, activation_dtype="bfloat16", parameters=planned_names(specs, "model", shard_bytes),
                  weights={"tensors": [s.to_json() for s in specs], "shard_bytes": shard_bytes})
    if fnuz:
        cfg["targets"]["gfx942"] = {"vmfb": "model.gfx942.vmfb", "fp8_dtype": "float8_e4m3fnuz",
                                    "parameters": planned_names(with_fp8(specs, "float8_e4m3fnuz"), "model.fnuz", shard_bytes)}
    return _write_export(d, cfg, files=("model.llvm-cpu.vmfb",))


@pytest.fixture(scope="module")
def random_export(tmp_path_factory) -> Path:
    from dsv4.contract.random_weights import write_random_weights

    d = _no_weights_export(tmp_path_factory.mktemp("random") / "out")
    write_random_weights(d, seed=3)
    return d


def _group_weights(d: Path):
    c = ExportConfig.load(d)
    return [(g, open_weights(g.files)) for g in c.weight_groups()]


def test_random_weights_complete_and_flavours(random_export: Path) -> None:
    """Every file config.json names is written, each holding exactly its flavour's inventory (right
    bytes, shape and dtype recorded), several shards each."""
    groups = _group_weights(random_export)
    assert [g.fp8_dtype for g, _ in groups] == [None, "float8_e4m3fnuz"]
    for g, w in groups:
        assert len(g.files) > 3 and all(f.is_file() for f in g.files)
        assert check_weights({k: w.nbytes(k) for k in w}, g.specs) == []
        for s in g.specs:
            assert w.spec(s.name) == (s.shape, s.dtype)


def test_random_weights_decode_at_the_init_scale(random_export: Path) -> None:
    """Decoded with the project's torch decoders (model/quant/formats.py): FP8 (both formats) and MXFP4
    weights x scale have std 0.02 and are finite, with no NaN code (and no 0x80 in e4m3fnuz); the
    two FP8 flavours hold the same values; floats follow init_rule; tid2eid rows are distinct."""
    import torch

    from dsv4.model.quant.formats import (E4M3FN, E4M3FNUZ, dequant_fp8_block, dequant_mxfp4, e8m0_decode,
                                    fp8_from_bytes, unpack_e2m1)

    (fn_group, fn), (_, fnuz) = _group_weights(random_export)
    t = lambda w, k: torch.from_numpy(w.tensor(k).copy())  # noqa: E731
    n_fp8 = n_fp4 = 0
    for s in fn_group.specs:
        if s.dtype == "float8_e4m3fn":
            n_fp8 += 1
            scale = s.name[: -len("weight")] + "scale"
            a, b = t(fn, s.name), t(fnuz, s.name)
            assert not ((a & 0x7F) == 0x7F).any() and not (b == 0x80).any(), s.name
            assert torch.equal(e8m0_decode(t(fn, scale)), torch.full(t(fn, scale).shape, 2.0**-12))
            assert torch.equal(e8m0_decode(t(fnuz, scale)), torch.full(t(fn, scale).shape, 2.0**-11))
            v = dequant_fp8_block(fp8_from_bytes(a, E4M3FN), t(fn, scale))
            v2 = dequant_fp8_block(fp8_from_bytes(b, E4M3FNUZ), t(fnuz, scale))
            assert torch.isfinite(v).all() and torch.equal(v, v2), s.name
            assert abs(v.std().item() / 0.02 - 1) < 0.05 and abs(v.mean().item()) < 0.002, s.name
        elif s.name.endswith((".w1", ".w2", ".w3")):  # packed MXFP4 experts
            n_fp4 += 1
            p, sc = t(fn, s.name), t(fn, s.name + "_scale")
            assert torch.equal(p, t(fnuz, s.name))
            assert torch.equal(e8m0_decode(sc), torch.full(sc.shape, 2.0**-7))
            v = dequant_mxfp4(p, sc)
            assert torch.isfinite(v).all() and abs(v.std().item() / 0.02 - 1) < 0.05, s.name
    assert n_fp8 > 20 and n_fp4 == 3 * 5  # 4 layers + MTP, 3 expert stacks each
    codes = torch.cat([unpack_e2m1(t(fn, s.name)).flatten() for s in fn_group.specs if s.name.endswith(".w1")])
    hist = torch.bincount(codes, minlength=16).double() / codes.numel()
    assert hist[8] == 0 and (hist[[0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15]] > 0.01).all()  # all but -0
    assert torch.allclose(hist[1:8], hist[9:16], atol=0.004)  # symmetric
    assert 0.01 < hist[7] < 0.08  # saturated at +-6 (2.3 sigma) but not piled up there
    lo_hi = unpack_e2m1(t(fn, "model.layers.0.ffn.experts.w1")).view(-1, 2)
    assert torch.allclose(torch.bincount(lo_hi[:, 0], minlength=16).double(),
                          torch.bincount(lo_hi[:, 1], minlength=16).double(), rtol=0.15, atol=40)

    from dsv4.contract.random_weights import init_rule

    for s in fn_group.specs:
        if s.dtype in ("float32", "bfloat16"):
            x = t(fn, s.name)
            x = x.view(torch.bfloat16).float() if s.dtype == "bfloat16" else x
            rule = init_rule(s.name)
            if rule == "ones":
                assert torch.equal(x, torch.ones_like(x)), s.name
            elif rule == "zeros":
                assert not x.any(), s.name
            elif x.numel() >= 4096:
                assert abs(x.std().item() / 0.02 - 1) < 0.05, s.name
    tid = t(fn, "model.layers.0.ffn.gate.tid2eid")
    assert tid.shape == (512, 2) and ((tid >= 0) & (tid < 8)).all() and (tid[:, 0] != tid[:, 1]).all()
    assert torch.bincount(tid.flatten(), minlength=8).min() > 512 * 2 / 8 * 0.7  # every expert used


def test_random_weights_are_deterministic(random_export: Path, tmp_path: Path) -> None:
    """Same seed: the same bytes in every file (on any host: per-tensor generators seeded by name);
    another seed: other values for exactly the random tensors. Splitting differently changes no value."""
    from dsv4.contract.random_weights import init_rule, write_random_weights

    again = _no_weights_export(tmp_path / "again")
    write_random_weights(again, seed=3)
    files = [f for g in ExportConfig.load(random_export).weight_groups() for f in g.files]
    assert all((again / f.name).read_bytes() == f.read_bytes() for f in files)
    resplit = _no_weights_export(tmp_path / "resplit", shard_bytes=1 << 30, fnuz=False)
    write_random_weights(resplit, seed=3)
    other = _no_weights_export(tmp_path / "other", shard_bytes=1 << 30, fnuz=False)
    write_random_weights(other, seed=4)
    (g3, w3), _ = _group_weights(random_export)
    (g1, w1), = _group_weights(resplit)
    (_, w4), = _group_weights(other)
    assert len(g1.files) == 1 and len(g3.files) > 3
    assert all(np.array_equal(w1[k], w3[k]) for k in w3)
    constant = {s.name for s in g3.specs if init_rule(s.name) in ("ones", "zeros")
                or s.name.endswith((".scale", ".w1_scale", ".w2_scale", ".w3_scale"))}
    assert {k for k in w3 if not np.array_equal(w4[k], w3[k])} == set(w3) - constant


def test_weights_random_cli_and_errors(tmp_path: Path, capsys) -> None:
    from dsv4.cli import main

    d = _no_weights_export(tmp_path / "cli", fnuz=False)
    assert main(["weights", "random", str(d), "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "random weights (seed 1) for llvm-cpu" in out and "GB written" in out
    assert main(["weights", "random", str(d)]) == 2
    err = capsys.readouterr().err
    assert "model-00001-of-" in err and "has weights already (pass --force" in err
    assert main(["weights", "random", str(d), "--force"]) == 0
    capsys.readouterr()
    for bad, match in [(tmp_path / "nothing", "does not exist"), (tmp_path, "has no config.json")]:
        assert main(["weights", "random", str(bad)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and match in err[0]
    cfg = json.loads((d / "config.json").read_text())
    del cfg["weights"]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(cfg))
    assert main(["weights", "random", str(tmp_path / "old")]) == 2
    assert "has no weights inventory" in capsys.readouterr().err
    cfg = json.loads((d / "config.json").read_text())
    cfg["parameters"] = ["model-00001-of-00001.irpa"]
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "config.json").write_text(json.dumps(cfg))
    assert main(["weights", "random", str(tmp_path / "cut")]) == 2
    assert "1 weight file(s) listed for llvm-cpu, but its inventory cut at 65536 bytes makes" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# 3. the torch loader from .irpa
# ------------------------------------------------------------------------------------------------


def _tiny_quantized():
    """The model _tiny_inventory describes (bf16 activations, FP8 linears, MXFP4 experts)."""
    from dsv4.model.config import ModelConfig
    from dsv4.model.model import Transformer

    return Transformer(ModelConfig.preset("tiny"), quantized=True)


def test_load_irpa_fills_the_model_bit_for_bit_and_runs(random_export: Path) -> None:
    """Random weights written by `dsv4 weights random` load into Transformer(quantized=True) with
    every tensor byte for byte the file's (the e4m3fn flavour chosen from the export directory), and
    the eager model runs on them (finite, non-constant logits, greedy decoding)."""
    import torch

    from dsv4.model.checkpoint.irpa import load_irpa
    from dsv4.model.generate import greedy

    model = load_irpa(_tiny_quantized(), random_export)
    (g, w), _ = _group_weights(random_export)
    for name, t in model.state_dict().items():
        assert t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() == w["model." + name].tobytes(), name
    assert model.layers[1].attn.wq_a.weight.dtype == torch.float8_e4m3fn
    from dsv4.model.state import new_state

    logits = model(torch.tensor([[5, 9, 11, 3, 7, 1, 2, 8]]), torch.tensor([0]), torch.tensor([8]),
                   torch.tensor([0]), new_state(model.cfg, 1, torch.bfloat16))
    assert torch.isfinite(logits).all() and logits.std() > 1e-3
    assert len(greedy(model, [5, 9, 11, 3], 6)) == 6


def test_load_irpa_mapped_views_the_files_without_a_copy(random_export: Path) -> None:
    """mapped=True: every tensor is a view of the archive's memory map (its data pointer lies inside
    the mapped entry, so nothing was copied) with the same values as the copying load, and the model
    gives the same logits."""
    import torch

    from dsv4.model.checkpoint.irpa import load_irpa
    from dsv4.model.state import new_state

    copied = load_irpa(_tiny_quantized(), random_export)
    mapped = load_irpa(_tiny_quantized(), random_export, mapped=True)
    w = mapped._irpa_mapping  # the model's own open archives
    sd = copied.state_dict()
    for name, t in mapped.state_dict().items():
        view = w["model." + name]
        assert t.data_ptr() == view.ctypes.data, name  # the map itself, not a copy of it
        assert torch.equal(t.view(torch.uint8), sd[name].view(torch.uint8)), name
    args = (torch.tensor([[5, 9, 11, 3]]), torch.tensor([0]), torch.tensor([4]), torch.tensor([0]))
    with torch.no_grad():
        a = copied(*args, new_state(copied.cfg, 1, torch.bfloat16))
        b = mapped(*args, new_state(mapped.cfg, 1, torch.bfloat16))
    assert torch.equal(a, b)


def test_load_irpa_reads_the_fnuz_flavour_as_the_same_values(random_export: Path) -> None:
    """The e4m3fnuz files (gfx942's) load into the e4m3fn model through formats.fp8_fnuz_to_fn and
    give the very same tensors as the e4m3fn files."""
    import torch

    from dsv4.model.checkpoint.irpa import load_irpa

    fn_group, fnuz_group = ExportConfig.load(random_export).weight_groups()
    a = load_irpa(_tiny_quantized(), fn_group.files).state_dict()
    b = load_irpa(_tiny_quantized(), fnuz_group.files).state_dict()
    assert all(torch.equal(a[k].view(torch.uint8) if a[k].dtype == torch.float8_e4m3fn else a[k],
                           b[k].view(torch.uint8) if b[k].dtype == torch.float8_e4m3fn else b[k]) for k in a)


def test_load_irpa_names_every_problem_at_once(random_export: Path, tmp_path: Path) -> None:
    """Missing, extra, mis-shaped and mis-typed tensors are reported together, before any copy."""
    from dsv4.model.checkpoint import CheckpointError
    from dsv4.model.checkpoint.irpa import load_irpa

    (g, w), _ = _group_weights(random_export)
    keep = [(k, w.tensor(k), w.spec(k)[1]) for k in w if k != "model.layers.0.attn.wq_a.weight"]
    keep = [(k, np.zeros((2, 3), np.float32), "float32") if k == "model.norm.weight" else
            (k, a.view(np.int16), "bfloat16") if k == "model.hc_head_base" else (k, a, dt) for k, a, dt in keep]
    keep.append(("model.stray", np.zeros(3, np.float32), "float32"))
    files = write_shards(tmp_path, keep)
    with pytest.raises(CheckpointError) as e:
        load_irpa(_tiny_quantized(), [tmp_path / f for f in files])
    msg = str(e.value)
    assert "4 problem(s)" in msg
    assert "missing: model.layers.0.attn.wq_a.weight (model expects float8_e4m3fn [128, 128])" in msg
    assert "shape: model.norm.weight is [2, 3] (24 bytes)" in msg and "the model has [128]" in msg
    assert "dtype: model.hc_head_base is bfloat16" in msg
    assert "extra: model.stray" in msg


@pytest.mark.slow
def test_load_irpa_round_trips_an_export(tiny_q_export: Path, tmp_path: Path) -> None:
    """The exporter's own model.irpa (written by iree-turbine, keys 'model.' + state-dict names; conftest's
    shared quantized tiny export) loads back into the model it was exported from, every tensor bit for bit."""
    import torch

    from dsv4.model.checkpoint.irpa import load_export_model

    want = tiny_q_model(tmp_path).state_dict()
    model, cfg, dtype = load_export_model(tiny_q_export)
    assert dtype == torch.float32 and cfg == model.cfg
    got = model.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k


@pytest.mark.slow
def test_compiled_equals_eager_on_weights_made_by_weights_random(tiny_q_export: Path, tmp_path: Path) -> None:
    """The GPU-host flow at tiny size: an export without its weights, `dsv4 weights random` makes
    them, the compiled module runs them, and eager torch loaded from the same files (load_export_model)
    decodes the same greedy tokens."""
    from dsv4.model.checkpoint.irpa import load_export_model, param_inventory
    import torch

    from dsv4.model.generate import greedy
    from dsv4.model.state import new_state
    from dsv4.cli import main
    from dsv4.runtime.engine import Engine
    from dsv4.contract.weights import planned_names

    d = tmp_path / "nw"
    shutil.copytree(tiny_q_export, d, ignore=shutil.ignore_patterns("*.mlir", "*.gfx942.vmfb", "*.irpa"))
    cfg = json.loads((d / "config.json").read_text())
    del cfg["targets"]["gfx942"]  # an llvm-cpu export (the gfx942 flavour's own weights: tests/test_fnuz_export.py)
    specs = param_inventory(_tiny_q_on_meta())
    cfg.update(parameters=planned_names(specs, "model", 1 << 17),
               weights={"tensors": [s.to_json() for s in specs], "shard_bytes": 1 << 17})
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ArtifactError, match="dsv4 weights random"):
        Engine(d)
    assert main(["weights", "random", str(d), "--seed", "7"]) == 0
    eng = Engine(d)
    assert len(eng.parameters_paths) > 3
    model, _, _ = load_export_model(d)
    for prompt in ([5, 9, 11, 3, 7, 1, 2, 8, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [300, 2, 17]):
        want = greedy(model, prompt, 24)
        got = eng.generate(prompt, max_new_tokens=24, ignore_eos=True).tokens
        # fp32 on both sides: the compiled pick is eager's top token at every step, up to a near-tie
        # (eager's logits for the compiled sequence, teacher-forced; a wrong weight moves them by far more)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + got]), *(torch.tensor([v]) for v in (0, len(prompt) + len(got), 0)),
                           new_state(model.cfg, 1, model.dtype), all_logits=True)[0, len(prompt) - 1:-1]
        gaps = [float(step.max() - step[t]) for step, t in zip(logits, got)]
        print(f"greedy agreement {sum(a == b for a, b in zip(got, want))}/24, largest gap to eager's top {max(gaps):.3g}")
        assert max(gaps) <= TIE_FP32 and got[:8] == want[:8]
        assert len(set(want)) > 3


TIE_FP32 = 1e-4  # logits of compiled fp32 vs eager fp32 differ by ~1e-6 (reduction order)


def _tiny_q_on_meta():
    import torch

    from dsv4.model.model import Transformer

    with torch.device("meta"):
        return Transformer(tiny_q_cfg(), dtype=torch.float32, quantized=True)



def test_random_weights_written_by_several_processes_are_the_same_bytes(tmp_path: Path) -> None:
    """`dsv4 weights random OUT --jobs 3`: one process per file, each file byte-equal to the
    one-process run (tiny preset's inventory cut into ~10 shards)."""
    import torch

    from dsv4.model.checkpoint.irpa import param_inventory
    from dsv4.model.config import ModelConfig
    from dsv4.model.model import empty_model
    from dsv4.contract.artifact import build_config, write_config
    from dsv4.contract.random_weights import write_random_weights
    from dsv4.contract.weights import planned_names

    cfg = ModelConfig.preset("tiny")
    specs = param_inventory(empty_model(cfg, torch.float32))
    shard = 600_000
    names = planned_names(specs, "model", shard)
    assert len(names) >= 4
    raw = build_config(model=cfg.to_dict(), activation_dtype="float32", n_slots=1, max_seq_len=cfg.max_seq_len,
                       prefill_batch_sizes=[1], min_tokens=16, max_tokens=32, decode_batch_sizes=[1],
                       score_batch_sizes=[], state=[{"name": "kv", "shape": [1, 2], "dtype": "float32"}],
                       targets={"llvm-cpu": {"vmfb": "m.vmfb"}}, parameters=names, tokenizer=None,
                       bos_token_id=None, eos_token_ids=[], export_id="x",
                       weights={"tensors": [s.to_json() for s in specs], "shard_bytes": shard})
    for d, jobs in ((tmp_path / "one", 1), (tmp_path / "three", 3)):
        d.mkdir()
        write_config(d, raw)
        write_random_weights(d, seed=5, jobs=jobs)
    assert sorted(p.name for p in (tmp_path / "three").iterdir()) == sorted(names + ["config.json"])
    for n in names:
        assert (tmp_path / "one" / n).read_bytes() == (tmp_path / "three" / n).read_bytes(), n
