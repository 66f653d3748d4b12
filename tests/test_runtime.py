"""dsv4.runtime without an export: sampling, slots, batching, stop strings, config validation,
torch-free imports. The Engine end to end: tests/test_engine_toy.py (a toy export built here) and
tests/test_engine_tiny.py (the tiny DeepSeek-V4 preset).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dsv4.runtime import ArtifactError, EngineError, ExportConfig, SamplingParams
from dsv4.contract.artifact import target_for_device
from dsv4.runtime.batching import SlotAllocator, pad_rows, pick_batch_size
from dsv4.runtime.sampling import make_rng, sample_token, sampling_distribution
from dsv4.runtime.text import StopMatcher
from conftest import NO_TORCH_PRELUDE

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------
# sampling
# ------------------------------------------------------------------------------------------------


def _reference_dist(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Independent float64 reference: plain loops over a sorted list."""
    x = [float(v) / temperature for v in logits]
    ranked = sorted(range(len(x)), key=lambda i: (-x[i], i))
    if top_k:
        ranked = ranked[:top_k]
    m = max(x[i] for i in ranked)
    w = {i: math.exp(x[i] - m) for i in ranked}
    z = sum(w.values())
    p = {i: w[i] / z for i in ranked}
    if top_p < 1.0:
        kept, mass = [], 0.0
        for i in ranked:
            kept.append(i)
            mass += p[i]
            if mass >= top_p:
                break
        z = sum(p[i] for i in kept)
        p = {i: p[i] / z for i in kept}
    out = np.zeros(len(x))
    for i, v in p.items():
        out[i] = v
    return out


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.9), (0.8, 10, 0.5), (2.0, 3, 0.99),
    (1.0, 1000, 1.0),
])
def test_sampling_distribution_matches_reference(temperature: float, top_k: int, top_p: float) -> None:
    logits = np.random.default_rng(3).normal(size=97).astype(np.float32) * 3
    got = sampling_distribution(logits, temperature, top_k, top_p)
    ref = _reference_dist(logits, temperature, top_k, top_p)
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-15)
    assert got.sum() == pytest.approx(1.0)
    if top_k:
        assert (got > 0).sum() <= top_k


def test_sampler_frequencies_follow_the_distribution() -> None:
    logits = np.random.default_rng(5).normal(size=12) * 1.5
    params = SamplingParams(temperature=0.9, top_k=8, top_p=0.95, seed=1)
    ref = _reference_dist(logits, 0.9, 8, 0.95)
    rng, _ = make_rng(11)
    n = 20000
    counts = np.bincount([sample_token(logits, params, rng) for _ in range(n)], minlength=12)
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(ref))
    # each frequency within 5 standard deviations of its binomial expectation
    sd = np.sqrt(n * ref * (1 - ref)) + 1e-9
    assert np.all(np.abs(counts - n * ref) <= 5 * sd + 1)


@pytest.mark.parametrize("vocab", [97, 2048, 129280])
def test_sampler_reads_the_order_only_as_far_as_the_full_sort(vocab: int) -> None:
    """sample_token sorts only the prefix of the descending order it needs: for the same seed it
    picks the token the full stable sort picks (the pre-session-13 sampler, written out here), with
    ties (repeated logits) and every filter; at Flash's vocabulary it costs a fraction of the sort."""
    import time

    def full_sort(logits, params, rng):
        x = logits.astype(np.float64) / params.temperature
        order = np.argsort(-x, kind="stable")[:params.top_k or None]
        p = np.exp(x[order] - x[order[0]])
        p /= p.sum()
        if params.top_p < 1.0:
            n = min(int(np.searchsorted(np.cumsum(p), params.top_p, side="left")) + 1, p.size)
            order, p = order[:n], p[:n] / p[:n].sum()
        cum = np.cumsum(p)
        return int(order[min(int(np.searchsorted(cum, rng.random() * cum[-1], side="right")), len(order) - 1)])

    gen = np.random.default_rng(vocab)
    settings = [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 40, 1.0), (0.8, 10, 0.5), (2.0, 0, 0.99), (1.0, 0, 0.3),
                (0.5, vocab + 5, 1.0)]
    fast_s = slow_s = 0.0
    for trial in range(6):
        logits = (gen.normal(size=vocab) * (1 + 3 * trial)).astype(np.float32)
        logits[gen.integers(0, vocab, size=vocab // 8)] = logits.max()  # ties at the top
        if trial % 2:
            logits = np.round(logits)  # many ties everywhere
        for t, k, p in settings:
            params = SamplingParams(temperature=t, top_k=k, top_p=p)
            a, b = make_rng(trial)[0], make_rng(trial)[0]
            for _ in range(4):
                t0 = time.perf_counter()
                got = sample_token(logits, params, a)
                t1 = time.perf_counter()
                want = full_sort(logits, params, b)
                fast_s, slow_s = fast_s + t1 - t0, slow_s + time.perf_counter() - t1
                assert got == want, (trial, t, k, p)
    print(f"[sampler] vocab {vocab}: {1e3 * fast_s / 168:.3f} ms per draw, full sort {1e3 * slow_s / 168:.3f} ms")
    # the logprob alternatives come from the same partial sort: the full sort's first k, none for k = 0
    from dsv4.runtime.sampling import token_logprobs

    lp = logits.astype(np.float64) - np.logaddexp.reduce(logits.astype(np.float64))
    for k in (0, 1, 20):
        assert [t for t, _ in token_logprobs(logits, 3, k)[1]] == np.argsort(-lp, kind="stable")[:k].tolist()


def test_greedy_and_ties() -> None:
    logits = np.array([0.0, 3.0, 3.0, 1.0])
    p = SamplingParams()
    assert p.greedy
    assert sample_token(logits, p, make_rng(0)[0]) == 1  # lowest id among ties
    assert sample_token(logits, p, make_rng(0)[0], argmax=2) == 2  # device argmax wins when given
    assert SamplingParams(temperature=1.0, top_k=1).greedy
    d = sampling_distribution(logits, 1.0, top_k=1)
    assert d.tolist() == [0, 1, 0, 0]


def test_seed_determinism() -> None:
    logits = np.random.default_rng(0).normal(size=50)
    params = SamplingParams(temperature=1.0)

    def draws(seed: int) -> list[int]:
        rng, _ = make_rng(seed)
        return [sample_token(logits, params, rng) for _ in range(40)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    rng, seed = make_rng(None)
    assert isinstance(seed, int) and seed >= 0
    again, _ = make_rng(seed)
    assert rng.random() == again.random()


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2),
                                dict(max_new_tokens=0), dict(seed=-1), dict(stop=("",)),
                                dict(temperature=float("nan"))])
def test_sampling_params_validation(kw: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kw)


# ------------------------------------------------------------------------------------------------
# slots, batching, stop strings
# ------------------------------------------------------------------------------------------------


def test_slot_allocator() -> None:
    a = SlotAllocator(3)
    assert [a.allocate(), a.allocate(), a.allocate()] == [0, 1, 2]
    with pytest.raises(EngineError, match="all 3 slots"):
        a.allocate()
    a.free(1)
    assert a.free_slots == [1] and a.used_slots == [0, 2]
    assert a.allocate() == 1
    a.free(0)
    a.free(2)
    assert a.allocate() == 0  # lowest first: reproducible placement
    with pytest.raises(ValueError, match="already free"):
        a.free(2)
    with pytest.raises(ValueError, match="out of range"):
        a.free(7)


def test_pick_batch_size_and_padding() -> None:
    assert pick_batch_size(1, [1, 2, 4], 8) == 1
    assert pick_batch_size(3, [1, 2, 4], 8) == 4
    assert pick_batch_size(9, [1, 2, 4], 8) == 4  # caller splits
    assert pick_batch_size(3, [4, 8], 4) == 4
    assert pick_batch_size(5, [1, 2, 4, 8], 4) == 4  # 8 would need more slots than exist
    with pytest.raises(EngineError):
        pick_batch_size(1, [8], 4)
    assert pad_rows([3, 1], 4, 6) == [3, 1, 0, 2]
    assert pad_rows([0, 1, 2, 3], 4, 4) == [0, 1, 2, 3]
    with pytest.raises(EngineError, match="distinct"):
        pad_rows([1, 1], 2, 4)
    with pytest.raises(EngineError):
        pad_rows([0], 8, 4)


def test_stop_matcher() -> None:
    m = StopMatcher(["STOP", "\n\n"])
    assert m.find("abc STOP def") == 4
    assert m.find("a\n\nb STOP") == 1
    assert m.find("abc") is None
    assert m.safe_len("hello ST") == 6  # "ST" may become STOP
    assert m.safe_len("hello S") == 6
    assert m.safe_len("hello\n") == 5
    assert m.safe_len("hello") == 5
    assert m.safe_len("ab\ufffd") == 2  # incomplete UTF-8 held back
    assert StopMatcher([]).safe_len("xyz") == 3


def test_target_for_device() -> None:
    assert target_for_device("local-task") == "llvm-cpu"
    assert target_for_device("local-sync") == "llvm-cpu"
    assert target_for_device("cuda") == "cuda"
    assert target_for_device("hip") == "gfx942"
    with pytest.raises(EngineError, match="unknown device 'tpu'"):
        target_for_device("tpu")


# ------------------------------------------------------------------------------------------------
# config validation
# ------------------------------------------------------------------------------------------------


def _config(**over) -> dict:
    cfg = {
        "format": "dsv4-iree-export", "version": 1,
        "model": {"vocab_size": 33, "max_seq_len": 48, "eos_token_id": 1},
        "activation_dtype": "float32", "n_slots": 4, "max_seq_len": 48,
        "prefill": {"batch_sizes": [1, 2], "min_tokens": 2, "max_tokens": 16},
        "decode": {"batch_sizes": [1, 2, 4]},
        "state": [{"name": "kv", "shape": [4, 49, 16], "dtype": "float32"},
                  {"name": "last", "shape": [4, 16], "dtype": "bfloat16"}],
        "functions": {f: {"args": ["tokens", "start_pos", "lengths", "slots", "kv", "last"],
                          "results": ["logits", "argmax"]}
                      for f in ("prefill_bs1", "prefill_bs2", "decode_bs1", "decode_bs2", "decode_bs4")},
        "targets": {"llvm-cpu": {"vmfb": "model.llvm-cpu.vmfb", "flags": []}},
        "parameters": "model.irpa", "tokenizer": None, "bos_token_id": 0, "eos_token_ids": [1],
        "export_id": "abc123",
    }
    cfg["functions"]["score_bs1"] = {"args": cfg["functions"]["decode_bs1"]["args"], "results": ["logprobs"]}
    cfg.update(over)
    return cfg


def _write_export(d: Path, cfg: dict, files=("model.irpa", "model.llvm-cpu.vmfb")) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    for f in files:
        (d / f).write_bytes(b"")
    return d


def test_config_loads(tmp_path: Path) -> None:
    c = ExportConfig.load(_write_export(tmp_path, _config()))
    assert c.n_slots == 4 and c.vocab_size == 33 and c.decode_batch_sizes == (1, 2, 4)
    assert [s.dtype for s in c.state] == ["float32", "bfloat16"]
    assert c.state_bytes == 4 * 49 * 16 * 4 + 4 * 16 * 2
    assert c.eos_token_ids == (1,) and c.export_id == "abc123"
    assert c.vmfb_path("llvm-cpu").name == "model.llvm-cpu.vmfb"
    with pytest.raises(ArtifactError, match="no gfx942 module.*exported targets: llvm-cpu"):
        c.vmfb_path("gfx942")


@pytest.mark.parametrize("change,match", [
    (dict(format="other"), "format"),
    (dict(version=2), "version: this runtime reads version 1"),
    (dict(n_slots=0), "n_slots"),
    (dict(prefill={"batch_sizes": [1], "min_tokens": 8, "max_tokens": 4}), "min_tokens"),
    (dict(decode={"batch_sizes": []}), "decode.batch_sizes"),
    (dict(decode={"batch_sizes": [8]}), "exceeds n_slots"),
    (dict(state=[{"name": "kv", "shape": [3, 49, 16], "dtype": "float32"}]), "expected n_slots"),
    (dict(state=[{"name": "kv", "shape": [4, 49, 16], "dtype": "complex32"}]), "unsupported dtype"),
    (dict(eos_token_ids=[99]), "eos_token_ids"),
    (dict(tokenizer="tokenizer.json"), "tokenizer.json is missing"),
    (dict(parameters="weights.irpa"), "weights.irpa is missing"),
])
def test_config_errors(tmp_path: Path, change: dict, match: str) -> None:
    _write_export(tmp_path, _config(**change))
    with pytest.raises(ArtifactError, match=match):
        ExportConfig.load(tmp_path)


def test_config_missing_function_and_field(tmp_path: Path) -> None:
    cfg = _config()
    del cfg["functions"]["decode_bs4"]
    _write_export(tmp_path / "a", cfg)
    with pytest.raises(ArtifactError, match="decode_bs4"):
        ExportConfig.load(tmp_path / "a")
    cfg = _config()
    del cfg["state"]
    _write_export(tmp_path / "b", cfg)
    with pytest.raises(ArtifactError, match="missing field.*state"):
        ExportConfig.load(tmp_path / "b")
    with pytest.raises(ArtifactError, match="does not exist"):
        ExportConfig.load(tmp_path / "nope")
    (tmp_path / "c").mkdir()
    with pytest.raises(ArtifactError, match="no config.json"):
        ExportConfig.load(tmp_path / "c")
    (tmp_path / "c" / "config.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        ExportConfig.load(tmp_path / "c")


def test_engine_unknown_device_and_missing_target(tmp_path: Path) -> None:
    from dsv4.runtime.engine import Engine

    _write_export(tmp_path, _config())
    with pytest.raises(EngineError, match="unknown device 'vulkan'"):
        Engine(tmp_path, device="vulkan")
    with pytest.raises(ArtifactError, match="no cuda module"):
        Engine(tmp_path, device="cuda")
    assert issubclass(EngineError, RuntimeError)


# ------------------------------------------------------------------------------------------------
# torch-free imports
# ------------------------------------------------------------------------------------------------

def test_runtime_imports_without_torch_or_compiler() -> None:
    code = NO_TORCH_PRELUDE + textwrap.dedent("""
        import dsv4.runtime.engine, dsv4.runtime.sampling, dsv4.cli.generate, dsv4.cli
        from dsv4.runtime import Engine, SamplingParams
        import iree.runtime
        from dsv4.cli import main
        try:
            main(['generate', '/nonexistent', '--prompt-ids', '1,2'])
        except SystemExit:
            pass
        bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(('iree.compiler', 'iree.turbine'))]
        assert not bad, bad
        print('OK')
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout
    assert "export directory /nonexistent does not exist" in r.stderr


@pytest.mark.parametrize("cmd", [["export", "-o", "/tmp/never-written"], ["eager"]])
def test_torch_commands_on_a_runtime_only_install_say_what_is_missing(cmd) -> None:
    """The base install is the runtime; `dsv4 export` / `dsv4 eager` there name the missing extra."""
    code = NO_TORCH_PRELUDE + textwrap.dedent(f"""
        from dsv4.cli import main
        sys.exit(main({cmd!r}))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2, r.stderr
    assert "needs the 'export' extra" in r.stderr and "Traceback" not in r.stderr


def test_cli_bad_request_exits_2(tmp_path: Path) -> None:
    from dsv4.cli import main

    assert main(["generate", str(tmp_path / "missing"), "--prompt-ids", "1"]) == 2
    assert main(["generate", str(tmp_path / "missing"), "--prompt-ids", "1", "--top-p", "3"]) == 2
    assert main(["score", str(tmp_path / "missing"), "--prompt-ids", "1,2"]) == 2
