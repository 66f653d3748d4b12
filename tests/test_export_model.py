"""The exported model (export/exporter.py) against eager PyTorch on the tiny preset.

One export per session (random weights, fp32, quant_sim off so every difference is the
compiler's, not a flipped FP8/FP4 rounding), compiled for llvm-cpu and gfx942: conftest's
tiny_fp32_export, which the Engine, bench and batch-invariance tests share. Exporting takes
minutes on 2 cores, so the artifacts are cached under `.cache/` keyed by a hash of the model and
export sources and the export parameters (tests/conftest.py); delete `.cache/tiny-fp32-*` to force a fresh one.

Tolerances (fp32, compiled vs eager): logits |diff| <= 2e-4 + 2e-4 |ref| (IREE reassociates fp32
sums; measured maxima are in docs/export.md), state the same; greedy tokens and every top-k
index inside the compiled graph must be identical.

Ties: the indexer's scores are sums of relu terms, so exact ties (often at 0.0) are common in the
tiny model. The model's top-k breaks ties by the lowest index, eager (stable sort) and exported
(rank or radix select) alike (model/kernels/topk.py), so the comparisons run plain eager; the top-k test
also checks the compiled indices against torch.topk up to exact ties.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_FP32_ARGS, tiny_fp32_cfg, tiny_fp32_model

import dsv4.export  # noqa: F401  (compat shim)
from dsv4.export.compile import vmfb_executables
from dsv4.export.exporter import ExportError, ExportSpec, export_model
from dsv4.runtime.module import IreeModule, ensure_runtime_flags
from dsv4.model.config import ModelConfig
from dsv4.model.kernels.topk import record_topk
from dsv4.model.model import Transformer, init_random
from dsv4.model.state import new_state, state_spec

ensure_runtime_flags()
pytestmark = pytest.mark.usefixtures("one_thread")  # eager references of a tiny model

ROOT = Path(__file__).resolve().parents[1]
N_SLOTS = TINY_FP32_ARGS["n_slots"]  # 4
MAX_CHUNK = TINY_FP32_ARGS["max_chunk"]  # 32: longer prefills take two calls
ATOL = RTOL = 2e-4
tiny_cfg, tiny_model = tiny_fp32_cfg, tiny_fp32_model


@pytest.fixture(scope="session")
def art(tiny_fp32_export: Path) -> dict:
    """The exported tiny model: directory, config, the loaded llvm-cpu module, the eager model."""
    cache = tiny_fp32_export
    cfg = json.loads((cache / "config.json").read_text())
    mod = IreeModule(cache / cfg["targets"]["llvm-cpu"]["vmfb"], [cache / f for f in cfg["parameters"]])
    return {"dir": cache, "config": cfg, "module": mod, "model": tiny_model()}


class Pair:
    """Eager state and compiled (device-array) state driven with identical calls."""

    def __init__(self, art: dict):
        self.m: IreeModule = art["module"]
        self.model: Transformer = art["model"]
        self.cfg = self.model.cfg
        self.st = new_state(self.cfg, N_SLOTS, torch.float32)
        self.dev = [self.m.device_array(v.numpy()) for v in self.st.values()]
        self.max_logit_diff = 0.0

    def call(self, fn: str, tokens, start, lengths, slots):
        args = [torch.as_tensor(np.asarray(a), dtype=torch.int64) for a in (tokens, start, lengths, slots)]
        got = self.m(fn, *[a.numpy() for a in args], *self.dev)
        with torch.no_grad():
            want = self.model(*args, self.st)
        return got, want

    def state_host(self) -> dict[str, np.ndarray]:
        return {k: d.to_host() for k, d in zip(self.st, self.dev)}

    def check_state(self) -> float:
        worst = 0.0
        for k, host in self.state_host().items():
            ref = self.st[k].numpy()
            if k.startswith(("kv_r", "idx_kv_r")):  # last row of dim 2 is the scratch row
                host, ref = host[:, :, :-1], ref[:, :, :-1]
            np.testing.assert_allclose(host, ref, atol=ATOL, rtol=RTOL, err_msg=f"state {k}")
            worst = max(worst, float(np.abs(host - ref).max()))
        return worst

    def check_logits(self, got, want, rows=None) -> None:
        logits, argmax = got
        w = want.numpy()
        rows = list(range(w.shape[0])) if rows is None else rows
        np.testing.assert_allclose(logits[rows], w[rows], atol=ATOL, rtol=RTOL)
        self.max_logit_diff = max(self.max_logit_diff, float(np.abs(logits[rows] - w[rows]).max()))
        assert argmax[rows].tolist() == w[rows].argmax(-1).tolist(), "greedy tokens differ"


def _tokens(n: int, t: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 512, (n, t), dtype=np.int64)


# ---------------------------------------------------------------------------------------------


def test_config_abi(art):
    c = art["config"]
    assert set(c) == {"format", "version", "model", "activation_dtype", "n_slots", "max_seq_len", "prefill",
                      "decode", "state", "functions", "targets", "parameters", "tokenizer", "bos_token_id",
                      "eos_token_ids", "export_id", "weights", "lowering", "sha256"}
    assert c["lowering"] == {"batch_invariant": False, "overrides": {}}
    assert sorted(c["sha256"]) == sorted(c["parameters"]) and all(len(h) == 64 for h in c["sha256"].values())
    assert c["format"] == "dsv4-iree-export" and c["version"] == 1 and c["activation_dtype"] == "float32"
    assert c["prefill"] == {"batch_sizes": [1, 4], "min_tokens": 16, "max_tokens": MAX_CHUNK}
    assert c["decode"] == {"batch_sizes": [1, 4]}
    spec = state_spec(tiny_cfg(), N_SLOTS, torch.float32)
    assert [s["name"] for s in c["state"]] == list(spec)
    assert [tuple(s["shape"]) for s in c["state"]] == [v[0] for v in spec.values()]
    names = [s["name"] for s in c["state"]]
    for fn in ("prefill_bs1", "prefill_bs4", "decode_bs1", "decode_bs4", "score_bs1"):
        assert c["functions"][fn]["args"] == ["tokens", "start_pos", "lengths", "slots", *names]
        assert fn in art["module"].function_names
    assert c["functions"]["score_bs1"]["results"] == ["logprobs"]
    assert set(c["targets"]) == {"llvm-cpu", "gfx942"}
    for t in c["targets"].values():
        assert (art["dir"] / t["vmfb"]).is_file() and t["compile_s"] > 0 and t["flags"]
        # every hot spot's lowering is on record; both targets share one: the sparse attention kernel
        assert t["kernels"]["sparse_attention"] == "kernel" and t["kernels"]["topk"] == "select"
    code = art["module"]("export_id")
    assert bytes(np.asarray(code, dtype=np.uint8)).decode() == c["export_id"]
    assert ModelConfig.from_dict(c["model"]) == tiny_cfg()


def test_bs1_prefill_then_48_decode_steps(art):
    """Prefill 37 tokens in two calls (30: crosses the window 8 and ratios 4/16 with partial groups
    left; then 7 more, padded to the 16-token minimum), then 48 greedy decode steps."""
    p = Pair(art)
    toks = _tokens(1, 37, 1)
    slot = [2]
    got, want = p.call("prefill_bs1", toks[:, :30], [0], [30], slot)
    p.check_logits(got, want)
    p.check_state()
    rest = np.zeros((1, 16), np.int64)
    rest[0, :7] = toks[0, 30:]
    got, want = p.call("prefill_bs1", rest, [30], [7], slot)
    p.check_logits(got, want)
    p.check_state()
    pos, nxt = 37, int(want[0].argmax())
    for _ in range(48):
        got, want = p.call("decode_bs1", [[nxt]], [pos], [1], slot)
        p.check_logits(got, want)
        pos, nxt = pos + 1, int(want[0].argmax())
    worst_state = p.check_state()
    print(f"bs1: max |logit diff| {p.max_logit_diff:.3g}, max |state diff| {worst_state:.3g}")


def test_bs4_chunked_prefill_and_decode_at_different_positions(art):
    """Four sequences in slots 3,0,2,1: two chunked-prefill calls (one row padded with lengths 0),
    then 48 decode steps at different positions, one row padded every 7th step."""
    p = Pair(art)
    slots = [3, 0, 2, 1]
    toks = _tokens(4, 32, 2)
    got, want = p.call("prefill_bs4", toks, [0, 0, 0, 0], [20, 32, 0, 16], slots)
    p.check_logits(got, want, rows=[0, 1, 3])
    start = np.array([20, 32, 0, 16])
    lengths = np.array([17, 5, 23, 30])
    got, want = p.call("prefill_bs4", _tokens(4, 30, 3), start, lengths, slots)
    p.check_logits(got, want)
    p.check_state()
    pos = start + lengths
    nxt = want.argmax(-1).numpy()
    for step in range(48):
        ln = np.ones(4, dtype=np.int64)
        if step % 7 == 3:
            ln[1] = 0
            before = {k: v[0] for k, v in p.state_host().items()}  # slot 0 = row 1
        got, want = p.call("decode_bs4", nxt[:, None], pos, ln, slots)
        rows = [r for r in range(4) if ln[r]]
        p.check_logits(got, want, rows=rows)
        if ln[1] == 0:  # a padding row leaves its slot untouched (scratch rows aside)
            for k, v in p.state_host().items():
                a, b = v[0], before[k]
                if k.startswith(("kv_r", "idx_kv_r")):
                    a, b = a[:, :-1], b[:, :-1]
                assert np.array_equal(a, b), f"padding row changed state {k}"
        w = want.argmax(-1).numpy()
        nxt = np.where(ln > 0, w, nxt)
        pos = pos + ln
    worst_state = p.check_state()
    print(f"bs4: max |logit diff| {p.max_logit_diff:.3g}, max |state diff| {worst_state:.3g}")


def test_topk_indices_inside_compiled_graph_match_eager(art):
    """Every top-k of the multi-layer graph (indexer + MoE gate, per layer) selects exactly the
    indices eager selects (docs/export.md, IREE 3.13 traps: torch.topk there returns right values, wrong
    indices), and differs from eager torch.topk only between exactly tied scores."""
    p = Pair(art)
    p.call("prefill_bs1", _tokens(1, 30, 4), [0], [30], [1])
    toks = _tokens(1, 32, 5)
    args = [np.asarray(a, dtype=np.int64) for a in (toks, [30], [29], [1])]
    got = p.m("topk_probe_bs1", *args, *p.dev)
    with torch.no_grad(), record_topk() as rec:
        want = p.model(*[torch.from_numpy(a) for a in args], p.st)
    np.testing.assert_allclose(got[0], want.numpy(), atol=ATOL, rtol=RTOL)
    assert len(got) - 1 == 2 * len(rec) == 10, "expected indexer x2 + gate x3 top-ks (indices, scores)"
    ties = 0
    for i, ((scores, idx), cidx) in enumerate(zip(rec, got[1:1 + len(rec)])):
        s, ref = scores.numpy(), idx.numpy()
        tref = scores.topk(ref.shape[-1]).indices.numpy()  # torch.topk on the same scores
        assert cidx.shape == ref.shape, f"top-k #{i}"
        finite = np.isfinite(np.take_along_axis(s, ref, -1))
        assert finite.sum() > 0
        # finite picks: identical indices; picks among -inf (masked rows) only need to be masked too
        assert np.array_equal(cidx[finite], ref[finite]), f"top-k #{i}: indices differ"
        assert np.all(np.isneginf(np.take_along_axis(s, cidx, -1)[~finite])), f"top-k #{i}: masked picks"
        # against torch.topk: the same multiset of scores (only exactly tied entries may differ)
        sc = np.sort(np.take_along_axis(s, cidx, -1), -1)
        st_ = np.sort(np.take_along_axis(s, tref, -1), -1)
        assert np.array_equal(sc, st_), f"top-k #{i}: a non-tied pick differs from torch.topk"
        ties += int((np.sort(cidx, -1) != np.sort(tref, -1)).any(-1)[finite.any(-1)].sum())
    print(f"top-k rows where torch.topk broke an exact tie differently: {ties}")


def test_score_matches_eager_log_softmax(art):
    p = Pair(art)
    toks = _tokens(1, 32, 6)
    args = [np.asarray(a, dtype=np.int64) for a in (toks, [0], [27], [3])]
    got = p.m("score_bs1", *args, *p.dev)
    with torch.no_grad():
        logits = p.model(*[torch.from_numpy(a) for a in args], p.st, all_logits=True)
    lp = torch.log_softmax(logits[0, :26], -1).gather(-1, torch.from_numpy(toks[0, 1:27])[:, None])[:, 0]
    want = np.zeros((1, 32), np.float32)
    want[0, :26] = lp.numpy()
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    assert np.all(got[0, 26:] == 0)
    p.check_state()  # scoring is a prefill: the state is written too


def test_gfx942_artifact_holds_gfx942_code(art):
    # members other than executables are constant blobs (_const*.bin, e.g. the RoPE tables)
    exes = [e for e in vmfb_executables(art["dir"] / art["config"]["targets"]["gfx942"]["vmfb"])
            if not e.entry.startswith("_const")]
    assert exes and all(e.format == "rocm-hsaco-fb" for e in exes)
    assert {e.gpu_arch for e in exes} == {"gfx942"} and {e.elf_machine for e in exes} == {224}
    cpu = [e for e in vmfb_executables(art["dir"] / art["config"]["targets"]["llvm-cpu"]["vmfb"])
           if not e.entry.startswith("_const")]
    assert cpu and all(e.format == "embedded-elf" for e in cpu)


# ---- bad input: rejected before any tracing --------------------------------------------------


@pytest.fixture(scope="module")
def small_model() -> Transformer:
    return tiny_model()


def test_unknown_target(small_model, tmp_path):
    with pytest.raises(ExportError, match=r"validate.*unknown compile target 'gfx9000'.*valid targets"):
        export_model(small_model, ExportSpec(targets=("gfx9000",)), tmp_path)


@pytest.mark.parametrize("bs", [(0,), (1, -4), ()])
def test_bad_batch_sizes(small_model, tmp_path, bs):
    with pytest.raises(ExportError, match="batch sizes must be integers >= 1"):
        export_model(small_model, ExportSpec(targets=("llvm-cpu",), batch_sizes=bs), tmp_path)


def test_model_spec_mismatch(small_model, tmp_path):
    with pytest.raises(ExportError, match=r"not the one the spec describes: max_seq_len 4096 \(the model has"):
        export_model(small_model, ExportSpec(targets=("llvm-cpu",), max_seq_len=4096), tmp_path)


def test_bad_chunk_and_slots(small_model, tmp_path):
    with pytest.raises(ExportError, match=r"max_chunk 8 must be in \[16"):
        export_model(small_model, ExportSpec(targets=("llvm-cpu",), max_chunk=8), tmp_path)
    with pytest.raises(ExportError, match="n_slots 2 is smaller than the largest batch size 4"):
        export_model(small_model, ExportSpec(targets=("llvm-cpu",), n_slots=2), tmp_path)
    with pytest.raises(ExportError, match="n_slots 4 is smaller than the largest batch size 8"):
        export_model(small_model, ExportSpec(targets=("llvm-cpu",), decode_batch_sizes=(1, 8), n_slots=4), tmp_path)
    with pytest.raises(ExportError, match="decode batch sizes must be integers >= 1"):
        export_model(small_model, ExportSpec(targets=("llvm-cpu",), decode_batch_sizes=(0, 4)), tmp_path)


def test_default_slots_cover_decode_batch_sizes():
    """Without --n-slots the state holds as many slots as the widest call of either kind."""
    assert ExportSpec(targets=["llvm-cpu"], batch_sizes=(1, 4), decode_batch_sizes=(1, 4, 16)).n_slots == 16


def _quantized_tiny(quant_sim: bool = False, dtype: torch.dtype = torch.float32) -> Transformer:
    """Tiny with FP8 linears (E8M0 scales) and MXFP4 experts, random bytes (no NaN codes).
    Also the model of `git show a7b70ea:bench/quantized_tiny_parity.py`."""
    cfg = ModelConfig.preset("tiny").replace(quant_sim=quant_sim, expert_dtype="fp4")
    m = init_random(Transformer(cfg, dtype=dtype), seed=1)  # float weights first
    q = Transformer(cfg, dtype=dtype, quantized=True)
    g = torch.Generator().manual_seed(2)
    sd = m.state_dict()
    with torch.no_grad():
        for name, p in q.named_parameters():
            if p.dtype == torch.float8_e4m3fn:
                b = torch.randint(0, 0x7E, p.shape, generator=g, dtype=torch.uint8)
                b |= torch.randint(0, 2, p.shape, generator=g, dtype=torch.uint8) << 7
                p.data = b.view(torch.float8_e4m3fn)
            elif p.dtype == torch.uint8:
                lo, hi = (118, 124) if name.endswith("scale") else (0, 256)
                p.copy_(torch.randint(lo, hi, p.shape, generator=g, dtype=torch.uint8))
            else:
                p.copy_(sd[name])
    return q.eval()


def test_fnuz_conversion_for_gfx942_keeps_the_model_exact():
    """gfx942 gets e4m3fnuz weights through formats.fp8_fn_to_fnuz (never a cast): every FP8
    weight changes format, and the model computes bit-identical logits."""
    import copy

    from dsv4.export.exporter import _has_fp8, _model_tensors

    q = _quantized_tiny()
    z = copy.deepcopy(q)
    written = {k: a for k, a, _ in _model_tensors(q, "fnuz", prefix="")}  # what the gfx942 .irpa receives
    for mod_name, mod in z.named_modules():
        for pname, p in list(mod.named_parameters(recurse=False)):
            dt = torch.float8_e4m3fnuz if p.dtype == torch.float8_e4m3fn else p.dtype
            b = torch.from_numpy(written[f"{mod_name}.{pname}" if mod_name else pname].reshape(-1).view(np.uint8).copy())
            setattr(mod, pname, torch.nn.Parameter(b.view(dt).view(p.shape), requires_grad=False))
    assert _has_fp8(q)
    fp8 = [n for n, p in q.named_parameters() if p.dtype == torch.float8_e4m3fn]
    zp = dict(z.named_parameters())
    assert fp8 and all(zp[n].dtype == torch.float8_e4m3fnuz for n in fp8)
    assert not any(p.dtype == torch.float8_e4m3fn for p in z.parameters())
    toks = torch.from_numpy(_tokens(1, 20, 7))
    a = (toks, torch.tensor([0]), torch.tensor([20]), torch.tensor([0]))
    with torch.no_grad():
        want = q(*a, new_state(q.cfg, 1, torch.float32))
        got = z(*a, new_state(q.cfg, 1, torch.float32))
    assert torch.equal(got, want)


def test_cli_reports_stage_and_reason(tmp_path, capsys):
    from dsv4.cli import main

    assert main(["export", "--preset", "tiny", "--target", "llvm-cpu", "--target", "gfx9000", "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "stage 'validate'" in err and "unknown compile target 'gfx9000'" in err
    assert main(["export", "--preset", "tiny", "--target", "llvm-cpu", "--batch-sizes", "0", "-o", str(tmp_path)]) == 2
    assert "export stage 'validate' failed: batch sizes must be integers >= 1" in capsys.readouterr().err
    assert main(["export", "--preset", "tiny", "--kernel", "moe_experts=kernel", "-o", str(tmp_path)]) == 2
    assert "kernel op 'moe_experts' has no implementation 'kernel'" in capsys.readouterr().err
