"""Multi-device exports (`dsv4 export --devices N`, export/sharding.py) on llvm-cpu: N local devices
in one process must give what one device gives.

The model is the tiny preset with 8 query heads in 8 o_groups (so 1, 2, 4 and 8 devices divide heads,
groups, the 8 routed experts and the 512-token vocabulary) in the release format (FP8 linears, MXFP4
experts) with fp32 activations, random weights from one seed: every export holds the same weights,
cut per device. The reference is the N = 1 export of the same weights (itself checked against eager
torch by the other export tests). The logits compared come from a 14-token prompt and the step after
it, where the CSA indexer (top-4 of the ratio-4 entries) still selects every visible entry, so a
near-tie in its scores cannot turn a last-bit difference from a split sum into a different selection;
the greedy continuation runs past that (measured: all logits bitwise equal for N = 2, 4, 8)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dsv4.model.config import ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")

SEED = 0
PROMPT = [3, 17, 100, 250, 511, 7, 42, 300, 5, 64, 128, 256, 1, 2]  # 14 tokens
NEW_TOKENS = 8


def _cfg() -> ModelConfig:
    return ModelConfig.preset("tiny", num_attention_heads=8, o_groups=8)


def _export(n: int) -> Path:
    from conftest import cached_export

    from dsv4.export.exporter import export_model
    from dsv4.model.model import empty_model
    from dsv4.runtime.random_weights import random_tensors

    cfg = _cfg()
    # N = 2 also compiles the MI300X module (hip x 2; its FP8 weights are the e4m3fnuz flavour)
    targets = ["llvm-cpu", "gfx942"] if n == 2 else ["llvm-cpu"]

    def build(d: Path) -> None:
        export_model(empty_model(cfg, torch.float32), cfg, d, targets=targets, batch_sizes=[1], score=False,
                     keep_mlir=n == 2, devices=n,
                     weights=lambda specs, fp8: random_tensors(specs, cfg.to_dict(), SEED))

    return cached_export(f"multidev{n}", build, ["multidev", n, SEED, targets, cfg.to_dict()])


@pytest.fixture(scope="module")
def multidev_exports() -> dict[int, Path]:
    return {}


def _get(exports: dict[int, Path], n: int) -> Path:
    if n not in exports:
        exports[n] = _export(n)
    return exports[n]


def _run(export_dir: Path) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Prefill logits of PROMPT, the next decode step's logits, and a greedy continuation."""
    from dsv4.runtime.engine import Engine

    eng = Engine(export_dir)
    n = len(PROMPT)
    i64 = np.int64
    state = [eng.module.zeros(s) for s in eng.config.state]
    toks = np.array([PROMPT], i64)
    pre, arg = eng.module("prefill_bs1", toks, np.zeros(1, i64), np.array([n], i64), np.zeros(1, i64), *state)
    dec, _ = eng.module("decode_bs1", arg.reshape(1, 1).astype(i64), np.array([n], i64), np.ones(1, i64),
                        np.zeros(1, i64), *state)
    greedy = eng.generate(PROMPT, max_new_tokens=NEW_TOKENS).tokens
    return pre, dec, list(greedy)


@pytest.mark.slow  # compiles (or reads) the cached multi-device exports
@pytest.mark.parametrize("n", [2, 4, 8])
def test_n_devices_equal_one_device(multidev_exports: dict[int, Path], n: int) -> None:
    ref = _run(_get(multidev_exports, 1))
    got = _run(_get(multidev_exports, n))
    for a, b in zip(ref[:2], got[:2]):
        assert a.shape == b.shape == (1, _cfg().vocab_size)
        # fp32 activations: only the order of the split sums changes
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max(), np.abs(a - b).max()
        assert int(a.argmax()) == int(b.argmax())
    assert got[2] == ref[2]


@pytest.mark.slow  # compiles (or reads) the cached multi-device exports
def test_multidevice_config_records_layout_and_per_device_weights(multidev_exports: dict[int, Path]) -> None:
    from dsv4.runtime.artifact import ExportConfig

    d = _get(multidev_exports, 2)
    raw = json.loads((d / "config.json").read_text())
    cfg = _cfg()
    assert raw["devices"]["count"] == 2 and ExportConfig.load(d).n_devices == 2
    assert raw["devices"]["experts_per_device"] == cfg.n_routed_experts // 2
    flags = raw["targets"]["llvm-cpu"]["flags"]
    assert [f for f in flags if f.startswith("--iree-hal-target-device")] == [
        "--iree-hal-target-device=local[0]", "--iree-hal-target-device=local[1]"]
    shapes = {k: s for k, s, _ in raw["weights"]["tensors"]}
    assert "model.layers.0.ffn.experts.w1" not in shapes and "model.head.weight" not in shapes
    for dev in range(2):
        assert shapes[f"model.layers.0.ffn.experts.shards.{dev}.w1"][0] == cfg.n_routed_experts // 2
        assert shapes[f"model.head.shards.{dev}.weight"] == [cfg.vocab_size // 2, cfg.hidden_size]
        assert shapes[f"model.embed.shards.{dev}.weight"] == [cfg.vocab_size // 2, cfg.hidden_size]
        assert shapes[f"model.layers.1.attn.head_shards.shards.{dev}.wq_b.weight"] == [
            cfg.num_attention_heads // 2 * cfg.head_dim, cfg.q_lora_rank]
    # the compiled graph places each shard's parameters on its device
    mlir = (d / "model.mlir").read_text()
    assert '{stream.affinity = #hal.device.promise<@__device_1>} = #flow.parameter.named<"model"::' \
           '"model.layers.0.ffn.experts.shards.1.w1">' in mlir
    assert "flow.tensor.transfer" in mlir


@pytest.mark.slow  # compiles (or reads) the cached multi-device exports
def test_engine_refuses_a_device_count_the_export_was_not_built_for(multidev_exports: dict[int, Path]) -> None:
    from dsv4.runtime.engine import Engine
    from dsv4.runtime.errors import EngineError

    with pytest.raises(EngineError, match="exported for 2 device"):
        Engine(_get(multidev_exports, 2), devices=1)


@pytest.mark.slow  # compiles (or reads) the cached multi-device exports
def test_two_device_module_compiles_for_gfx942(multidev_exports: dict[int, Path]) -> None:
    """The MI300X path (hip x 2): compiled only (nothing here runs it); the vmfb holds gfx942 code and
    reads per-device e4m3fnuz weights."""
    from dsv4.export.compile import vmfb_executables
    from dsv4.runtime.artifact import ExportConfig

    d = _get(multidev_exports, 2)
    cfg = ExportConfig.load(d)
    info = cfg.targets["gfx942"]
    assert [f for f in info["flags"] if f.startswith("--iree-hal-target-device")] == [
        "--iree-hal-target-device=hip[0]", "--iree-hal-target-device=hip[1]"]
    assert info["fp8_dtype"] == "float8_e4m3fnuz"
    group = next(g for g in cfg.weight_groups() if "gfx942" in g.targets)
    assert any(".shards.1." in s.name and s.dtype == "float8_e4m3fnuz" for s in group.specs)
    exes = [e for e in vmfb_executables(d / info["vmfb"]) if not e.entry.startswith("_const")]  # not constant blobs
    assert exes and {e.gpu_arch for e in exes} == {"gfx942"} and {e.format for e in exes} == {"rocm-hsaco-fb"}


def test_devices_that_do_not_divide_fail_before_tracing(tmp_path: Path) -> None:
    from dsv4.export.exporter import ExportError, export_model
    from dsv4.model.model import empty_model

    cfg = ModelConfig.preset("tiny")  # 4 heads, 2 o_groups, 8 experts
    with pytest.raises(ExportError, match="validate.*cannot split this model over 3 devices: 3 does not divide "
                                          "attention heads"):
        export_model(empty_model(cfg, torch.float32), cfg, tmp_path / "x", targets=["llvm-cpu"], devices=3)
    with pytest.raises(ExportError, match="o_groups = 2"):
        export_model(empty_model(cfg, torch.float32), cfg, tmp_path / "x", targets=["llvm-cpu"], devices=4)
    assert not (tmp_path / "x").exists()


def test_shard_tensors_cuts_whole_tensors_into_the_device_keys() -> None:
    from dsv4.export.sharding import shard_key, shard_tensors

    w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    out = list(shard_tensors([("model.layers.2.ffn.experts.w2_scale", w, "float32"),
                              ("model.layers.2.ffn.gate.weight", w, "float32")], 4))
    assert [k for k, _, _ in out] == [f"model.layers.2.ffn.experts.shards.{d}.w2_scale" for d in range(4)] + [
        "model.layers.2.ffn.gate.weight"]
    assert np.array_equal(np.concatenate([a for _, a, _ in out[:4]]), w)
    assert shard_key("model.mtp.0.attn.wq_b.scale", 2) == [
        "model.mtp.0.attn.head_shards.shards.0.wq_b.scale", "model.mtp.0.attn.head_shards.shards.1.wq_b.scale"]
    assert shard_key("model.layers.1.attn.indexer.wq_b.weight", 2) is None  # the indexer stays whole


def test_two_device_transfer_reproduction_runs_on_two_local_devices(tmp_path: Path) -> None:
    """bench/two_devices.mlir, the minimal module of docs/scale.md (fails across two CUDA GPUs with
    IREE 3.13): compiled for two local devices, run on two local-task devices in one context."""
    import iree.runtime as rt

    from dsv4.export.compile import compile_mlir, resolve_target
    from dsv4.runtime.module import IreeModule

    src = Path(__file__).resolve().parents[1] / "bench" / "two_devices.mlir"
    vmfb = compile_mlir(src, resolve_target("llvm-cpu").with_devices(2), tmp_path / "two.vmfb").path
    m = IreeModule(vmfb, devices=2)
    assert len(m.devices) == 2 and m.devices[0] is not m.devices[1]
    x = np.array([1, 2, 3, 4], np.float32)
    assert np.array_equal(m("main", x), 2 * x)
    assert isinstance(m.devices[1], rt.HalDevice)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_sharded_model_parameters_are_the_contracts_per_device_inventory(n: int) -> None:
    """The shard modules (export/sharding.py) hold exactly artifact.shard_inventory's tensors, whose
    whole_inventory is the one-device inventory again; the model is restored afterwards."""
    from dsv4.export.sharding import check_devices, sharded
    from dsv4.model.checkpoint.irpa import param_inventory
    from dsv4.model.model import empty_model
    from dsv4.runtime.artifact import shard_inventory, whole_inventory

    cfg = _cfg()
    model = empty_model(cfg, torch.float32)
    whole = param_inventory(model)
    per_device = shard_inventory(whole, n)
    with sharded(model, n):
        assert sorted(param_inventory(model), key=str) == sorted(per_device, key=str)
    assert param_inventory(model) == whole and model.layers[0].attn.head_shards is None
    assert whole_inventory(per_device, n) == whole
    # the exporter's own weights (weights="model") come out under the same keys
    from dsv4.export.exporter import _model_tensors
    from dsv4.runtime.artifact import shard_tensors

    assert [k for k, _, _ in shard_tensors(_model_tensors(model, "default"), n)] == [s.name for s in per_device]
    for preset in ("flash", "pro"):  # the real models split over 2, 4 and 8 devices
        check_devices(ModelConfig.preset(preset), n)


@pytest.mark.slow  # compiles (or reads) the cached multi-device exports
def test_random_weights_of_a_multidevice_export_are_the_one_device_weights_cut(
        multidev_exports: dict[int, Path], tmp_path: Path) -> None:
    """`dsv4 weights random` on an N-device export (made with --no-weights) writes the whole random
    tensors cut per device: bytes equal to the exporter's own (same seed) and to the N = 1 export's."""
    import shutil

    from dsv4.runtime.artifact import ExportConfig, shard_key
    from dsv4.runtime.random_weights import write_random_weights
    from dsv4.runtime.weights import open_weights

    two, one = _get(multidev_exports, 2), _get(multidev_exports, 1)
    shutil.copyfile(two / "config.json", tmp_path / "config.json")
    written = write_random_weights(tmp_path, SEED)  # every flavour's files (gfx942's e4m3fnuz ones too)
    files = ExportConfig.load(tmp_path).parameters
    assert set(files) <= set(written)
    mine, exported = open_weights(files), open_weights(ExportConfig.load(two).parameters)
    whole = open_weights(ExportConfig.load(one).parameters)
    assert set(mine) == set(exported)
    for k in mine:
        assert np.array_equal(mine.tensor(k), exported.tensor(k)), k
    for k in whole:
        keys = shard_key(k, 2)
        got = whole.tensor(k) if keys is None else np.concatenate([mine.tensor(s) for s in keys])
        assert np.array_equal(got, whole.tensor(k)), k


@pytest.mark.slow  # compiles (or reads) the cached multi-device exports
def test_eager_model_loads_a_multidevice_exports_weights_whole(multidev_exports: dict[int, Path]) -> None:
    """load_export_model (dsv4 bench --compare's torch side) joins the per-device parts: the eager
    model of the N = 2 export is the N = 1 export's, tensor for tensor."""
    from dsv4.model.checkpoint.irpa import load_export_model

    one, _, _ = load_export_model(_get(multidev_exports, 1))
    two, _, _ = load_export_model(_get(multidev_exports, 2))
    a, b = one.state_dict(), two.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def test_checkpoint_weights_stream_cut_for_two_devices() -> None:
    """`dsv4 export --checkpoint DIR --devices 2`: the checkpoint's tensors, read whole, cut into the
    per-device inventory (the embedded checkpoint: 4 heads, 2 o_groups, 8 experts, vocab 2048)."""
    from dsv4.model.checkpoint import EMBEDDED_CHECKPOINT, checkpoint_tensors, load_checkpoint
    from dsv4.model.checkpoint.irpa import param_inventory
    from dsv4.runtime.artifact import shard_inventory, shard_tensors
    from dsv4.runtime.weights import checked

    model = load_checkpoint(EMBEDDED_CHECKPOINT, dtype=torch.bfloat16, weights=False)
    specs = shard_inventory(param_inventory(model), 2)
    got = [(k, a.shape) for k, a, _ in checked(shard_tensors(checkpoint_tensors(EMBEDDED_CHECKPOINT, model), 2), specs)]
    assert [k for k, _ in got] == [s.name for s in specs] and [tuple(a) for _, a in got] == [s.shape for s in specs]
