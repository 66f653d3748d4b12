"""dsv4.runtime: sampling, slots, batching, stop strings, config validation, torch-free imports,
and the Engine end to end.

End-to-end tests run against two exports:
* a *toy* export built here (a one-layer attention LM following the export ABI exactly, with a
  character tokenizer), compiled once for llvm-cpu in a few seconds: it checks the engine's
  mechanics (in-place device state, chunked prefill, padded batched decode, slot reuse, score
  chunking, export_id) against the same toy module run eagerly;
* the real tiny DeepSeek-V4 preset via ``dsv4.export.exporter.export_model`` (marked `slow`,
  cached by tests/conftest.py): compiled greedy == eager ``dsv4.model.generate.greedy``.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dsv4.runtime import ArtifactError, EngineError, ExportConfig, RequestError, SamplingParams
from dsv4.contract.artifact import target_for_device
from dsv4.runtime.batching import SlotAllocator, pad_rows, pick_batch_size
from dsv4.runtime.sampling import make_rng, sample_token, sampling_distribution
from dsv4.runtime.text import StopMatcher

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

_BLOCKER = textwrap.dedent("""
    import sys, importlib.abc
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] == 'torch' or name.startswith(('iree.compiler', 'iree.turbine')):
                raise ModuleNotFoundError('blocked: ' + name, name=name)  # as if not installed
            return None
    sys.meta_path.insert(0, Block())
""")


def test_runtime_imports_without_torch_or_compiler() -> None:
    code = _BLOCKER + textwrap.dedent("""
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
    code = _BLOCKER + textwrap.dedent(f"""
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


# ------------------------------------------------------------------------------------------------
# toy export: the ABI on a one-layer attention LM, built and compiled here
# ------------------------------------------------------------------------------------------------

TOY_CHARS = "abcdefghijklmnopqrstuvwxyz .,!?"
TOY_V, TOY_D, TOY_S, TOY_SLOTS = 2 + len(TOY_CHARS), 16, 48, 4
TOY_TMIN, TOY_TMAX = 3, 16
TOY_EXPORT_ID = "toy-0001"


def _toy_tokenizer():
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<s>": 0, "</s>": 1}
    for c in TOY_CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


def _toy_module():
    """A module with the export ABI: state kv f32 [slots, S+1, D] (row S is scratch for padding
    writes) and prev_tab bf16 [slots, S+1, D] (each position's embedding, added to the next
    position's output); attention over the slot's positions <= each token's."""
    import torch
    import torch.nn as nn

    class Toy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.emb = nn.Parameter(torch.randn(TOY_V, TOY_D, generator=g))
            self.wq = nn.Parameter(torch.randn(TOY_D, TOY_D, generator=g) / TOY_D**0.5)
            self.head = nn.Parameter(torch.randn(TOY_D, TOY_V, generator=g) * 2)

        def hidden(self, tokens, start_pos, lengths, slots, kv, prev_tab):
            N, T = tokens.shape
            e = self.emb[tokens]  # N,T,D
            ar = torch.arange(T)
            pos = start_pos[:, None] + ar[None, :]
            valid = ar[None, :] < lengths[:, None]
            rows = torch.where(valid, pos, torch.full_like(pos, TOY_S))
            kv.index_put_((slots[:, None].expand(N, T), rows), e)
            # bf16 state: each position's embedding, read back at the next position (so the state is
            # both written and read, chunk by chunk; positions are idempotent like the kv rows)
            prev_tab.index_put_((slots[:, None].expand(N, T), rows), e.to(prev_tab.dtype))
            prev_rows = torch.where(pos > 0, pos - 1, TOY_S)  # position 0 reads the scratch row: zeros
            prev = torch.where((pos > 0)[..., None], prev_tab[slots[:, None], prev_rows].float(), 0.0)
            ctx = kv[slots][:, :TOY_S]  # N,S,D
            q = e @ self.wq
            sc = torch.einsum("ntd,nsd->nts", q, ctx) / TOY_D**0.5
            p_ar = torch.arange(TOY_S)
            mask = p_ar[None, None, :] <= pos[:, :, None]
            sc = sc.masked_fill(~mask, -1e9)
            att = torch.softmax(sc, -1)
            h = torch.tanh(e + torch.einsum("nts,nsd->ntd", att, ctx) + 0.5 * prev)
            return h @ self.head  # N,T,V

        def forward(self, tokens, start_pos, lengths, slots, kv, prev_tab):
            logits = self.hidden(tokens, start_pos, lengths, slots, kv, prev_tab)
            N = tokens.shape[0]
            lastidx = (lengths - 1).clamp(min=0)
            lg = torch.gather(logits, 1, lastidx.view(N, 1, 1).expand(N, 1, TOY_V))[:, 0]
            return lg, torch.argmax(lg, -1)

        def score(self, tokens, start_pos, lengths, slots, kv, prev_tab):
            logits = self.hidden(tokens, start_pos, lengths, slots, kv, prev_tab)
            lp = torch.log_softmax(logits, -1)
            nxt = torch.cat([tokens[:, 1:], tokens[:, :1]], 1)
            return torch.gather(lp, 2, nxt[:, :, None])[:, :, 0]

    return Toy().eval()


def _toy_state():
    import torch

    return (torch.zeros(TOY_SLOTS, TOY_S + 1, TOY_D), torch.zeros(TOY_SLOTS, TOY_S + 1, TOY_D, dtype=torch.bfloat16))


def _toy_eager_greedy(model, prompt: list[int], n: int, chunk: int = TOY_TMAX) -> list[int]:
    import torch

    kv, prev_tab = _toy_state()
    i64 = lambda *v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    with torch.no_grad():
        for s in range(0, len(prompt), chunk):
            piece = prompt[s:s + chunk]
            padded = piece + [0] * max(0, TOY_TMIN - len(piece))
            lg, am = model(torch.tensor([padded]), i64(s), i64(len(piece)), i64(0), kv, prev_tab)
        out, pos = [], len(prompt)
        for _ in range(n):
            t = int(am[0])
            out.append(t)
            lg, am = model(torch.tensor([[t]]), i64(pos), i64(1), i64(0), kv, prev_tab)
            pos += 1
    return out


def _build_toy_export(out: Path, export_id: str = TOY_EXPORT_ID, with_id_fn: bool = True) -> Path:
    import torch
    from iree.turbine import aot

    from conftest import compile_small

    from dsv4.export import compat

    compat.apply()

    out.mkdir(parents=True, exist_ok=True)
    model = _toy_module()
    aot.externalize_module_parameters(model, external_scope="model")
    aot.save_module_parameters(out / "model.irpa", model)
    fxb = aot.FxProgramsBuilder(model)
    kv, prev_tab = _toy_state()
    Tdim = torch.export.Dim("T", min=TOY_TMIN, max=TOY_TMAX)

    def args(n: int, t: int):
        return (torch.zeros(n, t, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                torch.ones(n, dtype=torch.long), torch.arange(n), kv, prev_tab)

    dyn = {"tokens": {1: Tdim}, "start_pos": None, "lengths": None, "slots": None, "kv": None, "prev_tab": None}
    for n in (1, 2):
        fxb.export_program(lambda m, tokens, start_pos, lengths, slots, kv, prev_tab:
                           m(tokens, start_pos, lengths, slots, kv, prev_tab),
                           name=f"prefill_bs{n}", args=args(n, 4), dynamic_shapes=dyn, strict=False)
    for n in (1, 2, 4):
        fxb.export_program(lambda m, tokens, start_pos, lengths, slots, kv, prev_tab:
                           m(tokens, start_pos, lengths, slots, kv, prev_tab),
                           name=f"decode_bs{n}", args=args(n, 1), strict=False)
    fxb.export_program(lambda m, tokens, start_pos, lengths, slots, kv, prev_tab:
                       m.score(tokens, start_pos, lengths, slots, kv, prev_tab),
                       name="score_bs1", args=args(1, 4), dynamic_shapes=dyn, strict=False)
    if with_id_fn:
        code = torch.tensor(list(export_id.encode()), dtype=torch.int64)
        fxb.export_program(lambda m: code.clone(), name="export_id", args=(), strict=False)
    eo = aot.export(fxb, import_symbolic_shape_expressions=True)
    eo.save_mlir(out / "model.mlir")
    # a toy-sized module (seconds): conftest's small-compile allowance, cached by its MLIR text
    shutil.copyfile(compile_small((out / "model.mlir").read_text(), "toy"), out / "model.llvm-cpu.vmfb")
    tok = _toy_tokenizer()
    (out / "tokenizer.json").write_text(tok.to_str())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['role'] }}, {{ m['content'] }}. "
                         "{% endfor %}{% if add_generation_prompt %}assistant,{% endif %}"}))
    sargs = ["tokens", "start_pos", "lengths", "slots", "kv", "prev_tab"]
    fns = {f"prefill_bs{n}": {"args": sargs, "results": ["logits", "argmax"]} for n in (1, 2)}
    fns.update({f"decode_bs{n}": {"args": sargs, "results": ["logits", "argmax"]} for n in (1, 2, 4)})
    fns["score_bs1"] = {"args": sargs, "results": ["logprobs"]}
    cfg = {
        "format": "dsv4-iree-export", "version": 1,
        "model": {"vocab_size": TOY_V, "max_seq_len": TOY_S, "eos_token_id": 1, "bos_token_id": 0},
        "activation_dtype": "float32", "n_slots": TOY_SLOTS, "max_seq_len": TOY_S,
        "prefill": {"batch_sizes": [1, 2], "min_tokens": TOY_TMIN, "max_tokens": TOY_TMAX},
        "decode": {"batch_sizes": [1, 2, 4]},
        "state": [{"name": "kv", "shape": [TOY_SLOTS, TOY_S + 1, TOY_D], "dtype": "float32"},
                  {"name": "prev_tab", "shape": [TOY_SLOTS, TOY_S + 1, TOY_D], "dtype": "bfloat16"}],
        "functions": fns,
        "targets": {"llvm-cpu": {"vmfb": "model.llvm-cpu.vmfb", "flags": []}},
        "parameters": "model.irpa", "tokenizer": "tokenizer.json", "bos_token_id": 0, "eos_token_ids": [1],
        "export_id": export_id,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


@pytest.fixture(scope="session")
def toy_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_toy_export(tmp_path_factory.mktemp("toy_export"))


@pytest.fixture(scope="session")
def toy_model():
    return _toy_module()


@pytest.fixture(scope="session")
def toy_engine(toy_export: Path):
    """batch_invariant=False: these tests check the batched-prefill bookkeeping (several requests per
    prefill_bs{N} call); the default mode prefills each request alone (tests/test_batch_invariance.py)."""
    from dsv4.runtime.engine import Engine

    return Engine(toy_export, batch_invariant=False)


def _toy_eager_score(model, ids: list[int]) -> np.ndarray:
    import torch

    kv, last = _toy_state()
    i64 = lambda *v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    with torch.no_grad():
        lp = model.score(torch.tensor([ids]), i64(0), i64(len(ids)), i64(0), kv, last)
    return lp[0, :-1].double().numpy()


TOY_PROMPTS = [
    [0, 5, 6, 7, 8, 9, 10],  # one chunk
    [0, 7],  # shorter than min_tokens: padded
    [0] + list(range(2, 33)) + [4, 9, 12],  # 35 tokens: three chunks
    [0, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 2, 3, 4],  # 17: two chunks
    [9],
    [0, 3, 3, 3, 3, 3],
]


def test_toy_greedy_matches_eager(toy_engine, toy_model) -> None:
    for p in TOY_PROMPTS:
        n = min(20, TOY_S - len(p))
        got = toy_engine.generate(p, max_new_tokens=n, ignore_eos=True)
        assert got.tokens == _toy_eager_greedy(toy_model, p, n), p
        assert got.stop_reason == "length"
    assert toy_engine.slots.n_free == TOY_SLOTS  # every slot handed back


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_toy_batched_equals_solo(toy_engine, batch_invariant: bool) -> None:
    """Six requests on four slots: decode batches of 4/2/1 (padded), queued requests join as
    slots free up, slots are reused; every request gets the tokens it gets alone. Prefill: shared
    padded calls (batch_invariant=False) or one request per prefill_bs1 call (the default)."""
    params = [SamplingParams(max_new_tokens=min(12 + 3 * i, TOY_S - len(p)), ignore_eos=True)
              for i, p in enumerate(TOY_PROMPTS)]
    solo = [toy_engine.generate(p, sp).tokens for p, sp in zip(TOY_PROMPTS, params)]
    before = dict(toy_engine.stats)
    saved, toy_engine.batch_invariant = toy_engine.batch_invariant, batch_invariant
    try:
        batched = toy_engine.generate_batch(TOY_PROMPTS, params)
    finally:
        toy_engine.batch_invariant = saved
    assert [r.tokens for r in batched] == solo
    calls = toy_engine.stats["decode_calls"] - before["decode_calls"]
    rows = toy_engine.stats["decode_rows"] - before["decode_rows"]
    assert rows > 2 * calls  # really batched
    assert toy_engine.stats["decode_padded_rows"] > before["decode_padded_rows"]  # and padded
    # the first four were admitted together: prefilled two per prefill_bs2 call, chunk by chunk
    # (batch-invariant: one per call, every chunk of every prompt its own call)
    first = TOY_PROMPTS[:4]
    chunks = sum(max(-(-len(p) // TOY_TMAX) for p in first[k:k + 2]) for k in (0, 2))
    own = [-(-len(p) // TOY_TMAX) for p in TOY_PROMPTS]
    assert toy_engine.stats["prefill_rows"] - before["prefill_rows"] >= sum(own[:4])
    calls = toy_engine.stats["prefill_calls"] - before["prefill_calls"]
    if batch_invariant:
        assert calls == sum(own)
    else:
        assert calls <= chunks + len(TOY_PROMPTS) - 4


def test_toy_continuous_join(toy_engine) -> None:
    """A request that joins while another is mid-decode gets its solo tokens, and so does the other."""
    a, b = TOY_PROMPTS[0], TOY_PROMPTS[2]
    sa, sb = (toy_engine.generate(p, max_new_tokens=10, ignore_eos=True).tokens for p in (a, b))
    ra = toy_engine.submit(a, max_new_tokens=10, ignore_eos=True)
    for _ in range(4):
        toy_engine.step()
    rb = toy_engine.submit(b, max_new_tokens=10, ignore_eos=True)
    while toy_engine.has_work:
        toy_engine.step()
    assert toy_engine.result(ra).tokens == sa
    assert toy_engine.result(rb).tokens == sb


def test_toy_sampling_seeds(toy_engine) -> None:
    p = TOY_PROMPTS[0]
    sp = SamplingParams(max_new_tokens=25, temperature=1.5, top_k=20, top_p=0.95, seed=1234, ignore_eos=True)
    a = toy_engine.generate(p, sp)
    b = toy_engine.generate(p, sp)
    assert a.tokens == b.tokens and a.seed == 1234
    c = toy_engine.generate(p, replace_seed(sp, 99))
    assert c.tokens != a.tokens
    # batched with other (greedy and sampled) requests: same tokens
    others = [SamplingParams(max_new_tokens=9, ignore_eos=True), replace_seed(sp, 5)]
    res = toy_engine.generate_batch([TOY_PROMPTS[2], p, TOY_PROMPTS[3]], [others[0], sp, others[1]])
    assert res[1].tokens == a.tokens
    # unseeded requests report the seed that reproduces them
    d = toy_engine.generate(p, replace_seed(sp, None))
    assert toy_engine.generate(p, replace_seed(sp, d.seed)).tokens == d.tokens


def replace_seed(sp: SamplingParams, seed: int | None) -> SamplingParams:
    from dataclasses import replace

    return replace(sp, seed=seed)


def test_toy_slot_reuse_leaks_nothing(toy_engine, toy_model) -> None:
    # fill every slot with long histories, then run short prompts in the same slots
    toy_engine.generate_batch([list(range(2, 33)) + [5] * 10] * TOY_SLOTS,
                              SamplingParams(max_new_tokens=5, ignore_eos=True))
    for p in (TOY_PROMPTS[1], TOY_PROMPTS[4]):
        assert toy_engine.generate(p, max_new_tokens=10, ignore_eos=True).tokens == \
            _toy_eager_greedy(toy_model, p, 10)


def test_toy_score(toy_engine, toy_model) -> None:
    ids = TOY_PROMPTS[2]
    ref = _toy_eager_score(toy_model, ids)
    whole = toy_engine.score(ids)
    assert whole.logprobs[0] is None and len(whole.logprobs) == len(ids)
    np.testing.assert_allclose(whole.logprobs[1:], ref, atol=2e-4)
    assert whole.perplexity == pytest.approx(math.exp(-ref.mean()), rel=1e-4)
    for chunk in (3, 5, 7):  # overlapping chunks give the same numbers
        part = toy_engine.score(ids, max_chunk=chunk)
        np.testing.assert_allclose(part.logprobs[1:], whole.logprobs[1:], atol=2e-5)
    with pytest.raises(RequestError, match="at least 2 tokens"):
        toy_engine.score([5])


def test_toy_max_seq_len_stop(toy_engine) -> None:
    r = toy_engine.generate([2] * (TOY_S - 2), max_new_tokens=10, ignore_eos=True)
    assert r.stop_reason == "max_seq_len" and len(r.tokens) == 3
    r = toy_engine.generate([2] * TOY_S, max_new_tokens=10, ignore_eos=True)
    assert r.stop_reason == "max_seq_len" and len(r.tokens) == 1


def test_toy_stop_token_and_strings(toy_engine) -> None:
    p = "hello world"
    full = toy_engine.generate(p, max_new_tokens=30, ignore_eos=True)
    assert full.text == toy_engine.decode(full.tokens)
    t = full.tokens[4]
    r = toy_engine.generate(p, max_new_tokens=30, stop_token_ids=[t], ignore_eos=True)
    assert r.stop_reason == "stop_token" and r.tokens == full.tokens[:full.tokens.index(t) + 1]
    stop = full.text[6:8]
    cut = full.text.find(stop)
    chunks = list(toy_engine.stream(p, max_new_tokens=30, stop=[stop], ignore_eos=True))
    res = toy_engine.result(chunks[-1].request_id)
    assert res.stop_reason == "stop_string" and res.text == full.text[:cut]
    assert "".join(c.text for c in chunks) == res.text
    assert [c.token for c in chunks] == res.tokens
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    # streamed text of an unstopped run is the whole text
    chunks = list(toy_engine.stream(p, max_new_tokens=30, ignore_eos=True))
    assert "".join(c.text for c in chunks) == full.text
    # abandoning a stream releases its slot
    it = toy_engine.stream(p, max_new_tokens=30, ignore_eos=True)
    next(it), next(it)
    it.close()
    assert not toy_engine.has_work and toy_engine.slots.n_free == TOY_SLOTS


def test_toy_text_prompt_and_chat(toy_engine) -> None:
    assert toy_engine.encode("abc") == [0, 2, 3, 4]
    assert toy_engine.encode("abc", add_bos=False) == [2, 3, 4]
    ids = toy_engine.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == 0 and toy_engine.decode(ids) == "user, hi. assistant,"
    r = toy_engine.generate("hello", max_new_tokens=5, ignore_eos=True)
    assert r.prompt_tokens == toy_engine.encode("hello")


@pytest.mark.parametrize("prompt,kw,match", [
    ([], {}, "prompt is empty"),
    ("", {}, "prompt is empty"),
    ([0] * (TOY_S + 1), {}, "longer than max_seq_len 48"),
    ([0, -1], {}, r"invalid token id\(s\) \[-1\]"),
    ([0, TOY_V], {}, "invalid token id"),
    ([0, 1.5], {}, "invalid token id"),
    ([0, 2], {"top_p": 2.0}, "top_p"),
    ([0, 2], {"stop_token_ids": [999]}, "stop token id 999"),
])
def test_toy_request_errors(toy_engine, prompt, kw, match) -> None:
    with pytest.raises(RequestError, match=match):
        toy_engine.generate(prompt, **kw)
    assert not toy_engine.has_work


def test_toy_mismatched_artifacts(toy_export: Path, tmp_path: Path) -> None:
    import shutil

    from dsv4.runtime.engine import Engine

    d = tmp_path / "mixed"
    shutil.copytree(toy_export, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["export_id"] = "toy-9999"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ArtifactError, match="built by export toy-0001 but config.json is from export toy-9999"):
        Engine(d)
    cfg["export_id"] = TOY_EXPORT_ID
    cfg["functions"]["decode_bs8"] = cfg["functions"]["decode_bs1"]
    cfg["decode"]["batch_sizes"] = [1, 2, 4, 8]
    cfg["n_slots"] = 8
    for s in cfg["state"]:
        s["shape"][0] = 8
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ArtifactError, match="lacks function.*decode_bs8"):
        Engine(d)
    (d / "model.llvm-cpu.vmfb").write_bytes(b"not a vmfb")
    with pytest.raises(ArtifactError, match="model.llvm-cpu.vmfb: not a complete IREE module"):
        Engine(d)


def test_toy_cli(toy_export: Path, capsys) -> None:
    from dsv4.cli import main

    assert main(["generate", str(toy_export), "--prompt", "hello", "--max-new-tokens", "6", "--json",
                 "--ignore-eos"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["tokens"]) == 6 and out["stop_reason"] == "length" and isinstance(out["text"], str)
    assert out["ttft_s"] > 0 and out["tpot_s"] > 0
    assert main(["generate", str(toy_export), "--prompt-ids", "0,5,6", "--max-new-tokens", "4",
                 "--temperature", "1.0", "--seed", "3", "--top-k", "5", "--top-p", "0.9"]) == 0
    assert main(["score", str(toy_export), "--prompt-ids", "0,5,6,7", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["logprobs"][0] is None and len(out["logprobs"]) == 4 and out["perplexity"] > 1
    capsys.readouterr()
    assert main(["generate", str(toy_export), "--prompt-ids", "0,999"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid token id" in err[0]
    assert main(["generate", str(toy_export), "--prompt", ""]) == 2
    assert main(["generate", str(toy_export), "--prompt-ids", "1", "--device", "cuda"]) == 2
    assert "no cuda module" in capsys.readouterr().err


def test_toy_engine_runs_without_torch(toy_export: Path, toy_model) -> None:
    """The whole generate path in a process where torch and the IREE compiler cannot be imported."""
    p = TOY_PROMPTS[2]
    code = _BLOCKER + textwrap.dedent(f"""
        from dsv4.runtime.engine import Engine
        e = Engine({str(toy_export)!r})
        print(e.generate({p!r}, max_new_tokens=10, ignore_eos=True).tokens)
        bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(('iree.compiler', 'iree.turbine'))]
        assert not bad, bad
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(_toy_eager_greedy(toy_model, p, 10))


# ------------------------------------------------------------------------------------------------
# the real model: tiny preset (random weights) through dsv4.export.exporter, llvm-cpu
# ------------------------------------------------------------------------------------------------

TINY_SEED = 0
TINY_SLOTS = 4
TINY_CHUNK = 32  # small prefill chunk so long prompts take several calls
TINY_NEW = 64


def _tiny_model():
    import torch

    from dsv4.model.config import ModelConfig
    from dsv4.model.model import Transformer, init_random

    cfg = ModelConfig.preset("tiny")
    return cfg, init_random(Transformer(cfg, dtype=torch.float32), seed=TINY_SEED).eval()


# prefill and decode bs 1 and 4: requests admitted together prefill in one call
TINY_EXPORT_ARGS = dict(targets=["llvm-cpu"], batch_sizes=(1, 4), decode_batch_sizes=(1, 4), n_slots=TINY_SLOTS,
                        max_chunk=TINY_CHUNK)


@pytest.fixture(scope="session")
def tiny_export() -> Path:
    """The tiny preset exported for llvm-cpu (5-15 min on 2 cores, so cached under .cache/ by
    tests/conftest.py). The exporter is imported, not import-skipped: a broken exporter must fail these tests."""
    from conftest import cached_export

    from dsv4.export.exporter import ExportSpec, export_model

    def build(out: Path) -> None:
        cfg, model = _tiny_model()
        export_model(model, ExportSpec(**TINY_EXPORT_ARGS), out)

    return cached_export("runtime-tiny", build, [TINY_SEED, sorted(TINY_EXPORT_ARGS.items())])


@pytest.fixture(scope="session")
def tiny_eager():
    return _tiny_model()[1]


@pytest.fixture(scope="session")
def tiny_engine(tiny_export: Path):
    from dsv4.runtime.engine import Engine

    return Engine(tiny_export)


TINY_PROMPTS = [
    [0, 17, 42, 7, 99, 3, 256, 12],
    [0] + [(31 * i + 5) % 500 + 2 for i in range(40)],  # two prefill chunks
    [0, 5],
    [0] + [(7 * i + 1) % 480 + 3 for i in range(70)],  # three chunks
    [0, 400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411, 412, 413, 414, 415, 416, 417],
]


@pytest.fixture(scope="session")
def tiny_reference(tiny_eager) -> list[list[int]]:
    """Eager greedy. The model's top-k breaks exact ties by the lowest index in eager and export
    alike (model/kernels/topk.py); with torch.topk's unspecified tie order a tied indexer/router
    score of the random weights flipped the token stream within 64 steps (prompt 5, step 15)."""
    from dsv4.model.generate import greedy

    return [greedy(tiny_eager, p, TINY_NEW, chunk=TINY_CHUNK) for p in TINY_PROMPTS]


def test_tiny_export_abi(tiny_engine) -> None:
    c = tiny_engine.config
    assert c.prefill_max_tokens == TINY_CHUNK and c.n_slots == TINY_SLOTS
    assert tiny_engine.module_export_id == c.export_id  # the vmfb's baked-in id was read and matched


def test_tiny_greedy_matches_eager(tiny_engine, tiny_reference) -> None:
    for p, ref in zip(TINY_PROMPTS, tiny_reference):
        got = tiny_engine.generate(p, max_new_tokens=TINY_NEW, ignore_eos=True)
        assert got.tokens == ref, f"prompt of {len(p)} tokens"


def test_tiny_batched_matches_eager(tiny_engine, tiny_reference) -> None:
    """Five prompts of different lengths on four slots: batched decode (padded bs4 calls), a queued
    request joining when a slot frees up, and every sequence equal to eager greedy."""
    lens = [TINY_NEW, 20, TINY_NEW, 33, 50]
    res = tiny_engine.generate_batch(TINY_PROMPTS, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lens])
    for r, ref, n in zip(res, tiny_reference, lens):
        assert r.tokens == ref[:n]
    assert tiny_engine.slots.n_free == TINY_SLOTS


def test_tiny_sampling_seeds(tiny_engine) -> None:
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.95, seed=42, ignore_eos=True)
    a = tiny_engine.generate(TINY_PROMPTS[0], sp)
    assert tiny_engine.generate(TINY_PROMPTS[0], sp).tokens == a.tokens
    assert tiny_engine.generate(TINY_PROMPTS[0], replace_seed(sp, 43)).tokens != a.tokens
    res = tiny_engine.generate_batch([TINY_PROMPTS[1], TINY_PROMPTS[0], TINY_PROMPTS[2]],
                                     [replace_seed(sp, 1), sp, SamplingParams(max_new_tokens=5, ignore_eos=True)])
    assert res[1].tokens == a.tokens


def test_tiny_sample_function_equals_torch(tiny_engine) -> None:
    """sample_bs{N} compiled (model/device_sampling.py) picks the ids the torch function picks."""
    import torch

    from dsv4.model.device_sampling import sample

    v = tiny_engine.config.model["vocab_size"]
    g = np.random.default_rng(1)
    for n in (1, 4):
        fn = tiny_engine.module.function(f"sample_bs{n}")
        for _ in range(6):
            a = ((g.standard_normal((n, v)) * 3).astype(np.float32), g.choice([0.0, 0.8, 1.3], n).astype(np.float32),
                 g.choice([0, 1, 7, 100], n), g.choice([1.0, 0.9, 0.5], n).astype(np.float32),
                 g.integers(0, 2**32, n))
            got = np.asarray(fn(*a).to_host()).reshape(-1)
            assert got.tolist() == sample(*(torch.as_tensor(x) for x in a)).tolist()


def test_tiny_device_sampled_tokens_match_an_eager_replay(tiny_engine, tiny_eager) -> None:
    """The engine's device-sampled stream equals an eager loop that takes the same per-token keys
    from the request's seed and samples with the float64 reference."""
    import torch
    from test_device_sampling import ref_sample

    from dsv4.model.state import new_state

    sp = SamplingParams(max_new_tokens=20, temperature=0.9, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
    before = tiny_engine.stats["device_samples"]
    got = tiny_engine.generate(TINY_PROMPTS[1], sp).tokens
    assert tiny_engine.stats["device_samples"] - before == 20  # every token chosen on the device

    rng = np.random.Generator(np.random.PCG64(7))
    cfg = tiny_eager.cfg
    state = new_state(cfg, 1, tiny_eager.dtype)
    one = lambda v: torch.tensor([v])
    prompt = TINY_PROMPTS[1]
    with torch.no_grad():
        for s in range(0, len(prompt), TINY_CHUNK):
            piece = prompt[s:s + TINY_CHUNK]
            logits = tiny_eager(torch.tensor([piece]), one(s), one(len(piece)), one(0), state)
        ref, pos = [], len(prompt)
        for _ in range(20):
            ref.append(ref_sample(logits[0].numpy(), 0.9, 50, 0.9, int(rng.integers(0, 2**32))))
            logits = tiny_eager(torch.tensor([[ref[-1]]]), one(pos), one(1), one(0), state)
            pos += 1
    assert got == ref


def test_tiny_nonfinite_logits_are_an_error(tiny_export: Path, tmp_path: Path) -> None:
    """A NaN in the weights (the final norm) makes every row's logits NaN: the step marks the rows
    (argmax -1) and the engine raises, greedy and device-sampled alike, instead of emitting a token."""
    import shutil

    from dsv4.runtime.engine import Engine
    from dsv4.contract.weights import open_weights, write_shards

    d = tmp_path / "nan"
    shutil.copytree(tiny_export, d)
    cfg = ExportConfig.load(d)
    w = open_weights([d / p for p in cfg.raw["parameters"]])
    tensors = []
    for key, _, dtype in cfg.raw["weights"]["tensors"]:
        a = np.array(w.tensor(key))
        if key == "model.norm.weight":
            a[0] = np.nan
        tensors.append((key, a, dtype))
    del w
    write_shards(d, iter(tensors))
    eng = Engine(d)
    for sp in (SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=4, temperature=0.8, seed=1)):
        with pytest.raises(EngineError, match="non-finite logits"):
            eng.generate(TINY_PROMPTS[0], sp)


def test_tiny_slot_reuse_leaks_nothing(tiny_engine, tiny_reference) -> None:
    tiny_engine.generate_batch([TINY_PROMPTS[3]] * TINY_SLOTS, SamplingParams(max_new_tokens=40, ignore_eos=True))
    for i in (2, 0):
        assert tiny_engine.generate(TINY_PROMPTS[i], max_new_tokens=TINY_NEW, ignore_eos=True).tokens == \
            tiny_reference[i]


def test_tiny_score_matches_eager(tiny_engine, tiny_eager) -> None:
    import torch

    from dsv4.model.state import new_state

    ids = TINY_PROMPTS[1][:TINY_CHUNK]
    with torch.no_grad():
        st = new_state(tiny_eager.cfg, 1, torch.float32)
        lg = tiny_eager(torch.tensor([ids]), torch.tensor([0]), torch.tensor([len(ids)]), torch.tensor([0]), st,
                        all_logits=True)
        ref = lg[0].double().log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    res = tiny_engine.score(ids)
    # derived from the compiled-vs-eager fp32 logit bound of test_export_model (2e-4 + 2e-4 |logit|):
    # a log-softmax moves by at most twice the largest logit change
    tol = 2 * (2e-4 + 2e-4 * float(lg.abs().max()))
    np.testing.assert_allclose(res.logprobs[1:], ref, rtol=0, atol=tol)
    assert res.perplexity == pytest.approx(math.exp(-ref.mean()), rel=1e-3)
    long = TINY_PROMPTS[3]  # longer than one call: overlapping chunks
    whole = tiny_engine.score(long)
    assert len(whole.logprobs) == len(long)
    np.testing.assert_allclose(whole.logprobs[1:len(ids)], tiny_engine.score(long[:len(ids)]).logprobs[1:],
                               atol=1e-4)


def test_tiny_errors(tiny_engine, tiny_export: Path, tmp_path: Path) -> None:
    import shutil

    from dsv4.runtime.engine import Engine

    with pytest.raises(RequestError, match="longer than max_seq_len"):
        tiny_engine.generate([0] * (tiny_engine.config.max_seq_len + 1))
    with pytest.raises(RequestError, match="invalid token id"):
        tiny_engine.generate([0, tiny_engine.config.vocab_size])
    with pytest.raises(RequestError, match="no tokenizer"):
        tiny_engine.generate("text prompt")
    d = tmp_path / "mixed"
    shutil.copytree(tiny_export, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["export_id"] = "0" * 32
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ArtifactError, match="mixes artifacts of two exports"):
        Engine(d)


def test_tiny_generate_without_torch(tiny_export: Path, tiny_reference) -> None:
    code = _BLOCKER + textwrap.dedent(f"""
        from dsv4.cli import main
        main(['generate', {str(tiny_export)!r}, '--prompt-ids', {','.join(map(str, TINY_PROMPTS[0]))!r},
              '--max-new-tokens', '16', '--ignore-eos', '--json'])
        bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(('iree.compiler', 'iree.turbine'))]
        assert not bad, bad
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == tiny_reference[0][:16]
