"""Slots and padded batches: which state slot a request owns, and how requests fill exported calls.

Pure logic (no device), tested on its own. Every exported function has a fixed batch size N; a
call with fewer requests is padded with ``lengths == 0`` rows on slots not in the call, which the
module leaves untouched.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

from dsv4.contract.errors import EngineError

__all__ = ["SlotAllocator", "pick_batch_size", "pad_rows", "plan_calls"]

T = TypeVar("T")


class SlotAllocator:
    """Owns the state slots. Hands out the lowest free slot so runs are reproducible."""

    def __init__(self, n_slots: int):
        if n_slots < 1:
            raise ValueError("n_slots must be positive")
        self.n_slots = n_slots
        self._free = set(range(n_slots))

    def allocate(self) -> int:
        if not self._free:
            raise EngineError(f"all {self.n_slots} slots are in use")
        s = min(self._free)
        self._free.remove(s)
        return s

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.n_slots})")
        if slot in self._free:
            raise ValueError(f"slot {slot} is already free")
        self._free.add(slot)

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def free_slots(self) -> list[int]:
        return sorted(self._free)

    @property
    def used_slots(self) -> list[int]:
        return sorted(set(range(self.n_slots)) - self._free)


def pick_batch_size(n: int, sizes: Sequence[int], n_slots: int) -> int:
    """Smallest exported batch size >= n that fits in n_slots (padding rows need distinct slots).

    When n exceeds every usable size, the largest usable one is returned (the caller splits).
    """
    usable = sorted(b for b in sizes if b <= n_slots)
    if not usable:
        raise EngineError(f"no exported batch size fits in {n_slots} slots (sizes {list(sizes)})")
    for b in usable:
        if b >= n:
            return b
    return usable[-1]


def pad_rows(slots: Sequence[int], batch_size: int, n_slots: int) -> list[int]:
    """Slots for a call of ``batch_size`` rows: ``slots`` first, then distinct unused ones as padding.

    Padding rows get lengths 0 and so leave their slot's state alone; any slot not in the call
    works (lowest id first, for reproducibility).
    """
    if len(set(slots)) != len(slots):
        raise EngineError(f"slots within one call must be distinct, got {list(slots)}")
    if len(slots) > batch_size:
        raise EngineError(f"{len(slots)} rows do not fit in batch size {batch_size}")
    taken = set(slots)
    others = [s for s in range(n_slots) if s not in taken]
    need = batch_size - len(slots)
    if need > len(others):
        raise EngineError(f"batch size {batch_size} needs more than the {n_slots} slots")
    return list(slots) + others[:need]


def plan_calls(items: Sequence[T], slots: Sequence[int], sizes: Sequence[int],
               n_slots: int) -> Iterator[tuple[list[T], int, list[int]]]:
    """The calls that serve ``items`` (item k owns ``slots[k]``): (items of the call, exported batch
    size, slot of every row including the padding rows), largest usable batch size first."""
    i = 0
    while i < len(items):
        bs = pick_batch_size(len(items) - i, sizes, n_slots)
        group = list(items[i:i + bs])
        yield group, bs, pad_rows(list(slots[i:i + len(group)]), bs, n_slots)
        i += len(group)
