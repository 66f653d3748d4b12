"""`dsv4 bench`: the report's structure and arithmetic on a tiny export (local-task), the roofline's
byte count against a hand count, the torch side's weights against the model the export was made
from, and clear errors for bad arguments."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")



@pytest.fixture(scope="module")
def bench_export(tiny_fp32_export: Path) -> Path:
    """The shared tiny export (tiny preset, fp32, llvm-cpu, prefill/decode bs 1 and 4; cached
    under .cache/ by tests/conftest.py): one export serves the export, Engine and bench tests."""
    return tiny_fp32_export


def _bench(capsys, *argv: str) -> tuple[int, str, str]:
    from dsv4.cli import main

    rc = main(["bench", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_bench_json_structure_and_arithmetic(bench_export: Path, capsys) -> None:
    steps, warmup, ctx = 4, 1, 40
    rc, out, err = _bench(capsys, str(bench_export), "--batch", "1,4", "--context", f"{ctx},100000",
                          "--prefill", "20", "--steps", str(steps), "--warmup", str(warmup),
                          "--compare", "torch-eager", "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert {"export", "device", "model", "settings", "copy_bandwidth_gbps", "decode", "ttft", "profile",
            "notes"} <= set(rep)
    assert rep["copy_bandwidth_gbps"] > 0
    assert any("100000" in n and "max_seq_len 256" in n for n in rep["notes"])  # over the export's context
    backends = ["iree local-task", "torch-eager (cpu)"]
    assert [(r["backend"], r["batch"], r["context"]) for r in rep["decode"]] == \
        [(b, n, ctx) for b in backends for n in (1, 4)]
    for r in rep["decode"]:
        assert r["ms_per_step"] > 0 and r["prefill_s"] > 0 and r["roofline_bytes"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 1000 / r["ms_per_step"], rel=1e-12)
        assert r["prefill_tokens"] == r["batch"] * (ctx - steps - warmup)
        assert r["prefill_tokens_per_s"] == pytest.approx(r["prefill_tokens"] / r["prefill_s"], rel=1e-12)
        assert r["roofline_ms"] == pytest.approx(1e3 * r["roofline_bytes"] / (rep["copy_bandwidth_gbps"] * 1e9))
        assert r["roofline_pct"] == pytest.approx(100 * r["roofline_ms"] / r["ms_per_step"])
        t = next(t for t in rep["traffic"] if (t["batch"], t["context"]) == (r["batch"], ctx))
        assert r["roofline_bytes"] == t["release"]["total"]
        assert (r["roofline"]["implementation"] is None) == (r["backend"] != backends[0])  # the lowering's bytes
        for acct in ("implementation", "release")[r["backend"] != backends[0]:]:
            got, a = r["roofline"][acct], t[acct]
            assert got["copy_pct"] == pytest.approx(100 * a["copy_ms"] / r["ms_per_step"])
            assert got["copy_pct_layers"] == pytest.approx(got["copy_pct"] * a["layers"] / a["total"])
            assert got["peak_pct"] is None  # no datasheet peak for a CPU
        # the router of torch-eager reports the experts; the compiled module does not
        assert (r["experts_distinct"] is None) == r["backend"].startswith("iree")
    assert rep["datasheet_peak_tbps"] is None
    # the same bytes per (batch, context) on every backend; more rows read more
    by = {(r["backend"], r["batch"]): r["roofline_bytes"] for r in rep["decode"]}
    assert by[(backends[0], 1)] == by[(backends[1], 1)] < by[(backends[0], 4)]
    E, k = rep["model"]["routed_experts"], rep["model"]["experts_per_token"]
    for t in rep["traffic"]:
        b = t["batch"]
        assert t["experts_measured_by"] == backends[1]
        assert t["experts_distinct_uniform"] == pytest.approx(E * (1 - (1 - k / E) ** b))
        assert k <= t["experts_distinct_measured"] <= min(E, b * k)
        assert t["implementation"]["per_layer"] * rep["model"]["layers"] == pytest.approx(t["implementation"]["layers"])
    # distinct rows route to more than one row's experts (identical rows would touch exactly k)
    assert rep["traffic"][1]["experts_distinct_measured"] > k
    assert [t["backend"] for t in rep["ttft"]] == backends
    for t in rep["ttft"]:
        assert t["prompt_tokens"] == 20 and t["ttft_ms"] > 0
        assert t["prefill_tokens_per_s"] == pytest.approx(20 / (t["ttft_ms"] / 1e3))
    prof = rep["profile"]  # IREE's HAL profiling of decode_bs4 (host-execution on local-task)
    assert prof["available"], prof.get("why")
    assert prof["batch"] == 4 and prof["calls"] >= steps and 0 < len(prof["top"]) <= 10
    # executables are named after the first function that uses them (IREE shares identical
    # dispatches between functions), so a decode step may run one named prefill_bs4$...
    assert all("$async_dispatch_" in k["name"] and k["ms_per_step"] > 0 for k in prof["top"])
    times = [k["ms_per_step"] for k in prof["top"]]
    assert times == sorted(times, reverse=True) and sum(times) <= prof["device_ms_per_step"] * (1 + 1e-9)
    assert sum(k["share"] for k in prof["top"]) <= 1 + 1e-9
    pre = rep["prefill_profile"]  # one chunk of the TTFT prompt in every row of the widest prefill
    assert pre["available"], pre.get("why")
    assert pre["function"] == f"prefill_bs{max(rep['settings']['prefill_batch_sizes'])}"
    assert pre["tokens"] == rep["settings"]["chunk"] and pre["calls"] >= steps
    # a prefill call of 20 tokens per row does more work than a one-token decode call
    assert pre["device_ms_per_step"] > prof["device_ms_per_step"] * pre["batch"] / prof["batch"]


def test_bench_no_iree_times_only_the_torch_side(bench_export: Path, capsys) -> None:
    rc, out, err = _bench(capsys, str(bench_export), "--batch", "4", "--context", "40", "--prefill", "20",
                          "--steps", "2", "--warmup", "1", "--compare", "torch-eager", "--no-iree",
                          "--no-profile", "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert [(r["backend"], r["batch"]) for r in rep["decode"]] == [("torch-eager (cpu)", 4)]
    assert [t["backend"] for t in rep["ttft"]] == ["torch-eager (cpu)"]
    assert rep["decode"][0]["prefill_tokens"] == 4 * (40 - 2 - 1)


def test_bench_table_and_plot(bench_export: Path, capsys, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    rc, out, err = _bench(capsys, str(bench_export), "--batch", "1", "--context", "24", "--steps", "2",
                          "--warmup", "1", "--prefill", "16", "--plot", str(png))
    assert rc == 0, err
    assert "ms/step" in out and "% roofline" in out and "TTFT" in out and "per-dispatch profile, decode batch 1" in out
    assert "per-dispatch profile, prefill batch" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_torch_side_runs_the_export_weights(bench_export: Path) -> None:
    """The torch backends hold exactly the tensors the export was made from, and the compiled module
    and the eager model pick the same next token after the same prompt."""
    import torch

    from dsv4.bench.torch_backends import TorchBackend, load_export_model
    from dsv4.bench.speed import IreeBackend

    model, _, dtype = load_export_model(bench_export)
    from conftest import tiny_fp32_model

    ref = tiny_fp32_model().state_dict()
    got = model.state_dict()
    assert dtype == torch.float32 and set(got) == set(ref)
    for k, v in ref.items():
        assert torch.equal(got[k], v), k
    tokens = (np.arange(4 * 16).reshape(4, 16) * 5 + 1) % 512  # T=16 >= prefill min_tokens
    args = (tokens, np.zeros(4, np.int64), np.array([16, 11, 16, 5]), np.arange(4))
    iree_first = IreeBackend(bench_export, "local-task").prefill(*args)
    torch_first = TorchBackend(bench_export, "torch-eager", "local-task", 4).prefill(*args)
    np.testing.assert_array_equal(iree_first, torch_first)


def test_ncu_kernel_table_per_step_arithmetic() -> None:
    """The cuda profile's fallback reads ncu's CSV: units converted, the initializer's kernels (fewer
    launches than calls) left out, per-step time and share by hand."""
    from dsv4.bench.speed import kernel_table

    head = '"ID","Process ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
    rows = [("__init_dispatch_0", "usecond", "500")] + [("_initializer_3_dispatch_0_decode", "usecond", "9")] * 3
    for _ in range(3):  # three decode calls
        rows += [("decode_bs1_dispatch_1_matmul", "usecond", "1,200"), ("decode_bs1_dispatch_2_reduce", "nsecond", "800"),
                 ("decode_bs1_dispatch_2_reduce", "nsecond", "400")]
    text = "==PROF== Connected\n" + head + "\n" + "\n".join(
        f'"{i}","7","{n}","gpu__time_duration.sum","{u}","{v}"' for i, (n, u, v) in enumerate(rows))
    rep = kernel_table(text, batch=1, steps=3, via="ncu")
    assert rep["available"] and rep["calls"] == 3 and rep["dispatches_per_step"] == 3
    assert rep["device_ms_per_step"] == pytest.approx((1200e3 + 1200) / 1e6)
    assert [k["name"] for k in rep["top"]] == ["decode_bs1_dispatch_1_matmul", "decode_bs1_dispatch_2_reduce"]
    assert rep["top"][1]["calls_per_step"] == 2 and rep["top"][1]["ms_per_step"] == pytest.approx(1.2e-3)
    assert rep["top"][0]["share"] == pytest.approx(1200e3 / (1200e3 + 1200))
    assert not kernel_table("no csv here", 1, 3, "ncu")["available"]


def test_step_bytes_matches_a_hand_count() -> None:
    """Both accounts of a made-up inventory: embedding and tid2eid rows per token, MTP left out, FP8
    read as its bf16 copy (scale not read) against 1 byte + a scale byte per block, an fp32 gate as
    three bf16 terms against bf16, gathered experts 3x per gather against MXFP4 per distinct expert;
    the state in both."""
    from dsv4.bench.traffic import experts_read_in_place, fp8_read_in_place, reads_in_place, step_bytes
    from dsv4.contract.artifact import StateSpec, TensorSpec

    model = {"vocab_size": 100, "num_hidden_layers": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
             "index_topk": 4, "expert_dtype": "fp4"}
    T = TensorSpec
    tensors = [T("model.embed.weight", (100, 10), "bfloat16"), T("model.head.weight", (100, 10), "bfloat16"),
               T("model.layers.0.ffn.experts.w1", (8, 64, 16), "uint8"),         # [E, out, in/2] packed
               T("model.layers.0.ffn.experts.w1_scale", (8, 64, 1), "uint8"),    # one E8M0 per 32
               T("model.layers.0.attn.wq_a.weight", (256, 128), "float8_e4m3fn"),
               T("model.layers.0.attn.wq_a.scale", (2, 1), "uint8"),
               T("model.layers.0.ffn.gate.weight", (8, 10), "float32"),
               T("model.layers.0.ffn.gate.tid2eid", (100, 2), "int64"),
               T("model.mtp.0.attn.wq_a.weight", (256, 128), "float8_e4m3fn")]
    state = [StateSpec("win_kv", (4, 2, 8, 16), "float32"),       # whole window per slot
             StateSpec("kv_r16", (4, 1, 65, 16), "float32"),      # max_seq 1024 / 16 + 1 rows
             StateSpec("kv_r4", (4, 1, 257, 16), "float32"),      # top-k rows of the CSA cache
             StateSpec("idx_kv_r4", (4, 1, 257, 8), "float32")]   # indexer keys up to the context
    b, ctx = 3, 512
    got = step_bytes(model, tensors, state, b, ctx, 1024, "bfloat16")
    st = b * 4 * (2 * 8 * 16 + (512 // 16) * 16 + 4 * 16 + (512 // 4) * 8)
    distinct = 8 * (1 - (1 - 2 / 8) ** 3)
    assert got["experts_distinct"] == pytest.approx(distinct) and got["experts_gathered"] == 6  # B*k <= E
    head = 3 * 10 * 2 + 100 * 10 * 2
    impl_layer = 6 * 3 * (64 * 16 + 64) + 256 * 128 * 2 + 8 * 10 * 6 + 3 * 2 * 8
    rel_layer = distinct * (64 * 32 / 2 + 64) + 256 * 128 + 2 * 1 + 8 * 10 * 2 + 3 * 2 * 8
    for acct, layer in (("implementation", impl_layer), ("release", rel_layer)):
        a = got[acct]
        assert a["head"] == pytest.approx(head) and a["state"] == pytest.approx(st)
        assert a["layers"] == pytest.approx(layer + st) and a["per_layer"] == pytest.approx(layer + st)
        assert a["total"] == pytest.approx(head + layer + st)
    # experts read in place: one read per gather; a measured distinct count replaces the expectation
    inplace = step_bytes(model, tensors, state, b, ctx, 1024, "bfloat16", experts_in_place=True, distinct_experts=5)
    assert inplace["implementation"]["layers"] == pytest.approx(impl_layer - 2 * 6 * (64 * 16 + 64) + st)
    assert inplace["release"]["layers"] == pytest.approx(rel_layer + (5 - distinct) * (64 * 16 + 64) + st)
    # which decodes read in place: the sequential kernel and the in-dispatch GEMM / GEMV; the reference copies
    assert experts_read_in_place("kernel") and experts_read_in_place("kernel_gemm")
    assert not experts_read_in_place("reference")
    # an fp32 activation runs the fp32 gate weight as stored
    f32 = step_bytes(model, tensors, state, b, ctx, 1024, "float32")
    assert f32["implementation"]["layers"] == pytest.approx(impl_layer - 8 * 10 * 2 + st)
    # the one-row FP8 GEMV reads the weight's bytes and its scales (2 blocks of 128 x 128) in place of the bf16 copy
    fp8 = step_bytes(model, tensors, state, b, ctx, 1024, "bfloat16", fp8_in_place=True)
    assert fp8["implementation"]["layers"] == pytest.approx(impl_layer - 256 * 128 + 2 + st)
    gemv = {"fp8_block_linear": "kernel_fp8_gemv", "fp8_block_linear_shared": "kernel_fp8_gemv"}
    assert [fp8_read_in_place(gemv, b) for b in (1, 2)] == [True, False]
    assert not fp8_read_in_place({**gemv, "fp8_block_linear_shared": "kernel"}, 1)
    gpu = {**gemv, "mxfp4_linear_gathered": "kernel_gemm", "moe_experts": "routed_blocks"}
    raw = {"targets": {"gfx942": {"kernels": gpu}, "cuda": {"kernels": gpu}}}
    assert reads_in_place(raw, 1) == {"experts_in_place": True, "fp8_in_place": True}
    assert reads_in_place(raw, 8) == {"experts_in_place": True, "fp8_in_place": False}
    assert reads_in_place(raw, 64) == {"experts_in_place": True, "fp8_in_place": False}
    raw["targets"]["llvm-cpu"] = {"kernels": {}}  # a target that copies: the copies' account
    assert reads_in_place(raw, 1) == {"experts_in_place": False, "fp8_in_place": False}


def _flash_inventory() -> tuple[dict, list]:
    import torch

    from dsv4.model.checkpoint import param_inventory
    from dsv4.model.config import ModelConfig
    from dsv4.model.model import Transformer

    cfg = ModelConfig.preset("flash")
    with torch.device("meta"):
        specs = param_inventory(Transformer(cfg, quantized=True))
    return cfg.to_dict(), specs


def test_step_bytes_of_a_flash_layer_by_hand() -> None:
    """One CSA layer of Flash (layer 4: ratio 4, top-k routed (layers 0-2 hash), MXFP4 experts) at batch 1 and 64,
    against the bytes written out from the dimensions: d 4096, q_lora 1024, 64 heads x 512, o_lora
    1024 x 8 groups, 256 experts of inter 2048, top-6, the indexer's 64 heads x 128."""
    from dsv4.bench.traffic import GROUP_BLOCK, step_bytes

    model, specs = _flash_inventory()
    layer = [s for s in specs if s.name.startswith("model.layers.4.")]
    model = {**model, "num_hidden_layers": 1}
    fp8 = lambda n, k: n * k + -(-n // 128) * -(-k // 128)  # noqa: E731
    dense_fp8 = [(1024, 4096), (32768, 1024), (512, 4096), (4096, 8192), (2048, 4096), (4096, 2048), (2048, 4096),
                 (8192, 1024)]  # wq_a, wq_b, wkv, wo_b, shared w1 w2 w3, indexer wq_b
    compressor = 2 * 1024 * 4096 + 2 * 256 * 4096  # wkv + wgate, attention's and indexer's
    hc_fn, gate, wproj, wo_a = 2 * 24 * 16384, 256 * 4096, 64 * 4096, 8192 * 4096
    norms = 1024 + 512 + 4096 + 4096 + 512 + 128  # q, kv, attn, ffn, compressors'
    small_f32 = 2 * 24 + 2 * 3 + 64 + 4 * 1024 + 4 * 256 + 256  # hc bases, scales, sink, apes, gate bias
    expert_mx = 3 * 2048 * 4096  # w1, w3 [2048, 4096], w2 [4096, 2048] weights
    release_dense = (sum(fp8(n, k) for n, k in dense_fp8) + fp8(8192, 4096) + 2 * (compressor + gate + wproj + norms)
                     + 4 * (hc_fn + small_f32))
    # the compressors' bf16 weights as stored; the fp32 mHC mixes as three bf16 terms
    impl_dense = (2 * sum(n * k for n, k in dense_fp8) + 2 * wo_a + 2 * compressor + 6 * hc_fn + 2 * (gate + wproj)
                  + 4 * (norms + small_f32))
    for batch in (1, 64):
        got = step_bytes(model, layer, [], batch, 1024, 1024, "bfloat16")
        distinct = 256 * (1 - (1 - 6 / 256) ** batch)
        gathered = 6 * batch if 6 * batch <= 256 else 256 + (6 * batch - 256) // GROUP_BLOCK
        assert got["experts_gathered"] == gathered
        assert got["release"]["per_layer"] == pytest.approx(release_dense + distinct * expert_mx * (1 / 2 + 1 / 32))
        assert got["implementation"]["per_layer"] == pytest.approx(impl_dense + 3 * gathered * expert_mx * (1 / 2 + 1 / 32))


def test_expert_blocks_is_the_routed_moe_block_count() -> None:
    """bench/traffic.py's gather count is model/kernels/moe.py's: one gather per pair up to E pairs,
    then grouped_blocks of GROUP_BLOCK rows (as many blocks as pairs up to E pairs, so
    routed_blocks' earlier switch to blocks keeps the count)."""
    from dsv4.bench.traffic import GROUP_BLOCK, expert_blocks
    from dsv4.model.kernels import moe

    assert GROUP_BLOCK == moe.GROUP_BLOCK
    for E, k in ((8, 2), (256, 6), (384, 6)):
        for b in (1, 2, 4, 16, 42, 43, 64, 128):
            want = b * k if b * k <= E else moe.grouped_blocks(b * k, E, moe.GROUP_BLOCK)
            assert expert_blocks(E, k, b) == want, (E, k, b)


def test_datasheet_peak_by_device_name() -> None:
    from dsv4.bench.traffic import datasheet_peak

    assert datasheet_peak("NVIDIA H200") == 4.8 and datasheet_peak("AMD Instinct MI300X") == 5.3
    assert datasheet_peak("NVIDIA H100 80GB HBM3") is None and datasheet_peak(None) is None
    assert datasheet_peak("AMD Instinct MI300X1") is None  # a whole word, not a prefix


def test_row_prompts_are_distinct_and_seeded() -> None:
    from dsv4.bench.speed import row_prompts

    p = row_prompts(0, 8, 64, 512)
    assert p.shape == (8, 64) and p.dtype == np.int64 and p.min() >= 0 and p.max() < 512
    assert len({r.tobytes() for r in p}) == 8  # every row its own prompt
    np.testing.assert_array_equal(p, row_prompts(0, 8, 64, 512))
    assert not np.array_equal(p, row_prompts(1, 8, 64, 512))


class _Recorder:
    """A backend that records each slot's token stream and answers a function of it (a stand-in model):
    `grouped` prefills all rows in one call, as the transformers backend does."""

    def __init__(self, name: str, grouped: bool, vocab: int):
        self.name, self.any_prefill_batch, self.vocab = name, grouped, vocab
        self.seen: dict[int, list[int]] = {}

    def _next(self, slot: int) -> int:
        return hash(tuple(self.seen[slot])) % self.vocab

    def prefill(self, tokens, start, lengths, slots):
        out = np.zeros(len(slots), np.int64)
        for r, (s, n, slot) in enumerate(zip(start, lengths, slots)):
            if n:
                seq = self.seen.setdefault(int(slot), [])
                if s == 0:
                    seq.clear()
                seq.extend(int(t) for t in tokens[r, :n])
                out[r] = self._next(int(slot))
        return out

    def decode(self, tokens, start, slots):
        for r, slot in enumerate(slots):
            self.seen[int(slot)].append(int(tokens[r, 0]))
        return np.array([self._next(int(s)) for s in slots], np.int64)


def test_every_backend_gets_the_same_distinct_inputs() -> None:
    """measure() hands a slotted backend (prefill batch sizes 1 and 4) and a grouped one the same
    per-row prompts, distinct between rows, and feeds each row its own answer back."""
    from dsv4.bench.speed import Plan, measure, row_prompts

    plan = Plan(batches=[4], contexts=[40], prefill_tokens=20, steps=3, warmup=2, chunk=16,
                prefill_batch_sizes=(1, 4), n_slots=4, notes=[], seed=7)
    a, b = _Recorder("slotted", False, 512), _Recorder("grouped", True, 512)
    for be in (a, b):
        r = measure(be, plan, 4, 40, 512)
        assert r["experts_distinct"] is None  # neither reports its routing
    fill = 40 - 3 - 2
    prompts = row_prompts(7, 4, fill, 512)
    assert a.seen == b.seen and sorted(a.seen) == [0, 1, 2, 3]
    for slot, seq in a.seen.items():
        assert len(seq) == fill + 5 and seq[:fill] == prompts[slot].tolist()
    assert len({tuple(seq[:fill]) for seq in a.seen.values()}) == 4
    assert len({tuple(seq[fill:]) for seq in a.seen.values()}) > 1  # each row its own fed-back tokens


@pytest.mark.parametrize("argv, match", [
    (["--batch", "3"], "batch size(s) 3 not exported"),
    (["--context", "4"], "context 4 leaves no prefill"),
    (["--context", "100000"], "every --context is over max_seq_len 256"),
    (["--steps", "0"], "--steps must be > 0"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--no-iree"], "--no-iree needs --compare"),
])
def test_bench_bad_arguments(bench_export: Path, capsys, argv: list[str], match: str) -> None:
    rc, _, err = _bench(capsys, str(bench_export), *argv)
    assert rc == 2 and match in err and "Traceback" not in err


def test_bench_bad_arguments_without_export(capsys, tmp_path: Path) -> None:
    rc, _, err = _bench(capsys, str(tmp_path / "missing"))
    assert rc == 2 and "does not exist" in err
    for argv, match in ((["--compare", "tf"], "unknown backend(s) tf"), (["--batch", "1,x"], "comma-separated")):
        with pytest.raises(SystemExit) as e:
            _bench(capsys, str(tmp_path), *argv)
        assert e.value.code == 2 and match in capsys.readouterr().err


def test_bench_transformers_without_the_model_is_a_clear_error(bench_export: Path, capsys, monkeypatch) -> None:
    """A transformers too old to have DeepSeek-V4 (a stand-in module without it) is named, with the
    version it needs, instead of an ImportError traceback."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="4.40.0"))
    rc, _, err = _bench(capsys, str(bench_export), "--batch", "1", "--context", "40", "--prefill", "20",
                        "--steps", "2", "--warmup", "1", "--compare", "transformers", "--no-iree", "--no-profile")
    assert rc == 2 and "--compare transformers: transformers 4.40.0 has no DeepSeek-V4 model" in err
    assert ">= 5.8" in err and "Traceback" not in err


def test_transformers_backend_runs_the_export_weights(bench_export: Path) -> None:
    """`--compare transformers`: transformers' own DeepseekV4ForCausalLM holding the export's tensors
    (dequantized) gives our eager model's logits with its quantization simulations off (fp32 both:
    two independent implementations of the same function; this export's weights are float, so our
    linears quantize no activation either), and the backend's cache bookkeeping
    (prefill a group of rows, then decode that group) gives what one uncached forward gives."""
    transformers = pytest.importorskip("transformers")
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.8"):
        pytest.skip(f"deepseek_v4 needs transformers >= 5.8, found {transformers.__version__}")
    import torch

    from dsv4.bench.torch_backends import TransformersBackend, load_export_model
    from dsv4.model.config import ModelConfig
    from dsv4.model.model import Transformer
    from dsv4.model.state import new_state

    be = TransformersBackend(bench_export, "local-task")
    model, cfg, dtype = load_export_model(bench_export)
    state = model.state_dict()
    quantized = any(v.dtype in (torch.float8_e4m3fn, torch.uint8) for v in state.values())
    ours = Transformer(ModelConfig.from_dict({**cfg.to_dict(), "quant_sim": False}), dtype=dtype, quantized=quantized)
    ours.load_state_dict(state)
    ours.eval()
    B, T = 2, 24
    seq = torch.from_numpy((np.arange(B * (T + 1)).reshape(B, T + 1) * 7 + 3) % cfg.vocab_size)
    with torch.no_grad():
        want = ours(seq, torch.zeros(B, dtype=torch.long), torch.full((B,), T + 1), torch.arange(B),
                    new_state(ours.cfg, B, dtype), all_logits=True).float()
        got = be.model(input_ids=seq).logits.float()
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err < 1e-4 * max(1.0, want.abs().max().item()), err
    tokens = np.zeros((B, 32), np.int64)  # padded past the real 24, as the bench pads to its chunk
    tokens[:, :T] = seq[:, :T].numpy()
    first = be.prefill(tokens, np.zeros(B, np.int64), np.full(B, T), np.arange(B))
    second = be.decode(seq[:, T:].numpy(), np.full(B, T), np.arange(B))
    np.testing.assert_array_equal(first, got[:, T - 1].argmax(-1).numpy())
    np.testing.assert_array_equal(second, got[:, T].argmax(-1).numpy())
    with pytest.raises(ValueError, match="not prefilled together"):
        be.decode(seq[:1, T:].numpy(), np.full(1, T), np.arange(1))


def test_every_benchmark_prints_its_help() -> None:
    """Each module of bench/ is a command a user reruns: `python -m dsv4.bench.NAME --help` exits 0
    with its usage, without a GPU (torch_backends is the library behind `dsv4 bench --compare`)."""
    import os
    import subprocess
    import sys

    names = sorted(p.stem for p in (REPO / "bench").glob("*.py") if p.stem not in ("__init__", "torch_backends"))
    assert {"speed", "serve_load", "audit"} <= set(names)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    procs = {n: subprocess.Popen([sys.executable, "-m", f"dsv4.bench.{n}", "--help"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, env=env) for n in names}
    for n, p in procs.items():
        out = p.communicate(timeout=300)[0]
        assert p.returncode == 0 and out.startswith("usage: "), (n, out[-2000:])


@pytest.mark.parametrize("argv, match", [
    (["http://127.0.0.1:9", "--concurrency", "1,x"], "--concurrency expects comma-separated integers"),
    (["http://127.0.0.1:9", "--requests", "0"], "must be positive"),
    (["http://127.0.0.1:9", "--id-limit", "3"], "--id-limit at least 4"),
    (["http://127.0.0.1:9", "--requests", "1", "--timeout", "5"], "cannot reach http://127.0.0.1:9"),
])
def test_serve_load_bad_arguments_and_no_server(capsys, argv: list[str], match: str) -> None:
    from dsv4.bench.serve_load import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4 bench serve: error: ") and match in err, err


def test_tile_sweep_candidates_replace_one_matchers_config() -> None:
    """A tile_sweep candidate is the tuning library with one matcher's config replaced (everything but
    the four tile fields stays as the export compiles it); a row count the library leaves to IREE gets
    a copy of the 64-row matcher for its rows, registered beside it."""
    import re

    from dsv4.bench.tile_sweep import _library_variant
    from dsv4.export.compile import TUNING_LIBRARIES

    library = Path(TUNING_LIBRARIES["cuda"]).read_text()

    def matcher(text: str, rows: int) -> str:
        start = text.index(f"@match_gathered_mxfp4_rows{rows}(")
        return text[start:text.index("transform.yield", start)]

    variant = _library_variant(library, 64, (256, 16, 2, 128))
    rows64 = matcher(variant, 64)
    assert "workgroup = [1, 64, 256, 0, 0]" in rows64 and "subgroup = [0, 2, 16, 0, 0]" in rows64
    assert "reduction = [0, 0, 0, 2, 2]" in rows64 and "workgroup_size = [128, 1, 1]" in rows64
    tiles = r"(workgroup|subgroup|reduction|workgroup_size) = \[[^\]]*\]"
    assert re.sub(tiles, "", variant) == re.sub(tiles, "", library)
    assert "@match_gathered_mxfp4_rows16(" not in library
    variant = _library_variant(library, 16, (128, 4, 2, 128))
    rows16 = matcher(variant, 16)
    assert "tensor<?x16x?x32xbf16>" in rows16 and "x64x" not in rows16 and "workgroup = [1, 16, 128, 0, 0]" in rows16
    assert "@match_gathered_mxfp4_rows16 -> @apply_op_config" in variant and matcher(variant, 64) == matcher(library, 64)


def test_tile_sweep_refuses_a_target_without_a_library(tmp_path: Path) -> None:
    from dsv4.bench.tile_sweep import build

    for target in ("gfx942", "cuda:sm_75"):
        with pytest.raises(SystemExit, match="no tuning library"):
            build(tmp_path, target)
