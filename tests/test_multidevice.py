"""Multi-device exports (`dsv4 export --devices N`, export/sharding.py) on llvm-cpu: N local devices
in one process must give what one device gives.

The model is the tiny preset with 8 query heads in 8 o_groups (so 1, 2, 4 and 8 devices divide heads,
groups, the 8 routed experts and the 512-token vocabulary) in the release format (FP8 linears, MXFP4
experts) with fp32 activations, random weights from one seed: every export holds the same weights,
cut per device. The reference is the N = 1 export of the same weights, conftest's tiny_q_export (made
from the model those weights were loaded into; the other export tests check one-device exports
against eager torch). The logits compared come from a 14-token prompt and the step after
it, where the CSA indexer (top-4 of the ratio-4 entries) still selects every visible entry, so a
near-tie in its scores cannot turn a last-bit difference from a split sum into a different selection;
the greedy continuation runs past that (measured: all logits bitwise equal for N = 2, 4, 8).

Which N are compiled (each export costs a minute or more on 2 cores): the sharding code is one loop
over devices d = 0..N-1 with offsets d * (count / N), the same for every N, so one split module that
has more than two parts proves it: N = 4 (devices 0..3, 2 heads, 2 o_groups, 2 experts and 128 vocabulary
rows each) sums four partial expert outputs and four embedding shards, concatenates four head groups
and logit shards, and uses device indices above 1 and offsets that are neither 0 nor count / 2, which
a 2-way split cannot tell from a hard-coded half. The N = 4 export also carries the structural
checks (config layout, per-device weights, the gfx942 compile over hip[0..3]). Two devices are covered
by the pipeline export (2 stage modules on 2 devices, bitwise equal to one module) and by the
two-device transfer module; the per-device inventory for N = 2, 4, 8 (and the real presets' splits)
is checked without compiling."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TINY_Q_ARGS, TINY_Q_SEED, tiny_q_cfg

from dsv4.model.config import ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")

SEED = TINY_Q_SEED
PROMPT = [3, 17, 100, 250, 511, 7, 42, 300, 5, 64, 128, 256, 1, 2]  # 14 tokens
NEW_TOKENS = 8
N = 4  # the device count of the split export (see above)


def _cfg() -> ModelConfig:
    return tiny_q_cfg()  # tiny with 8 query heads in 8 o_groups


def _export(n: int, pipeline: bool = False) -> Path:
    """The N-device (or N-stage pipeline) export: the one-device export's spec and random weights."""
    from conftest import cached_export

    from dsv4.export.exporter import ExportSpec, export_model
    from dsv4.model.model import empty_model
    from dsv4.contract.random_weights import random_tensors

    cfg = _cfg()
    # the split export also compiles the MI300X module (hip x N; its FP8 weights are the e4m3fnuz flavour)
    targets = ["llvm-cpu", "gfx942"] if n == N and not pipeline else ["llvm-cpu"]

    def build(d: Path) -> None:
        spec = ExportSpec(**{**TINY_Q_ARGS, "targets": targets, "keep_mlir": n == N and not pipeline}, devices=n,
                          pipeline=pipeline)
        export_model(empty_model(cfg, torch.float32), spec, d, weights=lambda specs, fp8: random_tensors(specs, cfg.to_dict(), SEED))

    if pipeline:
        return cached_export(f"pipeline{n}", build, ["pipeline", n, SEED, targets, cfg.to_dict(), sorted(TINY_Q_ARGS.items())])
    return cached_export(f"multidev{n}", build, ["multidev", n, SEED, targets, cfg.to_dict(), sorted(TINY_Q_ARGS.items())])


@pytest.fixture(scope="module")
def multidev_exports(tiny_q_export: Path) -> dict[int, Path]:
    return {1: tiny_q_export}


def _get(exports: dict[int, Path], n: int) -> Path:
    if n not in exports:
        exports[n] = _export(n)
    return exports[n]


def _run(export_dir: Path, **engine_args) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Prefill logits of PROMPT, the next decode step's logits, and a greedy continuation."""
    from dsv4.runtime.engine import Engine

    eng = Engine(export_dir, **engine_args)
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
def test_n_devices_equal_one_device(multidev_exports: dict[int, Path]) -> None:
    ref = _run(_get(multidev_exports, 1))
    got = _run(_get(multidev_exports, N))
    for a, b in zip(ref[:2], got[:2]):
        assert a.shape == b.shape == (1, _cfg().vocab_size)
        # fp32 activations: only the order of the split sums changes
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max(), np.abs(a - b).max()
        assert int(a.argmax()) == int(b.argmax())
    assert got[2] == ref[2]


@pytest.mark.slow  # compiles (or reads) the cached multi-device exports
def test_multidevice_config_records_layout_and_per_device_weights(multidev_exports: dict[int, Path]) -> None:
    from dsv4.contract.artifact import ExportConfig

    d = _get(multidev_exports, N)
    raw = json.loads((d / "config.json").read_text())
    cfg = _cfg()
    assert raw["devices"]["count"] == N and ExportConfig.load(d).n_devices == N
    assert raw["devices"]["experts_per_device"] == cfg.n_routed_experts // N
    flags = raw["targets"]["llvm-cpu"]["flags"]
    assert [f for f in flags if f.startswith("--iree-hal-target-device")] == [
        f"--iree-hal-target-device=local[{dev}]" for dev in range(N)]
    shapes = {k: s for k, s, _ in raw["weights"]["tensors"]}
    assert "model.layers.0.ffn.experts.w1" not in shapes and "model.head.weight" not in shapes
    assert f"model.head.shards.{N}.weight" not in shapes
    for dev in range(N):
        assert shapes[f"model.layers.0.ffn.experts.shards.{dev}.w1"][0] == cfg.n_routed_experts // N
        assert shapes[f"model.head.shards.{dev}.weight"] == [cfg.vocab_size // N, cfg.hidden_size]
        assert shapes[f"model.embed.shards.{dev}.weight"] == [cfg.vocab_size // N, cfg.hidden_size]
        assert shapes[f"model.layers.1.attn.head_shards.shards.{dev}.wq_b.weight"] == [
            cfg.num_attention_heads // N * cfg.head_dim, cfg.q_lora_rank]
    # the compiled graph places each shard's parameters on its device
    mlir = (d / "model.mlir").read_text()
    for dev in range(N):
        assert f'{{stream.affinity = #hal.device.promise<@__device_{dev}>}} = #flow.parameter.named<"model"::' \
               f'"model.layers.0.ffn.experts.shards.{dev}.w1">' in mlir
    assert "flow.tensor.transfer" in mlir


@pytest.mark.slow  # compiles (or reads) the cached multi-device exports
def test_engine_refuses_a_device_count_the_export_was_not_built_for(multidev_exports: dict[int, Path]) -> None:
    from dsv4.runtime.engine import Engine
    from dsv4.contract.errors import EngineError

    with pytest.raises(EngineError, match=f"exported for {N} device"):
        Engine(_get(multidev_exports, N), devices=1)


@pytest.mark.slow  # compiles (or reads) the cached multi-device exports
def test_multidevice_module_compiles_for_gfx942(multidev_exports: dict[int, Path]) -> None:
    """The MI300X path (hip x N): compiled only (nothing here runs it); the vmfb holds gfx942 code and
    reads per-device e4m3fnuz weights."""
    from dsv4.export.compile import vmfb_executables
    from dsv4.contract.artifact import ExportConfig

    d = _get(multidev_exports, N)
    cfg = ExportConfig.load(d)
    info = cfg.targets["gfx942"]
    assert [f for f in info["flags"] if f.startswith("--iree-hal-target-device")] == [
        f"--iree-hal-target-device=hip[{dev}]" for dev in range(N)]
    assert info["fp8_dtype"] == "float8_e4m3fnuz"
    group = next(g for g in cfg.weight_groups() if "gfx942" in g.targets)
    assert any(f".shards.{N - 1}." in s.name and s.dtype == "float8_e4m3fnuz" for s in group.specs)
    exes = [e for e in vmfb_executables(d / info["vmfb"]) if not e.entry.startswith("_const")]  # not constant blobs
    assert exes and {e.gpu_arch for e in exes} == {"gfx942"} and {e.format for e in exes} == {"rocm-hsaco-fb"}


def test_devices_that_do_not_divide_fail_before_tracing(tmp_path: Path) -> None:
    from dsv4.export.exporter import ExportError, ExportSpec, export_model
    from dsv4.model.model import empty_model

    cfg = ModelConfig.preset("tiny")  # 4 heads, 2 o_groups, 8 experts
    with pytest.raises(ExportError, match="validate.*cannot split this model over 3 devices: 3 does not divide "
                                          "attention heads"):
        export_model(empty_model(cfg, torch.float32), ExportSpec(targets=["llvm-cpu"], devices=3), tmp_path / "x")
    with pytest.raises(ExportError, match="o_groups = 2"):
        export_model(empty_model(cfg, torch.float32), ExportSpec(targets=["llvm-cpu"], devices=4), tmp_path / "x")
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


# y = (x on device 1) * 2, returned on device 0: two named devices and a transfer each way
TWO_DEVICES_MLIR = """
module {
  func.func @main(%x: tensor<4xf32>) -> tensor<4xf32> {
    %a = flow.tensor.transfer %x : tensor<4xf32> to #hal.device.promise<@__device_1>
    %b = arith.addf %a, %a : tensor<4xf32>
    %c = flow.tensor.transfer %b : tensor<4xf32> to #hal.device.promise<@__device_0>
    return %c : tensor<4xf32>
  }
}
"""


@pytest.mark.small_compile  # a minimal module (a second or two)
def test_two_device_transfer_reproduction_runs_on_two_local_devices(tmp_path: Path) -> None:
    """TWO_DEVICES_MLIR, the minimal module of docs/scale.md (hangs across two CUDA GPUs with
    IREE 3.13's async allocations, runs without them): compiled for two local devices, run on two
    local-task devices in one context."""
    import iree.runtime as rt

    from dsv4.export.compile import compile_mlir, resolve_target
    from dsv4.runtime.module import IreeModule

    src = tmp_path / "two_devices.mlir"
    src.write_text(TWO_DEVICES_MLIR)
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
    from dsv4.contract.artifact import shard_inventory, whole_inventory

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
    from dsv4.contract.artifact import shard_tensors

    assert [k for k, _, _ in shard_tensors(_model_tensors(model, "default"), n)] == [s.name for s in per_device]
    for preset in ("flash", "pro"):  # the real models split over 2, 4 and 8 devices
        check_devices(ModelConfig.preset(preset), n)


@pytest.mark.slow  # compiles (or reads) the cached multi-device exports
def test_random_weights_of_a_multidevice_export_are_the_one_device_weights_cut(
        multidev_exports: dict[int, Path], tmp_path: Path) -> None:
    """`dsv4 weights random` on an N-device export (made with --no-weights) writes the whole random
    tensors cut per device: bytes equal to the exporter's own (same seed) and to the N = 1 export's."""
    import shutil

    from dsv4.contract.artifact import ExportConfig, shard_key
    from dsv4.contract.random_weights import write_random_weights
    from dsv4.contract.weights import open_weights

    split, one = _get(multidev_exports, N), _get(multidev_exports, 1)
    shutil.copyfile(split / "config.json", tmp_path / "config.json")
    written = write_random_weights(tmp_path, SEED)  # every flavour's files (gfx942's e4m3fnuz ones too)
    files = ExportConfig.load(tmp_path).parameters
    assert set(files) <= set(written)
    mine, exported = open_weights(files), open_weights(ExportConfig.load(split).parameters)
    whole = open_weights(ExportConfig.load(one).parameters)
    assert set(mine) == set(exported)
    for k in mine:
        assert np.array_equal(mine.tensor(k), exported.tensor(k)), k
    for k in whole:
        keys = shard_key(k, N)
        got = whole.tensor(k) if keys is None else np.concatenate([mine.tensor(s) for s in keys])
        assert np.array_equal(got, whole.tensor(k)), k


@pytest.mark.slow  # compiles (or reads) the cached multi-device exports
def test_eager_model_loads_a_multidevice_exports_weights_whole(multidev_exports: dict[int, Path]) -> None:
    """load_export_model (dsv4 bench --compare's torch side) joins the per-device parts: the eager
    model of the N-device export is the N = 1 export's, tensor for tensor."""
    from dsv4.model.checkpoint.irpa import load_export_model

    one, _, _ = load_export_model(_get(multidev_exports, 1))
    split, _, _ = load_export_model(_get(multidev_exports, N))
    a, b = one.state_dict(), split.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def test_checkpoint_weights_stream_cut_for_two_devices() -> None:
    """`dsv4 export --checkpoint DIR --devices 2`: the checkpoint's tensors, read whole, cut into the
    per-device inventory (the embedded checkpoint: 4 heads, 2 o_groups, 8 experts, vocab 2048)."""
    from dsv4.model.checkpoint import EMBEDDED_CHECKPOINT, checkpoint_tensors, load_checkpoint
    from dsv4.model.checkpoint.irpa import param_inventory
    from dsv4.contract.artifact import shard_inventory, shard_tensors
    from dsv4.contract.weights import checked

    model = load_checkpoint(EMBEDDED_CHECKPOINT, dtype=torch.bfloat16, weights=False)
    specs = shard_inventory(param_inventory(model), 2)
    got = [(k, a.shape) for k, a, _ in checked(shard_tensors(checkpoint_tensors(EMBEDDED_CHECKPOINT, model), 2), specs)]
    assert [k for k, _ in got] == [s.name for s in specs] and [tuple(a) for _, a in got] == [s.shape for s in specs]


# ------------------------------------------------------------------------------------------------
# pipeline exports (`--devices N --pipeline`, export/pipeline.py): one module per stage


@pytest.mark.parametrize("n", [2, 3])
def test_pipeline_stages_in_eager_torch_are_the_whole_model_bitwise(n: int) -> None:
    """Layers [first, last) per Stage, each on its own state tensors, the streams handed on as
    float32: the same logits as the whole model (bf16, prefill then 4 decode steps), and each stage's
    state equals its slice of the whole model's."""
    from dsv4.export.pipeline import Stage, stage_bounds
    from dsv4.model.model import Transformer, init_random
    from dsv4.model.state import StateLayout, new_state

    cfg = ModelConfig.preset("tiny")
    model = init_random(Transformer(cfg, dtype=torch.bfloat16), seed=1).eval()
    layout = StateLayout(cfg)
    whole = new_state(cfg, 2, torch.bfloat16)
    bounds = stage_bounds(cfg.n_layers, n)
    stages = [Stage(model, a, b) for a, b in bounds]
    states = [{k: torch.zeros(shape, dtype=dt) for k, (shape, dt) in layout.stage_spec(2, torch.bfloat16, a, b).items()}
              for a, b in bounds]
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    start, lengths, slots = torch.zeros(2, dtype=torch.long), torch.tensor([24, 19]), torch.tensor([1, 0])

    def staged(t, s0, ln):
        h = None
        for stage, st in zip(stages, states):
            h = stage(t, s0, ln, slots, st, h=h)
        return h

    with torch.no_grad():
        ref, got = model(tokens, start, lengths, slots, whole), staged(tokens, start, lengths)
        assert torch.equal(ref, got)
        one = torch.ones(2, dtype=torch.long)
        for step in range(4):
            nxt = ref.argmax(-1)[:, None]
            ref, got = model(nxt, lengths + step, one, slots, whole), staged(nxt, lengths + step, one)
            assert torch.equal(ref, got), step
    for k, (a, b) in enumerate(bounds):
        for name, (lo, hi) in layout.stage(a, b)[1].items():
            assert torch.equal(whole[name][:, lo:hi], states[k][name]), (k, name)


def test_stage_state_layout_renumbers_each_layers_rows() -> None:
    """tiny: ratios (0, 4, 16, 4 | MTP 0); stage [1, 4) holds win_kv rows 1-3, both ratio-4 groups
    and the ratio-16 group, renumbered from 0; stage [0, 1) only its window row."""
    from dsv4.model.state import LayerState, StateLayout

    cfg = ModelConfig.preset("tiny")
    assert cfg.compress_ratios[:4] == (0, 4, 16, 4)
    layout = StateLayout(cfg)
    states, ranges = layout.stage(1, 4)
    assert states == [LayerState(4, 0, 0), LayerState(16, 0, 1), LayerState(4, 1, 2)]
    assert ranges["win_kv"] == (1, 4) and ranges["kv_r4"] == (0, 2) and ranges["idx_kv_r4"] == (0, 2)
    assert ranges["cmp_r16"] == (0, 1)
    states, ranges = layout.stage(3, 4)
    assert states == [LayerState(4, 0, 0)] and ranges["kv_r4"] == (1, 2) and "kv_r16" not in ranges
    assert list(layout.stage_spec(2, torch.float32, 0, 1)) == ["win_kv"]
    assert layout.stage_spec(2, torch.float32, 0, 1)["win_kv"][0] == (2, 1, cfg.sliding_window, cfg.head_dim)
    with pytest.raises(ValueError, match="outside"):
        layout.stage(2, 2)


@pytest.mark.slow  # compiles (or reads) the cached pipeline and one-device exports
def test_pipeline_export_equals_one_module(multidev_exports: dict[int, Path]) -> None:
    """Two stage modules on two local devices, the streams through host memory: the same prefill and
    decode logits as the one-module export of the same weights (bitwise: the same ops, the f32
    crossing is exact) and the same greedy continuation; the config records the stages."""
    from dsv4.contract.artifact import ExportConfig
    from dsv4.runtime.engine import Engine
    from dsv4.runtime.module import PipelineModule

    d = _export(2, pipeline=True)
    cfg = ExportConfig.load(d)
    assert cfg.pipeline == ((0, 2), (2, 4)) and cfg.n_devices == 2 and cfg.weight_devices == 1
    assert [p.name for p in cfg.stage_vmfb_paths("llvm-cpu")] == ["model.stage0.llvm-cpu.vmfb",
                                                                  "model.stage1.llvm-cpu.vmfb"]
    assert {s.name.split(".")[0] for s in cfg.state} == {"stage0", "stage1"}
    # the weights are the whole model's, one archive for both stages
    assert cfg.weights == ExportConfig.load(_get(multidev_exports, 1)).weights
    eng = Engine(d)
    assert isinstance(eng.module, PipelineModule) and eng.module.devices[0] is not eng.module.devices[1]
    ref = _run(_get(multidev_exports, 1))
    for got in (_run(d), _run(d, stage_devices=[0, 0])):  # two devices; both stages on one
        for a, b in zip(ref[:2], got[:2]):
            assert np.array_equal(a, b), np.abs(a - b).max()
        assert got[2] == ref[2]
    from dsv4.contract.errors import EngineError

    with pytest.raises(EngineError, match="stage_devices must give a device index"):
        Engine(d, stage_devices=[0])
    with pytest.raises(EngineError, match="stage_devices is for pipeline exports"):
        Engine(_get(multidev_exports, 1), stage_devices=[0, 0])


@pytest.mark.slow  # compiles (or reads) the cached pipeline export
def test_random_weights_of_a_pipeline_export_are_the_whole_models(tmp_path: Path) -> None:
    """`dsv4 weights random` on a pipeline export writes the whole tensors once (every stage reads
    the same archive): byte-equal to what the exporter wrote for the same seed."""
    import shutil

    from dsv4.contract.artifact import ExportConfig
    from dsv4.contract.random_weights import write_random_weights
    from dsv4.contract.weights import open_weights

    d = _export(2, pipeline=True)
    shutil.copyfile(d / "config.json", tmp_path / "config.json")
    write_random_weights(tmp_path, SEED)
    mine, exported = open_weights(ExportConfig.load(tmp_path).parameters), open_weights(ExportConfig.load(d).parameters)
    assert set(mine) == set(exported) and not any(".shards." in k for k in mine)
    for k in mine:
        assert np.array_equal(mine.tensor(k), exported.tensor(k)), k


def test_pipeline_requests_that_cannot_work_fail_before_tracing(tmp_path: Path) -> None:
    from dsv4.export.exporter import ExportError, ExportSpec, export_model
    from dsv4.model.model import empty_model

    cfg = ModelConfig.preset("tiny")  # 4 layers
    for n, msg in ((5, "cannot split 4 layers into 5 pipeline stages"), (1, "--pipeline needs --devices N with N >= 2")):
        with pytest.raises(ExportError, match=msg):
            export_model(empty_model(cfg, torch.float32), ExportSpec(targets=["llvm-cpu"], devices=n, pipeline=True),
                         tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_pipeline_config_is_validated(tmp_path: Path) -> None:
    """A pipeline config.json whose stages do not tile the layers, or that lacks a target's stage
    modules, is refused naming the field."""
    from dsv4.contract.artifact import ExportConfig, build_config
    from dsv4.contract.errors import ArtifactError

    def raw(stages, vmfbs=("a.vmfb", "b.vmfb"), state=("stage0.kv", "stage1.kv")):
        return build_config(model={"vocab_size": 8}, activation_dtype="float32", n_slots=1, max_seq_len=16,
                            prefill_batch_sizes=[1], min_tokens=2, max_tokens=8, decode_batch_sizes=[1],
                            score_batch_sizes=[], state=[{"name": n, "shape": [1, 2], "dtype": "float32"} for n in state],
                            targets={"llvm-cpu": {"vmfb": vmfbs[0], "stages": list(vmfbs)}}, parameters="p.irpa",
                            tokenizer=None, bos_token_id=None, eos_token_ids=[], export_id="x",
                            devices={"count": 2, "split": "pipeline", "stages": stages})

    assert ExportConfig.from_dict(raw([[0, 2], [2, 4]]), tmp_path).pipeline == ((0, 2), (2, 4))
    with pytest.raises(ArtifactError, match="devices.stages"):
        ExportConfig.from_dict(raw([[0, 2], [3, 4]]), tmp_path)
    with pytest.raises(ArtifactError, match="targets.llvm-cpu.stages"):
        ExportConfig.from_dict(raw([[0, 2], [2, 4]], vmfbs=("a.vmfb",)), tmp_path)
    with pytest.raises(ArtifactError, match="stage<k>"):
        ExportConfig.from_dict(raw([[0, 2], [2, 4]], state=("stage0.kv", "kv")), tmp_path)


def test_cli_pipeline_needs_two_devices(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dsv4.cli import main

    assert main(["export", "--preset", "tiny", "--target", "llvm-cpu", "--pipeline", "-o", str(tmp_path / "x")]) == 2
    assert "--pipeline needs --devices N with N >= 2" in capsys.readouterr().err


def test_cuda_async_allocations_are_turned_off_before_a_multi_gpu_engine() -> None:
    """IREE 3.13's cuda driver hangs or aborts (queue.dealloca) when one process drives two GPUs with
    stream-ordered allocations; the runtime parses --cuda_async_allocations=false before the driver
    exists, and refuses (one clear error) once a one-GPU cuda device was opened first. Run in fresh
    interpreters: the flag and the driver are per process."""
    import subprocess
    import sys

    code = ("from dsv4.runtime import module as m\n"
            "m._cuda_for_several_gpus('local-task'); assert not m._cuda_several\n"  # other drivers: untouched
            "m._cuda_for_several_gpus('cuda'); assert m._cuda_several\n"
            "m._cuda_for_several_gpus('cuda')\n")  # once is enough
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0
    code = ("from dsv4.runtime import module as m\n"
            "from dsv4.contract.errors import EngineError\n"
            "m._cuda_opened = True\n"  # what _open_devices records for a one-GPU cuda module
            "try:\n    m._cuda_for_several_gpus('cuda')\nexcept EngineError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "open the multi-GPU engine first" in out.stdout, out.stderr
