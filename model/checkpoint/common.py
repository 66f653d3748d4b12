"""What both checkpoint loaders share (the safetensors one, load.py, and the .irpa one, irpa.py),
importable without safetensors: the one error type, and building a model without random init."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence

from torch import nn

__all__ = ["CheckpointError", "no_param_init"]


class CheckpointError(ValueError):
    """Everything wrong with a checkpoint, in one error. `problems` lists each one ("kind: detail")."""

    def __init__(self, where: str | os.PathLike, problems: Sequence[str]):
        self.where = str(where)
        self.problems = list(problems)
        super().__init__(_format_problems(self.where, self.problems))


def _format_problems(where: str, problems: list[str], limit: int = 60) -> str:
    lines = [f"checkpoint {where}: {len(problems)} problem(s)"]
    lines += [f"  {p}" for p in problems[:limit]]
    if len(problems) > limit:
        # the rest as counts per kind and name pattern (digits folded), so the message stays readable
        rest: dict[str, int] = {}
        for p in problems[limit:]:
            key = re.sub(r"\d+", "#", p.split(" (")[0])
            rest[key] = rest.get(key, 0) + 1
        lines.append(f"  ... and {len(problems) - limit} more (all in CheckpointError.problems):")
        lines += [f"    {k}  x{n}" for k, n in sorted(rest.items())]
    return "\n".join(lines)


@contextlib.contextmanager
def no_param_init() -> Iterator[None]:
    """Skip torch's random init while building a model whose every tensor is about to be loaded
    (nn.Embedding / nn.Linear would otherwise fill vocab-sized tables for nothing)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_")
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


