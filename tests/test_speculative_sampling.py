"""The speculative-sampling rule (model/speculative.choose_sampled): every emitted token is distributed
as the target distribution p of its position (after temperature / top-k / top-p), whatever the
deterministic draft d was.

The drafts are the MTP head's argmax, a one-hot draft distribution q, so the rule is: accept d with
probability p(d), else sample from p without d, renormalised; the bonus token after K accepted drafts
from p. Checked on a 6-token vocabulary over 20,000 seeded trials (a row per trial with its own key, the
same keys every run, so the test is deterministic): a chi-square goodness-of-fit test against p computed
independently in float64 (numpy; the filters as runtime/sampling.py defines them), the acceptance
rate against p(d) within 5 binomial standard errors. The same check rejects the two classic mistakes
(accepting every draft; sampling the rejection from p without removing d), built from the rule's own
outputs, so it has the power to fail. Eager and fast: no compile.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dsv4.model.speculative import choose, choose_sampled

V = 6
N = 20_000
# logits with distinct values (the device filters keep ties with a threshold, the host the lower id)
LOGITS = {
    "peaked": [3.0, 1.2, 0.4, -0.5, 0.9, -1.7],
    "flat": [0.10, 0.35, -0.20, 0.05, 0.25, -0.10],
    "two": [2.0, 1.9, -1.0, -1.3, -0.6, -2.2],
}
# (logits, temperature, top_k, top_p, draft d); d from likely to impossible (outside the kept set)
CASES = [
    ("peaked", 1.0, 0, 1.0, 0),   # d the argmax, p(d) ~ 0.7
    ("peaked", 1.0, 0, 1.0, 5),   # d unlikely, p(d) ~ 0.01
    ("flat", 0.7, 0, 1.0, 1),     # near uniform
    ("two", 1.3, 3, 1.0, 1),      # top-k: d kept
    ("two", 1.3, 3, 1.0, 3),      # top-k: d outside the kept set, never accepted
    ("peaked", 0.8, 0, 0.9, 4),   # top-p: d kept
    ("flat", 1.0, 4, 0.6, 0),     # top-k then top-p
]


def target(logits: list[float], temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """p in float64: softmax(x / T) over the top_k largest, then the smallest prefix by descending
    probability whose mass reaches top_p, renormalised."""
    x = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = order[:top_k] if top_k else order
    p = np.exp(x[keep] - x[keep].max())
    p /= p.sum()
    n = int(np.searchsorted(np.cumsum(p), top_p - 1e-12)) + 1 if top_p < 1 else p.size
    out = np.zeros(V)
    out[keep[:n]] = p[:n] / p[:n].sum()
    return out


def chi2_ok(counts: np.ndarray, p: np.ndarray, z: float = 3.72) -> tuple[bool, float, float]:
    """Chi-square goodness of fit of counts to p at significance ~1e-4 (z: its normal quantile; the
    critical value by Wilson-Hilferty's approximation). A token with p = 0 must never appear. Returns
    (passes, statistic, critical value)."""
    n = counts.sum()
    if counts[p == 0].any():
        return False, math.inf, 0.0
    e = n * p[p > 0]
    stat = float(((counts[p > 0] - e) ** 2 / e).sum())
    df = int((p > 0).sum()) - 1
    if df == 0:
        return True, stat, 0.0
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit, stat, crit


def run_rule(logits_rows: list[list[float]], drafts: list[int], temperature: float, top_k: int, top_p: float,
             seed: int = 0, lengths: int | None = None) -> torch.Tensor:
    """chosen [N, T] for N identical rows [x_0 .. x_{T-1}] (positions) with drafts d_1 .. d_{T-1} after
    them; keys seed*N .. seed*N + N - 1."""
    T = len(logits_rows)
    lg = torch.tensor(logits_rows, dtype=torch.float32)[None].expand(N, T, V).contiguous()
    following = torch.tensor([*drafts, 0])[None].expand(N, T)  # the last position has no draft
    ln = torch.full((N,), T if lengths is None else lengths)
    s = (torch.full((N,), temperature), torch.full((N,), top_k), torch.full((N,), top_p),
         torch.arange(N) + seed * N)
    return choose_sampled(lg, following, ln, s)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-T{c[1]}-k{c[2]}-p{c[3]}-d{c[4]}" for c in CASES])
def test_emitted_token_is_distributed_as_p(case):
    name, temperature, top_k, top_p, d = case
    p = target(LOGITS[name], temperature, top_k, top_p)
    chosen = run_rule([LOGITS[name], LOGITS["flat"]], [d], temperature, top_k, top_p)
    emitted = chosen[:, 0].numpy()
    counts = np.bincount(emitted, minlength=V)
    ok, stat, crit = chi2_ok(counts, p)
    assert ok, f"chi2 {stat:.1f} >= {crit:.1f}: counts {counts.tolist()} vs p {np.round(p * N).tolist()}"
    # the acceptance rate is p(d): the emitted token equals d exactly when d was accepted
    rate = (emitted == d).mean()
    se = math.sqrt(max(p[d] * (1 - p[d]), 1e-12) / N)
    assert abs(rate - p[d]) < 5 * se + 1e-9
    # the bonus position (no draft after it): a plain sample from its own p
    bonus = np.bincount(chosen[:, 1].numpy(), minlength=V)
    ok, stat, crit = chi2_ok(bonus, target(LOGITS["flat"], temperature, top_k, top_p))
    assert ok, f"bonus: chi2 {stat:.1f} >= {crit:.1f}"


def test_a_chain_of_two_drafts():
    """K = 2: the token after an accepted first draft is distributed as the second position's p (the
    verify logits there are conditioned on d_1), both for a likely and an unlikely second draft; the
    accepted count is 0, 1, 2 with probabilities 1 - p0(d1), p0(d1) (1 - p1(d2)), p0(d1) p1(d2)."""
    rows = [LOGITS["two"], LOGITS["peaked"], LOGITS["flat"]]
    p0, p1, p2 = (target(r, 1.0, 0, 1.0) for r in rows)
    for d2 in (0, 3):
        chosen = run_rule(rows, [1, d2], 1.0, 0, 1.0, seed=1 + d2).numpy()
        first = chosen[:, 0] == 1
        ok, stat, crit = chi2_ok(np.bincount(chosen[first, 1], minlength=V), p1)
        assert ok, f"second token: chi2 {stat:.1f} >= {crit:.1f}"
        both = first & (chosen[:, 1] == d2)
        ok, stat, crit = chi2_ok(np.bincount(chosen[both, 2], minlength=V), p2)
        assert ok, f"bonus after two accepted drafts: chi2 {stat:.1f} >= {crit:.1f}"
        accepted = np.where(first, np.where(both, 2, 1), 0)
        want = np.array([1 - p0[1], p0[1] * (1 - p1[d2]), p0[1] * p1[d2]])
        ok, stat, crit = chi2_ok(np.bincount(accepted, minlength=3), want)
        assert ok, f"accepted counts {np.bincount(accepted).tolist()} vs {np.round(want * N).tolist()}"


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5]], ids=["likely", "flat", "top_p"])
def test_the_check_rejects_broken_rules(case):
    """Two wrong rules, built from the rule's own draws, fail the same chi-square test: accepting
    every draft, and on rejection sampling from p itself (d's mass not removed: d comes out with
    probability p(d) + (1 - p(d)) p(d))."""
    name, temperature, top_k, top_p, d = case
    p = target(LOGITS[name], temperature, top_k, top_p)
    chosen = run_rule([LOGITS[name], LOGITS["flat"]], [d], temperature, top_k, top_p)[:, 0]
    accepted = chosen == d
    always = np.full(N, d)
    # a plain draw from p with the same keys: the rule's bonus draw at a position without a draft
    plain = run_rule([LOGITS[name], LOGITS["flat"]], [d], temperature, top_k, top_p, lengths=1)[:, 0]
    assert chi2_ok(np.bincount(plain.numpy(), minlength=V), p)[0]  # the plain draw itself is right
    no_removal = torch.where(accepted, chosen, plain).numpy()
    for broken in (always, no_removal):
        assert not chi2_ok(np.bincount(broken, minlength=V), p)[0]


def test_greedy_rows_choose_the_argmax():
    """Temperature 0 (any top-k / top-p, any key): choose_sampled is `choose`, the first argmax (ties
    included), and -1 for non-finite logits, also for sampled rows."""
    g = torch.Generator().manual_seed(0)
    lg = torch.randn(16, 3, 40, generator=g)
    lg[3, 1, 7] = lg[3, 1, 9] = lg[3, 1].max() + 1  # a tie: the lower id
    following = torch.randint(0, 40, (16, 3), generator=g)
    s = (torch.zeros(16), torch.randint(0, 5, (16,), generator=g), torch.rand(16, generator=g) * 0.5 + 0.5,
         torch.arange(16))
    got = choose_sampled(lg, following, torch.full((16,), 3), s)
    assert torch.equal(got, choose(lg)) and got[3, 1] == 7
    lg[5, 2, 0] = float("nan")
    hot = (torch.ones(16),) + s[1:]
    assert choose_sampled(lg, following, torch.full((16,), 3), hot)[5, 2] == -1
    assert choose_sampled(lg, following, torch.full((16,), 3), s)[5, 2] == -1


def test_eager_sampled_speculation_matches_plain_sampling():
    """The tiny model (random weights), eager: R rows (slots) with one prompt, all but its last token
    prefilled by mtp_prefill; a sampled verify call of that last token alone (top-k 4: no draft, the
    bonus draw) gives the first token; then a sampled verify call whose first draft is the likeliest
    next token (so both acceptance and rejection happen) and whose second is the MTP draft. The second generated
    token's histogram must match plain sampling's exact marginal sum_t1 p1(t1) p2(. | t1), with p2 from
    plain decode steps (Transformer.forward) in float64. (That a seed reproduces a request's tokens,
    alone or batched: tests/test_engine_speculative.py.)"""
    from dsv4.model.config import ModelConfig
    from dsv4.model.model import Transformer, init_random
    from dsv4.model.speculative import mtp_prefill, verify
    from dsv4.model.state import new_state

    cfg = ModelConfig.preset("tiny").replace(quant_sim=False, max_seq_len=32)  # a small state for R slots
    model = init_random(Transformer(cfg, dtype=torch.float32), seed=0).eval()
    R, n, temp, top_k = 1000, 9, 1.0, 4
    prompt = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(5))

    def vocab_target(logits: torch.Tensor) -> np.ndarray:
        x = logits.double().numpy() / temp
        keep = np.argsort(-x, kind="stable")[:top_k]
        out = np.zeros(x.size)
        out[keep] = np.exp(x[keep] - x[keep].max())
        return out / out.sum()

    i64 = lambda v: torch.full((R,), v, dtype=torch.long)  # noqa: E731
    samp = lambda key0: (torch.full((R,), temp), i64(top_k), torch.ones(R), torch.arange(R) + key0)  # noqa: E731
    with torch.no_grad():
        # the reference: p1 after the prompt, p2 after each of its kept tokens (plain decode)
        ref_state = new_state(cfg, top_k, torch.float32)
        for s in range(top_k):
            p1_logits = model(prompt, torch.tensor([0]), torch.tensor([n]), torch.tensor([s]), ref_state)[0]
        p1 = vocab_target(p1_logits)
        firsts = np.flatnonzero(p1)
        p2 = {int(t): vocab_target(model(torch.tensor([[t]]), torch.tensor([n]), torch.tensor([1]), torch.tensor([s]),
                                         ref_state)[0]) for s, t in enumerate(firsts)}
        marginal = sum(p1[t] * p2[t] for t in p2)

        one = new_state(cfg, 1, torch.float32)
        mtp_prefill(model, prompt[:, :-1], torch.tensor([0]), torch.tensor([n - 1]), torch.tensor([0]), one,
                    prompt[:, -1], 2)

        def run() -> torch.Tensor:  # -> [R, 5]: t1, chosen at the 3 positions, accepted
            st = {k: v.expand(R, *v.shape[1:]).clone() for k, v in one.items()}  # the prefill in every slot
            last = torch.cat([prompt[:, -1:], torch.zeros(1, 2, dtype=torch.long)], 1).expand(R, 3)
            _, c, _, d = verify(model, last, i64(n - 1), i64(1), torch.arange(R), st, sampling=samp(0))
            t1 = c[:, 0]
            likely = torch.tensor([int(np.argmax(p2[int(t)])) for t in t1])
            toks = torch.stack([t1, likely, d[:, 1]], 1)
            _, chosen, accepted, _ = verify(model, toks, i64(n), i64(3), torch.arange(R), st, sampling=samp(R))
            return torch.cat([t1[:, None], chosen, accepted[:, None]], 1)

        out = run()
    t1, t2, accepted = out[:, 0].numpy(), out[:, 1].numpy(), out[:, -1].numpy()
    assert chi2_ok(np.bincount(t1, minlength=cfg.vocab_size), p1)[0]
    ok, stat, crit = chi2_ok(np.bincount(t2, minlength=cfg.vocab_size), marginal)
    assert ok, f"second token: chi2 {stat:.1f} >= {crit:.1f}"
    assert 0.1 < (accepted > 0).mean() < 0.9  # both the acceptance and the rejection path ran
