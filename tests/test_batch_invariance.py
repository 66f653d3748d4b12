"""Batch invariance (issue 13 item 1): a request's logits are bitwise the same whichever exported
batch-size function runs it and whatever else shares the call.

Checked on llvm-cpu bf16 exports with prefill and decode batch sizes 1 and 4: the tiny preset
(random weights, fast) and, when MODELS names it, the embedded default (model/assets/small). For
every exported prefill batch size B the same prompt is prefilled in row 0 (other rows: padding,
i.e. length 0, or other prompts of other lengths, so T differs too), then decoded greedily through
every decode batch size; all logits must be bit-identical to the bs1 run. The bs1 run itself is
held to the eager model (an independent reference), so "all equal" cannot mean "all equally wrong".

Why it once failed (docs/batch-invariance.md): see there for the root cause and the cost.

The exports take minutes on 2 cores; they are cached under .cache/ keyed by the sources, the
export arguments and the compiler version.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BATCH_SIZES = (1, 4)
N_DECODE = 6
EXPORT_ARGS = dict(targets=["llvm-cpu"], batch_sizes=BATCH_SIZES, decode_batch_sizes=BATCH_SIZES, n_slots=4,
                   score=False)
# model -> max_chunk. The suite runs the tiny preset; the embedded default (an export of ~5 min on
# 2 cores) is measured in docs/batch-invariance.md: add "embedded": 64 here to test it too.
MODELS = {"tiny": 32}


def _model(name: str):
    from dsv4.model.checkpoint import EMBEDDED_CHECKPOINT, load_checkpoint
    from dsv4.model.config import ModelConfig
    from dsv4.model.model import Transformer, init_random

    if name == "tiny":
        cfg = ModelConfig.preset("tiny")
        return init_random(Transformer(cfg, dtype=torch.bfloat16), seed=0).eval()
    return load_checkpoint(EMBEDDED_CHECKPOINT, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module", params=list(MODELS))
def batchinv_export(request):
    """(model name, export dir); built once per source state and cached by tests/conftest.py."""
    from conftest import cached_export

    from dsv4.export.exporter import export_model

    name = request.param

    def build(out: Path) -> None:
        model = _model(name)
        export_model(model, model.cfg, out, max_chunk=MODELS[name], **EXPORT_ARGS)

    weights = sorted((REPO / "model" / "assets" / "small").glob("*.safetensors")) if name == "embedded" else []
    return name, cached_export(f"batchinv-{name}", build, [name, MODELS[name], sorted(EXPORT_ARGS.items()), *weights])


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, vocab, n)] for n in (21, 30, 17, 40)]


class _Runner:
    """Calls one export's functions directly on fresh state (the Engine's call path, without its
    scheduler, so the test decides which function serves the request)."""

    def __init__(self, export_dir: Path):
        from dsv4.runtime.engine import Engine

        self.e = Engine(export_dir)
        self.cfg = self.e.config

    def run(self, bs: int, prompts: list[list[int]], dec_bs: int) -> list[np.ndarray]:
        """prefill `prompts` (row 0 = the request) through prefill_bs{bs}, then N_DECODE greedy
        steps of row 0 (and the others) through decode_bs{dec_bs}; row 0's logits of every call."""
        e, cfg = self.e, self.cfg
        e._state = [e._zeros(s) for s in cfg.state]
        prompts = prompts[:min(bs, dec_bs)]
        T = max(max(len(p) for p in prompts), cfg.prefill_min_tokens)
        lg, am = e._call_rows(f"prefill_bs{bs}", bs, np.arange(bs), prompts, [0] * len(prompts), T)
        out = [np.array(lg.to_host()[0], copy=True)]  # copy: the host view's buffer gets reused
        toks = [int(t) for t in np.asarray(am.to_host()).reshape(-1)[:len(prompts)]]
        pos = [len(p) for p in prompts]
        for _ in range(N_DECODE):
            lg, am = e._call_rows(f"decode_bs{dec_bs}", dec_bs, np.arange(dec_bs), [[t] for t in toks], pos, 1)
            out.append(np.array(lg.to_host()[0], copy=True))
            toks = [int(t) for t in np.asarray(am.to_host()).reshape(-1)[:len(prompts)]]
            pos = [p + 1 for p in pos]
        return out


def _eager_prefill_logits(name: str, prompt: list[int]) -> np.ndarray:
    from dsv4.model.kernels.topk import topk_impl
    from dsv4.model.state import new_state

    model = _model(name)
    with torch.no_grad(), topk_impl("argmax"):
        st = new_state(model.cfg, 1, torch.bfloat16)
        lg = model(torch.tensor([prompt]), torch.tensor([0]), torch.tensor([len(prompt)]), torch.tensor([0]), st)
    return lg[0].double().numpy()


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.mark.xfail(strict=True, reason="issue 13 item 1 still open: prefill_bs1 and prefill_bs4 differ "
                   "(tiny up to 4e-3, embedded up to 5e-2 after the sparse-attention fix); docs/batch-invariance.md")
def test_same_request_same_bits_in_every_batch_size(batchinv_export) -> None:
    name, d = batchinv_export
    r = _Runner(d)
    prompts = _prompts(r.cfg.vocab_size)
    ref = r.run(1, prompts[:1], 1)
    # the bs1 path is the eager model's computation (bf16 rounding differences only)
    eager = _eager_prefill_logits(name, prompts[0])
    # bf16 activations: the compiler keeps some intermediates in fp32 where eager rounds (measured
    # 2.6 % of the largest logit on the embedded default), so the bound is relative, 5 %
    drift = np.abs(ref[0] - eager).max() / np.abs(eager).max()
    assert drift < 0.05, f"compiled bs1 prefill drifted from eager by {drift:.3g} of the largest logit"
    for bs in BATCH_SIZES:
        for dec_bs in BATCH_SIZES:
            for others in ([], prompts[1:]):
                got = r.run(bs, prompts[:1] + others, dec_bs)
                for step, (a, b) in enumerate(zip(ref, got)):
                    assert np.array_equal(_bits(a), _bits(b)), (
                        f"{name}: prefill_bs{bs}/decode_bs{dec_bs} with {len(others)} other request(s): "
                        f"logits of call {step} differ from bs1 by up to {np.abs(a - b).max():.3g}")
