"""Batch invariance (issue 13 item 1): a request's tokens and logits are bitwise the same whether
it runs alone or with other requests, whatever else is running.

Checked on llvm-cpu exports with decode batch sizes 1 and 4 (and prefill bs1): the tiny preset in fp32
(random weights; conftest's tiny_fp32_export, shared with the export and Engine tests; its 32-token
chunk splits the 40-token prompt) and the embedded default (model/assets/small) in bf16 (conftest's
embedded_bf16_export, which tests/test_serve.py serves).

* Through the Engine (its default batch_invariant mode): each of four prompts (lengths 21, 30, 17
  and 40, so chunked prefill too) run alone, all four submitted together, and one joining three
  that are already decoding; every generated token and its logprobs (the token's and the top 20,
  computed from all logits) must be bit-identical to the alone run, and the batched run must
  really have shared decode calls.
* The decode functions the Engine batches with: decode_bs1 and decode_bs4 give bit-identical logits
  for the same row from the same state, with padding rows or with other requests beside it.
* The compiled bs1 prefill is held to the eager model (an independent reference), so "all equal"
  cannot mean "all equally wrong".

Why the Engine prefills one request per call (prefill_bs1 and prefill_bs4 compile into code that
rounds differently): docs/numerics.md, with the cost.

The exports take minutes on 2 cores; they are cached under .cache/ keyed by the sources, the
export arguments and the compiler version.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# every test runs on an export (its fixture is picked by name at run time, which the slow rule cannot see)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
BATCH_SIZES = (1, 4)
N_DECODE = 6
# model -> (its shared export fixture, max_chunk). The embedded default is what issue 13 asks for (its
# export: 6.6 min on 2 cores the first time, cached after; the tests themselves take ~10 s for both models).
MODELS = {"tiny": ("tiny_fp32_export", 32), "embedded": ("embedded_bf16_export", 256)}


def _model(name: str):
    """The model the export was made from."""
    from conftest import embedded_bf16_model, tiny_fp32_model

    return tiny_fp32_model() if name == "tiny" else embedded_bf16_model()


@pytest.fixture(scope="module", params=list(MODELS))
def batchinv_export(request):
    """(model name, export dir): the shared exports of tests/conftest.py, built once per source state."""
    from conftest import EMBEDDED_BF16_ARGS, TINY_FP32_ARGS

    name = request.param
    fixture, chunk = MODELS[name]
    args = {"tiny": TINY_FP32_ARGS, "embedded": EMBEDDED_BF16_ARGS}[name]
    # the tests call prefill_bs1 (the Engine's batch-invariant prefill) and decode_bs1 / decode_bs4
    assert (1 in args["batch_sizes"], tuple(args["decode_batch_sizes"]), args["n_slots"], args["max_chunk"]) == \
        (True, BATCH_SIZES, 4, chunk)
    return name, request.getfixturevalue(fixture)


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, vocab, n)] for n in (21, 30, 17, 40)]


class _Runner:
    """Calls one export's functions directly on fresh state (the Engine's call path, without its
    scheduler, so the test decides which function serves which call)."""

    def __init__(self, export_dir: Path):
        from dsv4.runtime.engine import Engine

        self.e = Engine(export_dir)
        self.cfg = self.e.config

    def prefill_alone(self, prompts: list[list[int]]) -> tuple[np.ndarray, list[int]]:
        """Each prompt k into slot k through prefill_bs1 in chunks of the export's max tokens (as the
        Engine's batch-invariant mode does); row 0's last logits and every row's argmax."""
        e, cfg = self.e, self.cfg
        e.state = [e.module.zeros(s) for s in cfg.state]
        step, toks, first = cfg.prefill_max_tokens, [], None
        for k, p in enumerate(prompts):
            for s in range(0, len(p), step):
                piece = p[s:s + step]
                T = max(len(piece), cfg.prefill_min_tokens)
                lg, am = e._call_rows("prefill_bs1", 1, np.array([k]), [piece], [s], T)
            if k == 0:
                first = np.array(lg.to_host()[0], copy=True)  # copy: the host view's buffer gets reused
            toks.append(int(np.asarray(am.to_host()).reshape(-1)[0]))
        return first, toks

    def decode(self, prompts: list[list[int]], dec_bs: int) -> list[np.ndarray]:
        """prefill_alone, then N_DECODE greedy steps of rows 0..len(prompts)-1 through decode_bs{dec_bs}
        (rows past the prompts: padding); row 0's logits of every step."""
        _, toks = self.prefill_alone(prompts)
        pos = [len(p) for p in prompts]
        out = []
        for _ in range(N_DECODE):
            lg, am = self.e._call_rows(f"decode_bs{dec_bs}", dec_bs, np.arange(dec_bs), [[t] for t in toks], pos, 1)
            out.append(np.array(lg.to_host()[0], copy=True))
            toks = [int(t) for t in np.asarray(am.to_host()).reshape(-1)[:len(prompts)]]
            pos = [p + 1 for p in pos]
        return out


def _eager_prefill_logits(name: str, prompt: list[int]) -> np.ndarray:
    from dsv4.model.state import new_state

    model = _model(name)
    with torch.no_grad():
        st = new_state(model.cfg, 1, model.dtype)
        lg = model(torch.tensor([prompt]), torch.tensor([0]), torch.tensor([len(prompt)]), torch.tensor([0]), st)
    return lg[0].double().numpy()


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


def test_compiled_prefill_matches_eager(batchinv_export) -> None:
    name, d = batchinv_export
    r = _Runner(d)
    prompt = _prompts(r.cfg.vocab_size)[0]
    got, _ = r.prefill_alone([prompt])
    eager = _eager_prefill_logits(name, prompt)
    if name == "tiny":  # fp32: the compiled-vs-eager bound of tests/test_export_model.py
        np.testing.assert_allclose(got, eager, atol=2e-4, rtol=2e-4)
        return
    # bf16 activations: the compiler keeps some intermediates in fp32 where eager rounds (measured
    # 2.6 % of the largest logit on the embedded default), so the bound is relative, 5 %
    drift = np.abs(got - eager).max() / np.abs(eager).max()
    assert drift < 0.05, f"compiled bs1 prefill drifted from eager by {drift:.3g} of the largest logit"


def test_decode_functions_agree_bitwise(batchinv_export) -> None:
    """The Engine batches decode across requests: decode_bs1 and decode_bs4 must agree bit for bit."""
    name, d = batchinv_export
    r = _Runner(d)
    prompts = _prompts(r.cfg.vocab_size)
    ref = r.decode(prompts[:1], 1)
    for others in ([], prompts[1:]):
        got = r.decode(prompts[:1] + others, 4)
        for step, (a, b) in enumerate(zip(ref, got)):
            assert np.array_equal(_bits(a), _bits(b)), (
                f"{name}: decode_bs4 with {len(others)} other request(s): logits of step {step} differ from "
                f"decode_bs1 by up to {np.abs(a - b).max():.3g}")


def _collect(eng, plan: list[tuple[int, list[int]]], params) -> dict[int, list]:
    """Run the engine until idle; plan = [(steps to run before submitting, prompt)]. Returns
    {index in plan: [(token, logprob, top_logprobs) of every generated token]}."""
    out: dict[int, list] = {}
    ids: dict[int, int] = {}

    def step() -> None:
        for ch in eng.step():
            out.setdefault(ch.request_id, []).append((ch.token, ch.logprob, ch.top_logprobs))

    for k, (wait, prompt) in enumerate(plan):
        for _ in range(wait):
            step()
        ids[eng.submit(prompt, params, add_bos=False)] = k
    while eng.has_work:
        step()
    for rid in ids:
        eng.result(rid)
    return {ids[rid]: chunks for rid, chunks in out.items()}


def test_engine_request_same_bits_alone_and_batched(batchinv_export) -> None:
    from dsv4.runtime.engine import Engine
    from dsv4.runtime.sampling import SamplingParams

    name, d = batchinv_export
    eng = Engine(d)
    assert eng.batch_invariant, "batch invariance must be the Engine's default"
    prompts = _prompts(eng.config.vocab_size)
    # greedy; every token's logprob and the 20 largest (log-softmax: each depends on every logit
    # through the normalizer, so a last-bit change anywhere shows)
    params = SamplingParams(max_new_tokens=N_DECODE + 1, ignore_eos=True, logprobs=20)
    alone = [_collect(eng, [(0, p)], params)[0] for p in prompts]
    before = dict(eng.stats)
    together = _collect(eng, [(0, p) for p in prompts], params)
    calls = eng.stats["decode_calls"] - before["decode_calls"]
    rows = eng.stats["decode_rows"] - before["decode_rows"]
    assert rows > calls, "the four requests never shared a decode call: the test did not batch"
    late = _collect(eng, [(0, prompts[1]), (0, prompts[2]), (0, prompts[3]), (2, prompts[0])], params)
    for label, runs in (("submitted together", together), ("joining three running requests", {0: late[3]})):
        for k, chunks in runs.items():
            assert len(chunks) == len(alone[k]) == N_DECODE + 1
            for step, (a, b) in enumerate(zip(alone[k], chunks)):
                assert a == b, (f"{name}: request {k} {label}: generated token {step} differs from the request "
                                f"alone (token {a[0]} vs {b[0]}, logprob {a[1]!r} vs {b[1]!r})")
