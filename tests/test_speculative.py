"""Speculative decoding with the MTP block (model/speculative.py), eager: a verify call leaves no trace
of its rejected drafts in any state tensor, scores its 1 + K positions as K + 1 plain decode steps
do, and greedy speculative decoding returns plain greedy's tokens, for rows accepting different
counts in one call. The reference everywhere is the plain forward (Transformer.forward, model/generate.greedy)."""

from __future__ import annotations

import pytest
import torch

from dsv4.model.config import ModelConfig
from dsv4.model.generate import greedy, speculative_greedy
from dsv4.model.model import Transformer, init_random
from dsv4.model.speculative import choose, draft, mtp_prefill, verify
from dsv4.model.state import new_state

K = 3
# prompt lengths: the verified positions P .. P+3 complete CSA entries (ratio 4) and, from 47, an HCA
# entry (ratio 16), and wrap the 8-row window ring
PROMPTS = (13, 30, 47)
SCRATCH = ("kv_r", "idx_kv_r4")  # compressed caches: their last row is the scratch row (model/state.py)


def _i64(*v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.long)


def _copy(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


@pytest.fixture(scope="module", params=[False, True], ids=["fp32", "quant_sim"])
def tiny(request):
    """(model, state after PROMPTS were prefilled into slots 0..2, the token chosen after each prompt)."""
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny").replace(quant_sim=request.param)
    model = init_random(Transformer(cfg, dtype=torch.float32), seed=0).eval()
    g = torch.Generator().manual_seed(1)
    state = new_state(cfg, len(PROMPTS), torch.float32)
    first = []
    with torch.no_grad():
        for r, n in enumerate(PROMPTS):
            logits = model(torch.randint(0, cfg.vocab_size, (1, n), generator=g), _i64(0), _i64(n), _i64(r), state)
            first.append(int(logits[0].argmax()))
    return model, state, first


def _greedy_path(model, state, first, steps):
    """Plain decode, one token per call from each row's first token: (tokens [R, steps+1] fed and
    chosen, logits [R, steps, V] of each call)."""
    st = _copy(state)
    toks, logits = [list(first)], []
    with torch.no_grad():
        for _ in range(steps):
            lg = torch.stack([model(torch.tensor([[toks[-1][r]]]), _i64(PROMPTS[r] + len(toks) - 1), _i64(1), _i64(r),
                                    st)[0] for r in range(len(PROMPTS))])
            logits.append(lg)
            toks.append(lg.argmax(-1).tolist())
    return torch.tensor(toks).T, torch.stack(logits, 1)


def _drafts(path, want, bad=1):
    """Verify tokens [R, 1+K]: the greedy path with row r's draft want[r] (if < K) replaced, so
    exactly want[r] drafts are accepted."""
    toks = path[:, :K + 1].clone()
    for r, n in enumerate(want):
        if n < K:
            toks[r, n + 1:] = (toks[r, n + 1:] + bad) % 512
    return toks


def _verify(model, state, toks, lengths=None):
    st = _copy(state)
    lengths = _i64(*[K + 1] * len(PROMPTS)) if lengths is None else lengths
    with torch.no_grad():
        out = verify(model, toks, _i64(*PROMPTS), lengths, _i64(0, 1, 2), st)
    return st, out


@pytest.mark.parametrize("want", [(0, 1, 2), (3, 0, 1)])
def test_rejected_drafts_leave_no_trace(tiny, want):
    model, state, first = tiny
    path, _ = _greedy_path(model, state, first, K)
    s1, (_, _, acc1, d1) = _verify(model, state, _drafts(path, want, bad=1))
    s2, (_, _, acc2, d2) = _verify(model, state, _drafts(path, want, bad=5))
    assert acc1.tolist() == list(want) and acc2.tolist() == list(want)
    # other rejected drafts, the same state, bit for bit (scratch rows included), and the same next drafts
    for name in state:
        assert torch.equal(s1[name], s2[name]), name
    assert torch.equal(d1, d2)
    # never having seen them: the plain forward of the same tokens with the kept ones real (the rest
    # padding, which never reaches the state), then the MTP block over the kept positions
    keep = torch.tensor(want) + 1
    ref = _copy(state)
    toks = _drafts(path, want)
    with torch.no_grad():
        h = model.hidden(toks, _i64(*PROMPTS), keep, _i64(0, 1, 2), ref)
        chosen = choose(model.logits(h, keep, True))
        d_ref = draft(model, h, chosen, _i64(*PROMPTS), keep, _i64(0, 1, 2), ref, K)
    assert torch.equal(d1, d_ref)
    for name in state:
        a, b = s1[name], ref[name]
        if name.startswith(SCRATCH):  # the plain call parks its uncompleted entries in the scratch row
            a, b = a[:, :, :-1], b[:, :, :-1]
            assert torch.equal(s1[name][:, :, -1], state[name][:, :, -1]), f"{name}: verify changed a scratch row"
        assert torch.equal(a, b), name
    changed = [n for n in state if not torch.equal(s1[n], state[n])]
    assert "win_kv" in changed and "kv_r4" in changed  # the kept positions were written


def test_verify_scores_like_successive_decode_steps(tiny):
    model, state, first = tiny
    path, logits = _greedy_path(model, state, first, K + 1)
    st, (lg, chosen, acc, _) = _verify(model, state, path[:, :K + 1])
    assert acc.tolist() == [K] * len(PROMPTS)  # the greedy path itself: every draft accepted
    assert torch.equal(chosen, path[:, 1:K + 2])
    torch.testing.assert_close(lg, logits, rtol=1e-5, atol=1e-5)  # other call shapes: fp32 rounding only
    # the plain forward of the same [R, 1+K] tokens: the same logits bit for bit
    with torch.no_grad():
        plain = model(path[:, :K + 1], _i64(*PROMPTS), _i64(*[K + 1] * 3), _i64(0, 1, 2), _copy(state), all_logits=True)
    assert torch.equal(lg, plain)


def test_padding_row_and_short_rows(tiny):
    """lengths 0 (a padding row) writes nothing; lengths 1 verifies no draft (a plain decode step)."""
    model, state, first = tiny
    path, _ = _greedy_path(model, state, first, K)
    st, (_, _, acc, _) = _verify(model, state, path[:, :K + 1], _i64(0, 1, 2))
    assert acc.tolist() == [0, 0, 1]
    for name in state:
        assert torch.equal(st[name][0], state[name][0]), name  # slot 0: its row was padding


def test_mtp_prefill_chunks_match_one_call(tiny):
    """MTP state and drafts after a prompt prefilled in chunks (next_tokens = the next chunk's first
    token) equal those of one call."""
    model, _, _ = tiny
    cfg = model.cfg
    prompt = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    one, chunks = new_state(cfg, 1, torch.float32), new_state(cfg, 1, torch.float32)
    with torch.no_grad():
        _, c1, d1 = mtp_prefill(model, prompt, _i64(0), _i64(40), _i64(0), one, _i64(-1), K)
        for s, e in ((0, 16), (16, 32), (32, 40)):
            nxt = int(prompt[0, e]) if e < 40 else -1
            _, c2, d2 = mtp_prefill(model, prompt[:, s:e], _i64(s), _i64(e - s), _i64(0), chunks, _i64(nxt), K)
    assert torch.equal(c1, c2)
    assert torch.equal(d1, d2)
    mtp_row = cfg.n_layers
    torch.testing.assert_close(chunks["win_kv"][:, mtp_row], one["win_kv"][:, mtp_row], rtol=1e-5, atol=1e-5)


def test_greedy_speculative_equals_greedy_random_weights():
    """Random weights: the MTP block's drafts are almost never accepted; the tokens are greedy's."""
    cfg = ModelConfig.preset("tiny")
    model = init_random(Transformer(cfg, dtype=torch.float32), seed=0).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 21)]
    got, stats = speculative_greedy(model, prompts, 6, 2, chunk=16)
    assert got == [greedy(model, p, 6, chunk=16) for p in prompts]
    assert stats["verify_calls"] >= 1


def test_greedy_speculative_equals_greedy_embedded():
    """The embedded default (its MTP block trained with it): drafts are accepted, rows accept
    different counts in one call, and the tokens are plain greedy's, alone and batched."""
    from dsv4.model.checkpoint import EMBEDDED_CHECKPOINT, load_checkpoint

    model = load_checkpoint(EMBEDDED_CHECKPOINT, dtype=torch.float32, overrides={"max_seq_len": 128}).eval()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(EMBEDDED_CHECKPOINT / "tokenizer.json"))
    ids = tok.encode((EMBEDDED_CHECKPOINT / "eval.txt").read_text()[:4000]).ids
    prompts = [ids[0:24], ids[300:317]]
    want = [greedy(model, p, 10) for p in prompts]
    got, stats = speculative_greedy(model, prompts, 10, 2)
    assert got == want
    assert stats["accepted"] > 0 and stats["verify_calls"] < 9
    assert any(len(set(call)) > 1 for call in stats["accepted_per_call"])  # rows accepting different counts
    assert speculative_greedy(model, prompts[1:], 10, 2)[0] == want[1:]
