"""export/functionalize.py: the state writes made functional without a retrace, checked against
eager on the same inputs (ExportedProgram.module() applies the input mutations back)."""

from __future__ import annotations

import pytest
import torch

from dsv4.export.functionalize import functionalize_state_writes


class _Step(torch.nn.Module):
    def forward(self, x: torch.Tensor, slot: torch.Tensor, cache: torch.Tensor, other: torch.Tensor):
        before = cache.sum()  # read before the write: the old value
        cache.index_put_((slot,), x * 2)
        after = cache.sum(-1)  # read after the write: the new value
        cache.index_put_((slot + 1,), x + 1)  # a second write chains on the first
        other.index_put_((slot,), x.sum(-1, keepdim=True).expand(-1, other.shape[1]))
        return before + after.sum() + cache.mean(), other[0]


class _ViewAcrossWrite(torch.nn.Module):
    def forward(self, x: torch.Tensor, slot: torch.Tensor, cache: torch.Tensor):
        row = cache[0][1:]  # a view (of a view) taken before the write ...
        cache.index_put_((slot,), x)
        return row * 1  # ... read after it (eager sees the write)


def _export(mod: torch.nn.Module, args: tuple) -> torch.export.ExportedProgram:
    return torch.export.export(mod, args, strict=False)  # training IR: writes still in place


def test_writes_become_input_mutations_and_match_eager() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 5, generator=g, dtype=torch.float64)
    slot = torch.tensor([1])
    cache, other = torch.randn(4, 5, generator=g, dtype=torch.float64), torch.zeros(3, 2, dtype=torch.float64)
    ep = _export(_Step(), (x, slot, cache.clone(), other.clone()))
    assert any(n.target is torch.ops.aten.index_put_.default for n in ep.graph.nodes)
    functionalize_state_writes(ep)
    assert not any(n.target is torch.ops.aten.index_put_.default for n in ep.graph.nodes)
    muts = ep.graph_signature.user_inputs_to_mutate
    assert sorted(muts.values()) == ["cache", "other"]
    for s in (1, 2):
        c1, o1, c2, o2 = cache.clone(), other.clone(), cache.clone(), other.clone()
        want = _Step()(x, torch.tensor([s]), c1, o1)
        got = ep.module()(x, torch.tensor([s]), c2, o2)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(c2, c1, rtol=0, atol=0)
        torch.testing.assert_close(o2, o1, rtol=0, atol=0)


def test_view_read_across_a_write_is_refused() -> None:
    ep = _export(_ViewAcrossWrite(), (torch.ones(1, 3), torch.tensor([0]), torch.zeros(2, 3)))
    with pytest.raises(NotImplementedError, match="read after a write"):
        functionalize_state_writes(ep)


class _FlatRowWrites(torch.nn.Module):
    """model._set_rows' form: rows of a [slots, groups, rows, features] state written through a 2-D view."""

    def forward(self, x: torch.Tensor, rows: torch.Tensor, state: torch.Tensor):
        n = state.shape[0] * state.shape[1] * state.shape[2]
        state.view(n, -1).index_put_((rows,), x)
        mid = state.sum((1, 2, 3))  # read between two writes: the first one's value
        state.view(n, -1).index_put_((rows + 1,), x * 3)
        return mid, state.flatten(0, 2)[rows]


def test_writes_through_a_flat_view_become_input_mutations() -> None:
    g = torch.Generator().manual_seed(1)
    state = torch.randn(3, 2, 4, 5, generator=g, dtype=torch.float64)
    x = torch.randn(2, 5, generator=g, dtype=torch.float64)
    ep = _export(_FlatRowWrites(), (x, torch.tensor([0, 9]), state.clone()))
    functionalize_state_writes(ep)
    assert not any(n.target is torch.ops.aten.index_put_.default for n in ep.graph.nodes)
    assert list(ep.graph_signature.user_inputs_to_mutate.values()) == ["state"]
    for rows in ([0, 9], [5, 22]):
        s1, s2 = state.clone(), state.clone()
        want = _FlatRowWrites()(x, torch.tensor(rows), s1)
        got = ep.module()(x, torch.tensor(rows), s2)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(s2, s1, rtol=0, atol=0)
        assert not torch.equal(s1, state)  # the writes happened
