"""Top-k index selection, the one place every top-k of the model goes through.

IREE 3.13 can return correct top-k values with wrong indices when a top-k follows other work on
a dynamic token dim (iree-notes §6, bug 6), so export swaps this for an exact formulation: k
rounds of argmax (each a max + min-index reduction), each masking the previous winner. The eager reference stays torch.topk.

Select with `topk_impl("argmax")` (a context manager; the exporter wraps tracing in it) or
`set_topk_impl`. The choice is read when the function runs, i.e. while torch.export traces.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["topk_indices", "topk_reference", "topk_argmax", "first_argmax", "topk_impl", "set_topk_impl", "TOPK_IMPLS",
           "record_topk"]


def topk_reference(x: torch.Tensor, k: int) -> torch.Tensor:
    """torch.topk: what eager runs and what every other implementation is checked against."""
    return x.topk(k, dim=-1).indices


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1, keepdim=True) (first maximal index) as a max and a min reduction.

    Why: IREE 3.13's gfx942 backend fails on aten.argmax over a 512-wide row ("'func.func' op
    failed to distribute", measured on the tiny model's vocab argmax); two plain reductions lower
    everywhere. The index minimum runs in float32 because the CUDA backend (sm_89) fails the
    same way on an int64 min reduction. Rows without a maximum (all NaN) give the last index."""
    n = x.shape[-1]
    cols = torch.arange(n, device=x.device, dtype=torch.float32)  # exact below 2^24 (vocab 129280)
    hit = x == x.amax(-1, keepdim=True)
    return torch.where(hit, cols, float(n)).amin(-1, keepdim=True).clamp(max=n - 1).long()


def topk_argmax(x: torch.Tensor, k: int) -> torch.Tensor:
    """k rounds of argmax (descending, like torch.topk), exact in IREE where topk/sort are not.

    Picked entries are set to -inf; entries that were -inf to begin with (masked, e.g. invisible
    indexer rows) are first lifted to the dtype's lowest finite value, so a picked entry can never
    be picked again even when a row has fewer than k finite entries. Written with masked_fill on an
    arange comparison: the same with scatter segfaults iree-compile (iree-notes §6, bug 6).
    """
    lowest = torch.finfo(x.dtype).min
    work = x.masked_fill(x == float("-inf"), lowest)
    cols = torch.arange(x.shape[-1], device=x.device)
    picks = []
    for _ in range(k):
        j = first_argmax(work)
        picks.append(j)
        work = work.masked_fill(cols == j, float("-inf"))
    return torch.cat(picks, -1)


TOPK_IMPLS = {"reference": topk_reference, "argmax": topk_argmax}
_impl = "reference"


def set_topk_impl(name: str) -> None:
    """Choose the implementation process-wide ('reference' or 'argmax')."""
    global _impl
    if name not in TOPK_IMPLS:
        raise ValueError(f"unknown top-k implementation {name!r}; choose from {sorted(TOPK_IMPLS)}")
    _impl = name


@contextlib.contextmanager
def topk_impl(name: str) -> Iterator[None]:
    """Temporarily select a top-k implementation (wrap torch.export tracing in it)."""
    saved = _impl
    set_topk_impl(name)
    try:
        yield
    finally:
        set_topk_impl(saved)


_recording: list | None = None


@contextlib.contextmanager
def record_topk() -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Collect (scores, indices) of every top-k run inside the block, in call order.

    Lets a test (or an exported probe function) compare the indices selected inside a whole
    multi-layer graph, where an index miscompile would otherwise be invisible."""
    global _recording
    saved, _recording = _recording, []
    try:
        yield _recording
    finally:
        _recording = saved


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim (int64), largest first."""
    out = TOPK_IMPLS[_impl](x, k)
    if _recording is not None:
        _recording.append((x, out))
    return out
