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
def bench_export() -> Path:
    """The runtime tests' tiny export (tiny preset, fp32, llvm-cpu, prefill/decode bs 1 and 4; cached
    under .cache/ by tests/conftest.py): one export serves both files."""
    from conftest import cached_export
    from test_engine_tiny import TINY_EXPORT_ARGS, TINY_SEED, _tiny_model

    from dsv4.export.exporter import ExportSpec, export_model

    def build(out: Path) -> None:
        cfg, model = _tiny_model()
        export_model(model, ExportSpec(**TINY_EXPORT_ARGS), out)

    return cached_export("runtime-tiny", build, [TINY_SEED, sorted(TINY_EXPORT_ARGS.items())])


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
    # the same bytes per (batch, context) on every backend; more rows read more
    by = {(r["backend"], r["batch"]): r["roofline_bytes"] for r in rep["decode"]}
    assert by[(backends[0], 1)] == by[(backends[1], 1)] < by[(backends[0], 4)]
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
    from test_engine_tiny import _tiny_model

    ref = _tiny_model()[1].state_dict()
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
    from dsv4.bench.speed import step_bytes
    from dsv4.contract.artifact import StateSpec

    model = {"vocab_size": 100, "n_routed_experts": 8, "num_experts_per_tok": 2, "index_topk": 4}
    params = {"embed.weight": 100 * 10 * 2, "layers.0.ffn.experts.w1": 8 * 1000, "layers.0.attn.wq": 500,
              "mtp.0.attn.wq": 999, "layers.0.ffn.gate.tid2eid": 100 * 2 * 8}
    state = [StateSpec("win_kv", (4, 2, 8, 16), "float32"),       # whole window per slot
             StateSpec("kv_r16", (4, 1, 65, 16), "float32"),      # max_seq 1024 / 16 + 1 rows
             StateSpec("kv_r4", (4, 1, 257, 16), "float32"),      # top-k rows of the CSA cache
             StateSpec("idx_kv_r4", (4, 1, 257, 8), "float32")]   # indexer keys up to the context
    b, ctx = 3, 512
    got = step_bytes(model, params, state, b, ctx, 1024)
    experts = 8 * (1 - (1 - 2 / 8) ** 3)
    weights = 3 * 20 + 1000 * experts + 500 + 3 * 16
    st = b * 4 * (2 * 8 * 16 + (512 // 16) * 16 + 4 * 16 + (512 // 4) * 8)
    assert got["weights"] == pytest.approx(weights)
    assert got["state"] == pytest.approx(st)
    assert got["total"] == pytest.approx(weights + st)


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
