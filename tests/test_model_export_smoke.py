"""torch.export accepts the model's prefill (dynamic T) and decode (T = 1) call shapes, and the
exported prefill computes what eager computes (so the graph, not only the trace, is right)."""

import pytest
import torch

from dsv4.export.functionalize import _VIEW_OPS, _op
from dsv4.model.config import ModelConfig
from dsv4.model.model import Transformer, init_random
from dsv4.model.state import new_state


class Entry(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, start_pos, lengths, slots, state):
        return self.model(tokens, start_pos, lengths, slots, state)


def _strided_state_gathers(ep: torch.export.ExportedProgram) -> list[str]:
    """Gathers (aten.index) whose source is a select or slice of a state input: IREE 3.13's GPU
    codegen compiles such a gather with the view's strides (model._get; the reproduction:
    `git show a7b70ea:bench/slot_gather.py`)."""
    states = {n for n in ep.graph.nodes if n.op == "placeholder" and "state" in n.name}
    bad = []
    for n in ep.graph.nodes:
        if n.op != "call_function" or _op(n) != "index":
            continue
        src, path = n.args[0], []
        while src.op == "call_function" and _op(src) in _VIEW_OPS:
            path.append(_op(src))
            src = src.args[0]
        if src in states and {"select", "slice", "narrow"} & set(path):
            bad.append(f"{n.name} <- {' <- '.join(path)} <- {src.name}")
    return bad


@pytest.mark.slow  # traces the tiny model with torch.export (minutes)
def test_torch_export_prefill_and_decode():
    cfg = ModelConfig.preset("tiny")
    model = init_random(Transformer(cfg, dtype=torch.float32), seed=0).eval()
    st = new_state(cfg, 2, torch.float32)
    # T >= the largest compression ratio keeps torch.export from specializing small sizes
    T = torch.export.Dim("T", min=max(cfg.compress_ratios), max=cfg.max_seq_len)
    args = (torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, dtype=torch.long), torch.full((2,), 16),
            torch.arange(2), st)
    with torch.no_grad():
        ep = torch.export.export(Entry(model), args, strict=False,
                                 dynamic_shapes={"tokens": {1: T}, "start_pos": None, "lengths": None, "slots": None,
                                                 "state": {k: None for k in st}})
        dec = torch.export.export(Entry(model), (torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                                                 torch.ones(2, dtype=torch.long), torch.arange(2), st), strict=False)
        bad = _strided_state_gathers(ep) + _strided_state_gathers(dec)
        assert not bad, bad
        toks = torch.randint(0, cfg.vocab_size, (2, 37), generator=torch.Generator().manual_seed(0))
        a = (toks, torch.tensor([0, 0]), torch.tensor([37, 30]), torch.tensor([1, 0]))
        s1, s2 = new_state(cfg, 2, torch.float32), new_state(cfg, 2, torch.float32)
        got = ep.module()(*a, s1)
        want = model(*a, s2)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert all(torch.equal(s1[k], s2[k]) for k in s1), "exported prefill must update the state like eager"
        nxt = torch.tensor([[5], [6]])
        torch.testing.assert_close(dec.module()(nxt, torch.tensor([37, 30]), torch.ones(2, dtype=torch.long),
                                                torch.tensor([1, 0]), s1),
                                   model(nxt, torch.tensor([37, 30]), torch.ones(2, dtype=torch.long),
                                         torch.tensor([1, 0]), s2), atol=1e-5, rtol=1e-5)
