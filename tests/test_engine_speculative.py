"""Speculative decoding through the Engine and `dsv4 generate --speculative mtp`, with a fake
module in place of the compiled one (the seam: engine.IreeModule; the compiled entry points are
checked against the eager reference in tests/test_speculative_export.py, the sampled acceptance
rule's distribution in tests/test_speculative.py).

The fake model's greedy token after token t at position p is ``f(t, p) = (5 t + p) mod V``, so the
plain greedy continuation is a formula (the independent reference here). Its MTP "drafter" is right
except after a chosen token divisible by 4 (then it drafts f + 1), so rows accept different numbers
of drafts. The fake keeps, per slot, the tokens written at each position, and checks that every call
starts where the slot's written tokens end and that verify writes only the kept positions.

A sampled row (temperature > 0) of the fake chooses ``g(t, p, key, i) = (f(t, p) + bit i of key) mod V``
at the i-th position of a call, so its tokens depend on the keys the Engine draws from the
request's seed (one per call: the prompt's last chunk, then every verify call)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dsv4.cli import main
from dsv4.contract.artifact import build_config, speculative_functions, write_config
from dsv4.contract.errors import EngineError, RequestError
from dsv4.runtime import engine as engine_mod
from dsv4.runtime.sampling import SamplingParams, SamplingParamsError

V, SLOTS, SEQ, TMAX = 64, 4, 96, 8
PREFILL_BS, DECODE_BS = (1, 2), (1, 2, 4)


def f(t: int, p: int) -> int:
    return (5 * t + p) % V


def g(t: int, p: int, key: int, i: int) -> int:
    """The fake's sampled token after t at position p, at index i of a call with `key`."""
    return (f(t, p) + (key >> i) % 2) % V


def plain_greedy(prompt: list[int], n: int) -> list[int]:
    out, t, p = [], prompt[-1], len(prompt) - 1
    for _ in range(n):
        t, p = f(t, p), p + 1
        out.append(t)
    return out


def spec_sampled(prompt: list[int], n: int, seed: int, k: int) -> list[int]:
    """The tokens a sampled speculative request of the fake must get: its keys drawn in order from the
    request's Generator (PCG64(seed)): one for the prompt's last chunk, then one per verify call of
    1 + K tokens (fewer at the end), each call keeping its accepted drafts and one more token."""
    rng = np.random.Generator(np.random.PCG64(seed))
    t = g(prompt[-1], len(prompt) - 1, int(rng.integers(0, 2**32)), 0)
    out, pos = [t], len(prompt)
    drafts = FakeModule._drafts(FakeModule, t, pos)
    while len(out) < n:
        key = int(rng.integers(0, 2**32))
        toks = [out[-1], *drafts][:min(1 + k, n - len(out))]
        chosen = [g(x, pos + i, key, i) for i, x in enumerate(toks)]
        a = 0
        while a + 1 < len(toks) and toks[a + 1] == chosen[a]:
            a += 1
        out += chosen[:a + 1]
        pos += a + 1
        drafts = FakeModule._drafts(FakeModule, chosen[a], pos)
    return out


class _Host:
    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def to_host(self) -> np.ndarray:
        return self.a


class FakeModule:
    """The export ABI (prefill/decode/mtp_prefill/verify) over the formula model; ``written[slot]``
    the tokens at positions 0 .. of each slot."""

    instances: list["FakeModule"] = []
    k = 2
    sampled_rows: list[tuple[str, float, int, float]] = []  # (function, temperature, top_k, top_p) per sampled row

    def __init__(self, vmfb, parameters=None, **kw) -> None:
        self.written: dict[int, list[int]] = {s: [] for s in range(SLOTS)}
        self.calls: list[str] = []
        FakeModule.instances.append(self)

    @property
    def function_names(self) -> list[str]:
        names = [f"prefill_bs{n}" for n in PREFILL_BS] + [f"decode_bs{n}" for n in DECODE_BS]
        return names + [f"mtp_prefill_bs{n}" for n in PREFILL_BS] + [f"verify_bs{n}_k{self.k}" for n in DECODE_BS]

    def read_export_id(self) -> None:
        return None

    def zeros(self, spec) -> _Host:
        return _Host(np.zeros(spec.shape, np.float32))

    def _write(self, slot: int, start: int, toks) -> None:
        w = self.written[slot]
        assert start <= len(w), f"slot {slot}: a call at {start} after {len(w)} written tokens"
        del w[start:]
        w.extend(int(t) for t in toks)

    def _drafts(self, c: int, p: int) -> list[int]:
        """K drafts after token c chosen at position p (p: c's position)."""
        d, t = [], c
        for i in range(self.k):
            nxt = f(t, p + i)
            if i == 0 and c % 4 == 0:
                nxt = (nxt + 1) % V
            d.append(nxt)
            t = nxt
        return d

    def function(self, name: str):
        self.calls.append(name)
        bs = int(name.split("bs", 1)[1].split("_")[0])

        def sampled(temp, top_k, top_p, key) -> list[int | None]:
            """Per row: the key of a sampled row, None for a greedy one."""
            assert temp.dtype == np.float32 and top_p.dtype == np.float32 and key.dtype == np.int64
            assert all(len(a) == bs for a in (temp, top_k, top_p, key))
            out = []
            for b in range(bs):
                if temp[b] > 0:
                    FakeModule.sampled_rows.append((name, float(temp[b]), int(top_k[b]), float(top_p[b])))
                    assert 0 <= key[b] < 2**32
                out.append(int(key[b]) if temp[b] > 0 else None)
            return out

        def step(tokens, start_pos, lengths, slots, *rest):
            assert tokens.shape[0] == bs and len(slots) == bs and len(set(slots.tolist())) == bs
            nxt_tok = rest[0] if name.startswith("mtp_prefill") else None
            keys = sampled(*rest[1:5]) if name.startswith("mtp_prefill") else [None] * bs
            logits = np.zeros((bs, V), np.float32)
            am = np.zeros(bs, np.int64)
            drafts = np.zeros((bs, self.k), np.int64)
            for b in range(bs):
                n = int(lengths[b])
                if n == 0:
                    continue
                self._write(int(slots[b]), int(start_pos[b]), tokens[b, :n])
                last = int(start_pos[b]) + n - 1
                am[b] = f(int(tokens[b, n - 1]), last) if keys[b] is None else g(int(tokens[b, n - 1]), last, keys[b], 0)
                logits[b, am[b]] = 1.0
                if nxt_tok is not None and int(nxt_tok[b]) >= 0:
                    assert nxt_tok[b] == -1 or n == TMAX  # only a full chunk is followed by another
                drafts[b] = self._drafts(int(am[b]), last + 1)
            if name.startswith("mtp_prefill"):
                return _Host(logits), _Host(am), _Host(drafts)
            return _Host(logits), _Host(am)

        def verify(tokens, start_pos, lengths, slots, temp, top_k, top_p, key, *state):
            assert tokens.shape == (bs, 1 + self.k)
            keys = sampled(temp, top_k, top_p, key)
            chosen = np.zeros((bs, 1 + self.k), np.int64)
            acc = np.zeros(bs, np.int64)
            drafts = np.zeros((bs, self.k), np.int64)
            for b in range(bs):
                n, p = int(lengths[b]), int(start_pos[b])
                if n == 0:
                    continue
                for i in range(n):
                    t = int(tokens[b, i])
                    chosen[b, i] = f(t, p + i) if keys[b] is None else g(t, p + i, keys[b], i)
                a = 0
                while a + 1 < n and tokens[b, a + 1] == chosen[b, a]:
                    a += 1
                acc[b] = a
                self._write(int(slots[b]), p, tokens[b, :a + 1])  # only the kept positions
                drafts[b] = self._drafts(int(chosen[b, a]), p + a + 1)
            return _Host(np.zeros((bs, 1 + self.k, V), np.float32)), _Host(chosen), _Host(acc), _Host(drafts)

        return verify if name.startswith("verify") else step


def _write_export(d: Path, k: int | None, eos: tuple[int, ...] = ()) -> Path:
    state = [{"name": "kv", "shape": [SLOTS, 8], "dtype": "float32"}]
    spec, fns = (None, {}) if k is None else speculative_functions(k, PREFILL_BS, DECODE_BS, ["kv"])
    raw = build_config(model={"vocab_size": V}, activation_dtype="float32", n_slots=SLOTS, max_seq_len=SEQ,
                       prefill_batch_sizes=list(PREFILL_BS), min_tokens=1, max_tokens=TMAX,
                       decode_batch_sizes=list(DECODE_BS), score_batch_sizes=[], state=state,
                       targets={"llvm-cpu": {"vmfb": "model.llvm-cpu.vmfb"}}, parameters="model.irpa",
                       tokenizer=None, bos_token_id=None, eos_token_ids=list(eos), export_id="fake",
                       extra_functions=fns, speculative=spec)
    write_config(d, raw)
    (d / "model.llvm-cpu.vmfb").write_bytes(b"")
    (d / "model.irpa").write_bytes(b"")
    return d


@pytest.fixture
def fake(monkeypatch):
    FakeModule.instances.clear()
    FakeModule.sampled_rows.clear()
    FakeModule.k = 2
    monkeypatch.setattr(engine_mod, "IreeModule", FakeModule)
    return FakeModule


PROMPTS = [[3, 9, 4], list(range(1, 20)), [8] * 11]


def _check_counts(res, n_new: int) -> None:
    assert 0 <= res.accepted <= res.drafted
    # every verify call yields its accepted drafts and one token of the model's own (no stop token here)
    assert len(res.tokens) == 1 + res.decode_calls + res.accepted
    if res.accepted:
        assert res.decode_calls < len(res.tokens) - 1
    assert res.acceptance_rate == pytest.approx(res.accepted / res.drafted)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_tokens_are_plain_greedy_alone_and_batched(tmp_path, fake, k) -> None:
    fake.k = k
    eng = engine_mod.Engine(_write_export(tmp_path, k), batch_invariant=False)  # rows packed into verify_bs2/4
    assert eng.draft_tokens == k
    n_new = [20, 13, 7]
    alone = []
    for p, n in zip(PROMPTS, n_new):
        alone.append(eng.generate(p, SamplingParams(max_new_tokens=n, speculative=True)))
        assert alone[-1].tokens == plain_greedy(p, n)
        _check_counts(alone[-1], n)
    calls = len(eng.module.calls)
    res = eng.generate_batch(PROMPTS, [SamplingParams(max_new_tokens=n, speculative=True) for n in n_new])
    assert [r.tokens for r in res] == [plain_greedy(p, n) for p, n in zip(PROMPTS, n_new)]
    for r, n in zip(res, n_new):
        _check_counts(r, n)
    assert len({(r.accepted, r.drafted) for r in res}) > 1  # the rows accepted different counts
    batched = eng.module.calls[calls:]
    assert any(c.startswith(("verify_bs2_", "verify_bs4_")) for c in batched)
    assert not any(c.startswith(("prefill_", "decode_")) for c in eng.module.calls)
    assert eng.stats["accepted"] == sum(r.accepted for r in alone + res) > 0
    assert eng.stats["drafted"] == sum(r.drafted for r in alone + res)


def test_batch_invariant_engine_verifies_every_request_through_one_function(tmp_path, fake) -> None:
    """The default Engine (batch_invariant=True) sends every verify through the smallest exported
    verify batch size, as it does prefill: verify functions of different sizes round differently."""
    eng = engine_mod.Engine(_write_export(tmp_path, 2))
    n_new = [20, 13, 7]
    res = eng.generate_batch(PROMPTS, [SamplingParams(max_new_tokens=n, speculative=True) for n in n_new])
    assert [r.tokens for r in res] == [plain_greedy(p, n) for p, n in zip(PROMPTS, n_new)]
    verify = {c for c in eng.module.calls if c.startswith("verify_")}
    assert verify == {f"verify_bs{DECODE_BS[0]}_k2"}, verify


def test_speculative_and_plain_requests_share_the_engine(tmp_path, fake) -> None:
    eng = engine_mod.Engine(_write_export(tmp_path, 2))
    params = [SamplingParams(max_new_tokens=15, speculative=s) for s in (True, False, True)]
    res = eng.generate_batch(PROMPTS, params)
    assert [r.tokens for r in res] == [plain_greedy(p, 15) for p in PROMPTS]
    assert res[1].drafted is None and res[1].decode_calls == 14
    assert "drafted" not in res[1].to_json() and res[1].to_json()["decode_calls"] == 14
    js = res[0].to_json()
    assert js["acceptance_rate"] == res[0].accepted / res[0].drafted and js["decode_calls"] == res[0].decode_calls
    assert eng.stats["accepted"] == res[0].accepted + res[2].accepted
    assert eng.stats["drafted"] == res[0].drafted + res[2].drafted
    assert eng.stats["verify_calls"] < eng.stats["decode_calls"]


def test_a_stop_token_inside_an_accepted_run_ends_the_request(tmp_path, fake) -> None:
    fake.k = 3
    eng = engine_mod.Engine(_write_export(tmp_path, 3))
    want = plain_greedy(PROMPTS[1], 30)
    stop = want[9]
    cut = want[:want.index(stop) + 1]
    res = eng.generate(PROMPTS[1], SamplingParams(max_new_tokens=30, speculative=True, stop_token_ids=(stop,)))
    assert res.tokens == cut and res.stop_reason == "stop_token"
    # the slot is free again and a new request reuses it from position 0
    res2 = eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=5, speculative=True))
    assert res2.tokens == plain_greedy(PROMPTS[0], 5)


def test_sampled_speculative_follows_the_seed_alone_and_batched(tmp_path, fake) -> None:
    """A sampled speculative request gets the tokens its seed's keys give (spec_sampled), alone and
    batched beside greedy and other sampled requests; its settings reach the device; another seed
    gives other tokens; a request without a seed reports one that reproduces it."""
    eng = engine_mod.Engine(_write_export(tmp_path, 2))
    sp = dict(speculative=True, temperature=0.7, top_k=5, top_p=0.9)
    alone = eng.generate(PROMPTS[1], SamplingParams(max_new_tokens=25, seed=11, **sp))
    assert alone.tokens == spec_sampled(PROMPTS[1], 25, 11, 2) != plain_greedy(PROMPTS[1], 25)
    _check_counts(alone, 25)
    assert alone.accepted > 0 and alone.accepted < alone.drafted  # both paths of the fake's rule ran
    assert {r[1:] for r in fake.sampled_rows} == {(np.float32(0.7), 5, np.float32(0.9))}
    assert {n.split("_bs")[0] for n, *_ in fake.sampled_rows} == {"mtp_prefill", "verify"}
    params = [SamplingParams(max_new_tokens=12, speculative=True), SamplingParams(max_new_tokens=25, seed=11, **sp),
              SamplingParams(max_new_tokens=17, seed=12, **sp)]
    res = eng.generate_batch(PROMPTS, params)
    assert res[0].tokens == plain_greedy(PROMPTS[0], 12)
    assert res[1].tokens == alone.tokens
    assert res[2].tokens == spec_sampled(PROMPTS[2], 17, 12, 2)
    assert spec_sampled(PROMPTS[1], 25, 12, 2) != alone.tokens
    fresh = eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=9, **sp))
    assert fresh.tokens == spec_sampled(PROMPTS[0], 9, fresh.seed, 2)


def test_speculative_errors(tmp_path, fake) -> None:
    assert SamplingParams(speculative=True, temperature=0.7).speculative  # sampled speculation is allowed
    with pytest.raises(SamplingParamsError, match="logprobs"):
        SamplingParams(speculative=True, logprobs=2)
    assert SamplingParams(speculative=True, temperature=0.7, top_k=1).greedy  # top_k 1 is greedy
    eng = engine_mod.Engine(_write_export(tmp_path, None))
    assert eng.draft_tokens is None
    with pytest.raises(RequestError, match="--draft-tokens K"):
        eng.submit([1, 2], SamplingParams(speculative=True))


def _cli_json(capsys, argv: list[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_speculative_json_matches_plain_greedy(tmp_path, fake, capsys) -> None:
    import json

    d = str(_write_export(tmp_path, 2))
    prompt = ",".join(map(str, PROMPTS[1]))
    rc, out, err = _cli_json(capsys, ["generate", d, "--prompt-ids", prompt, "--max-new-tokens", "24", "--json",
                                      "--speculative", "mtp"])
    assert rc == 0, err
    spec = json.loads(out)
    rc, out, _ = _cli_json(capsys, ["generate", d, "--prompt-ids", prompt, "--max-new-tokens", "24", "--json"])
    plain = json.loads(out)
    assert spec["tokens"] == plain["tokens"] == plain_greedy(PROMPTS[1], 24)
    assert plain["decode_calls"] == 23 and "acceptance_rate" not in plain
    assert 0 < spec["accepted"] <= spec["drafted"]
    assert spec["acceptance_rate"] == spec["accepted"] / spec["drafted"]
    assert spec["decode_calls"] == 23 - spec["accepted"]
    rc, _, err = _cli_json(capsys, ["generate", d, "--prompt-ids", prompt, "--max-new-tokens", "4",
                                    "--speculative", "mtp", "--draft-tokens", "2"])
    assert rc == 0 and "verify calls" in err


def test_cli_speculative_errors(tmp_path, fake, capsys) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    spec = tmp_path / "spec"
    spec.mkdir()
    _write_export(plain, None)
    _write_export(spec, 2)
    base = ["generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]
    rc, _, err = _cli_json(capsys, [base[0], str(plain), *base[1:], "--speculative", "mtp"])
    assert rc == 2 and "no speculative entry points" in err and "dsv4 export --draft-tokens K" in err
    rc, _, err = _cli_json(capsys, [base[0], str(spec), *base[1:], "--speculative", "mtp", "--draft-tokens", "3"])
    assert rc == 2 and "--draft-tokens 3" in err and "exported with --draft-tokens 2" in err
    rc, _, err = _cli_json(capsys, [base[0], str(spec), *base[1:], "--draft-tokens", "2"])
    assert rc == 2 and "needs --speculative mtp" in err
    rc, out, err = _cli_json(capsys, [base[0], str(spec), *base[1:], "--speculative", "mtp", "--temperature", "0.8",
                                      "--seed", "3", "--json"])
    import json

    assert rc == 0, err
    assert json.loads(out)["tokens"] == spec_sampled([1, 2, 3], 4, 3, 2)


def test_async_engine_serves_requests_speculatively(tmp_path, fake) -> None:
    """`dsv4 serve --speculative mtp`'s AsyncEngine on the Engine: greedy requests get plain greedy's
    tokens through verify calls, a sampled one its seed's speculative tokens, and their records carry
    the counts; one with logprobs decodes plainly."""
    import asyncio

    from dsv4.runtime.serve.async_engine import AsyncEngine

    eng = engine_mod.Engine(_write_export(tmp_path, 2))
    records = []

    async def run():
        async with AsyncEngine(eng, speculative=True, on_finish=records.append) as aeng:
            async def one(p, params):
                return [c.token async for c in aeng.generate(p, params)]
            return await asyncio.gather(one(PROMPTS[0], SamplingParams(max_new_tokens=12)),
                                        one(PROMPTS[1], SamplingParams(max_new_tokens=9)),
                                        one(PROMPTS[2], SamplingParams(max_new_tokens=6, temperature=0.9, seed=1)),
                                        one(PROMPTS[0], SamplingParams(max_new_tokens=5, logprobs=1)))

    got = asyncio.run(run())
    assert got[:2] == [plain_greedy(PROMPTS[0], 12), plain_greedy(PROMPTS[1], 9)]
    assert got[2] == spec_sampled(PROMPTS[2], 6, 1, 2)
    assert got[3] == plain_greedy(PROMPTS[0], 5)
    spec = sorted((r for r in records if r.drafted), key=lambda r: -r.generated_tokens)
    assert len(spec) == 3
    for r in spec:
        assert r.generated_tokens == 1 + r.verify_calls + r.accepted and r.accepted <= r.drafted
    assert eng.stats["accepted"] == sum(r.accepted for r in spec) > 0


def test_serve_refuses_speculation_without_the_entry_points(tmp_path, fake, capsys) -> None:
    pytest.importorskip("uvicorn")
    rc, _, err = _cli_json(capsys, ["serve", str(_write_export(tmp_path, None)), "--speculative", "mtp"])
    assert rc == 2 and "no speculative entry points" in err and "--draft-tokens K" in err


@pytest.mark.parametrize("flags, invariant", [([], True), (["--pack-calls"], False)])
def test_serve_pack_calls_turns_batch_invariance_off(tmp_path, fake, capsys, monkeypatch, flags, invariant) -> None:
    """`dsv4 serve` builds a batch-invariant Engine (one request per prefill and verify call) unless
    --pack-calls; the Engine is stopped before the server starts (an EngineError)."""
    pytest.importorskip("uvicorn")
    seen = {}

    def engine(*args, **kwargs):
        seen.update(kwargs)
        raise EngineError("stop here")

    monkeypatch.setattr(engine_mod, "Engine", engine)
    rc, _, err = _cli_json(capsys, ["serve", str(_write_export(tmp_path, 2)), *flags])
    assert rc == 2 and "stop here" in err
    assert seen["batch_invariant"] is invariant
