"""The decode state: what a sequence carries from one call to the next (docs/model.md, Decode state), as a few flat tensors.

Every tensor has the sequence *slot* as dim 0 and the layer (within its kind) as dim 1, so export
passes the whole state as a handful of device arguments that calls update in place with
`index_put_` of whole rows (model._set_rows; docs/export.md, IREE 3.13 traps), and a runtime
can run any sequence in any slot.

| name             | shape                                   | dtype  | holds                                            |
|------------------|-----------------------------------------|--------|--------------------------------------------------|
| win_kv           | [slots, L + mtp, window, head_dim]       | model  | sliding-window KV ring, position p at slot p % W |
| kv_r{m}          | [slots, n_m, max_seq/m + 1, head_dim]    | model  | compressed KV rows (entry j at row j)           |
| cmp_r{m}         | [slots, n_m, ring_m, 2, c*head_dim]      | fp32   | compressor inputs of the last ring_m tokens: K [..., 0, :], gate logits Z + ape [..., 1, :] |
| idx_kv_r4        | [slots, n_4, max_seq/4 + 1, index_dim]   | model  | lightning-indexer keys (CSA layers only)         |
| idx_cmp_r4       | [slots, n_4, 8, 2, 2*index_dim]          | fp32   | the indexer compressor's K and Z + ape ring      |

m ranges over the distinct compression ratios; ratio 4 compresses overlapping windows (c = 2,
ring of 2m tokens), every other ratio plain windows (c = 1, ring of m tokens). The last row of
each compressed cache is a scratch row that absorbs writes of entries a call did not complete.

A fresh sequence needs no reset: every read is masked by position (positions < 0 or not yet
written are never attended), so whatever a slot held before cannot leak into the next request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig

__all__ = ["StateLayout", "new_state", "state_spec"]


@dataclass(frozen=True)
class LayerState:
    """Where one attention layer's state lives."""

    ratio: int  # 0 = sliding window only
    group: int  # index along dim 1 of the kv_r{ratio} tensors
    window: int  # index along dim 1 of win_kv


class StateLayout:
    """Maps layers to state tensors and names the tensors; pure function of the config."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.layers: list[LayerState] = []
        counts: dict[int, int] = {}
        for i, r in enumerate(cfg.compress_ratios):
            self.layers.append(LayerState(ratio=r, group=counts.get(r, 0), window=i))
            counts[r] = counts.get(r, 0) + 1
        self.ratio_counts = {r: n for r, n in sorted(counts.items()) if r > 0}

    @staticmethod
    def ring(ratio: int) -> int:
        return 2 * ratio if ratio == 4 else ratio

    @staticmethod
    def coff(ratio: int) -> int:
        return 2 if ratio == 4 else 1

    def spec(self, n_slots: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Ordered {name: (shape, dtype)} of every state tensor."""
        c = self.cfg
        D, di = c.head_dim, c.index_head_dim
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            "win_kv": ((n_slots, len(c.compress_ratios), c.sliding_window, D), dtype)
        }
        for r, n in self.ratio_counts.items():
            rows = c.max_seq_len // r + 1
            ring, feat = self.ring(r), self.coff(r) * D
            out[f"kv_r{r}"] = ((n_slots, n, rows, D), dtype)
            out[f"cmp_r{r}"] = ((n_slots, n, ring, 2, feat), torch.float32)
            if r == 4:
                out["idx_kv_r4"] = ((n_slots, n, rows, di), dtype)
                out["idx_cmp_r4"] = ((n_slots, n, ring, 2, 2 * di), torch.float32)
        return out

    def stage(self, first: int, last: int) -> tuple[list[LayerState], dict[str, tuple[int, int]]]:
        """Layers [first, last) on their own (one stage of a pipeline export): their LayerStates
        renumbered into the stage's own state tensors, and {tensor name: (lo, hi)}, the rows of
        dim 1 of the whole model's tensor that the stage's tensor holds. A layer's groups are
        numbered in layer order, so every range is contiguous."""
        if not 0 <= first < last <= len(self.layers):
            raise ValueError(f"stage layers [{first}, {last}) outside [0, {len(self.layers)})")
        mine = self.layers[first:last]
        ranges = {"win_kv": (first, last)}
        for r in sorted({st.ratio for st in mine if st.ratio}):
            gs = [st.group for st in mine if st.ratio == r]
            names = [f"kv_r{r}", f"cmp_r{r}"]
            names += ["idx_kv_r4", "idx_cmp_r4"] if r == 4 else []
            ranges.update({n: (gs[0], gs[-1] + 1) for n in names})
        lo = {r: ranges[f"kv_r{r}"][0] for r in self.ratio_counts if f"kv_r{r}" in ranges}
        states = [LayerState(st.ratio, st.group - lo.get(st.ratio, 0), st.window - first) for st in mine]
        return states, ranges

    def stage_spec(self, n_slots: int, dtype: torch.dtype, first: int, last: int
                   ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """`spec` of the stage holding layers [first, last): the tensors its layers use, cut along dim 1."""
        _, ranges = self.stage(first, last)
        out = {}
        for name, (shape, dt) in self.spec(n_slots, dtype).items():
            if name in ranges:
                lo, hi = ranges[name]
                out[name] = ((shape[0], hi - lo, *shape[2:]), dt)
        return out


def state_spec(cfg: ModelConfig, n_slots: int, dtype: torch.dtype = torch.bfloat16):
    return StateLayout(cfg).spec(n_slots, dtype)


def new_state(cfg: ModelConfig, n_slots: int, dtype: torch.dtype = torch.bfloat16,
              device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Zero-filled state for `n_slots` sequences."""
    return {name: torch.zeros(shape, dtype=dt, device=device)
            for name, (shape, dt) in state_spec(cfg, n_slots, dtype).items()}
