"""DeepSeek-V4 in PyTorch, one forward for every call shape.

`Transformer.forward(tokens [B,T], start_pos [B], lengths [B], slots [B], state)` runs T tokens of
each sequence b at positions start_pos[b] .. start_pos[b] + T - 1, of which the first lengths[b]
are real (the rest is padding and never reaches the state). The same code is prefill from 0,
chunked prefill from any position, and batched one-token decode at different positions; the
decode state (see state.py) is read for the batch's `slots` and written back in place.

Written to be exported: no `.item()`, no Python branching on tensor values, static shapes that
depend only on the config and T, every state write an `index_put_` of whole rows (_set_rows).

Numerics follow the reference (docs/model.md, Reference numerics): bf16 activations, fp32 mHC/norm/gate/compressor math,
fp32 logits. `dtype=torch.float32` runs the same graph in fp32 (used by consistency tests).

The weight-holding layers (RMSNorm, Linear, Head) are layers.py, the MoE (gate, routed and shared
experts) moe.py; this file is attention, the mHC blocks and the Transformer around them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .config import ModelConfig
from .kernels.barrier import fusion_barrier
from .kernels.indexer import indexer_topk
from .kernels.linear import f32_linear, grouped_linear
from .kernels.mhc import hc_sinkhorn
from .kernels.sparse_attention import sparse_attention, sparse_attention_rows
from .layers import Head, Linear, RMSNorm, linear_pair
from .moe import MoE
from .quant import sim as quant_sim
from .state import LayerState, StateLayout

__all__ = ["Transformer", "Batch", "rope_table", "empty_model", "init_random"]


# ---------------------------------------------------------------------------------------------
# building blocks


def rope_table(rd: int, max_len: int, base: float, yarn: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_len, rd/2] (fp32) of the interleaved RoPE, with YaRN frequency ramp if given.

    YaRN as DeepSeek-V4 uses it (docs/model.md, Forward pass): frequencies interpolated by a linear ramp between the
    beta_fast and beta_slow correction dims; no magnitude (mscale) factor anywhere.
    """
    freqs = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    if yarn and yarn["original_seq_len"] > 0:
        L0, factor = yarn["original_seq_len"], yarn["factor"]

        def corr(rot: float) -> float:
            return rd * math.log(L0 / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(yarn["beta_fast"])), 0)
        high = min(math.ceil(corr(yarn["beta_slow"])), rd - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rd // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        freqs = freqs / factor * ramp + freqs * (1 - ramp)
    ang = torch.outer(torch.arange(max_len, dtype=torch.float32), freqs)
    return torch.cos(ang), torch.sin(ang)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x [B,S,(H,)rd] by cos/sin [B,S,rd/2]; fp32 math."""
    if x.dim() == 4:
        cos, sin = cos[:, :, None], sin[:, :, None]
    if inverse:
        sin = -sin
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).flatten(-2).to(x.dtype)


def _feature_pairs(D: int, rd: int, device: torch.device) -> torch.Tensor:
    """[D] the rope pair of each feature of D whose trailing rd are roped (DeepSeek-V4 puts the rotary
    part last; 0 for the nope features, whose cos/sin `rotate_tail` never uses)."""
    d = torch.arange(D, device=device)
    return torch.where(d >= D - rd, d - (D - rd), 0) // 2


def rope_features_at(cos_t: torch.Tensor, sin_t: torch.Tensor, pos: torch.Tensor, D: int,
                     rd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of each feature's rope pair [B,T,D] at positions pos [B,T] (clamped to the table) from the
    tables cos_t/sin_t [max_len, rd/2], the trailing rd of D features roped, as one gather per table:
    the position gather and the feature expansion apart were two dispatches per table. The last D' <= D
    features are the tables of width D' with the same rd, so Attention gathers its positions once per
    call at head_dim and every rope of the call (the indexer's narrower queries too) reads them."""
    half = _feature_pairs(D, rd, cos_t.device)
    p = pos.clamp(0, cos_t.shape[0] - 1)[..., None]
    return cos_t[p, half], sin_t[p, half]


def rotate_tail(x: torch.Tensor, rd: int, cos_f: torch.Tensor, sin_f: torch.Tensor,
                inverse: bool = False) -> torch.Tensor:
    """RoPE on the trailing rd of x's D features [B,S,(H,)D], given the per-feature tables cos_f/sin_f
    [B,S,W >= D] of `rope_features_at` (their last D features are used).

    The values of cat([x[..., :-rd], apply_rope(x[..., -rd:], ...)], -1), bit for bit (the same fp32
    products and sums per element), written as one elementwise expression over all D features: each
    feature reads its pair partner by an index along the last dim. The cat of slices and the stack of
    the two halves each made IREE materialize copies: ~8 dispatches per call (5 calls per CSA layer)
    where this is one."""
    D = x.shape[-1]
    c, s = cos_f[..., -D:], sin_f[..., -D:]
    if x.dim() == 4:
        c, s = c[:, :, None], s[:, :, None]
    nope = D - rd
    d = torch.arange(D, device=x.device)
    rope = d >= nope
    odd = torch.remainder(d - nope, 2)  # 0: x0 of its pair, 1: x1 (no xor: torch-mlir does not lower it)
    partner = torch.where(rope, d + 1 - 2 * odd, d)
    first = odd == 0
    xf = x.float()
    xp = xf.index_select(-1, partner)
    # x0' = x0 cos - x1 sin, x1' = x0 sin + x1 cos: apply_rope's operations in its operand order. The
    # inverse (sin negated) is written with the signs flipped, exactly the same values (a - (-b) = a + b
    # and (-b) + a = a - b in IEEE arithmetic): a negated table was one more dispatch per layer
    if inverse:
        rot = torch.where(first, xf * c + xp * s, xf * c - xp * s)
    else:
        rot = torch.where(first, xf * c - xp * s, xp * s + xf * c)
    return torch.where(rope, rot, xf).to(x.dtype)


def fp8_nope(x: torch.Tensor, rd: int, block: int = 64) -> torch.Tensor:
    """FP8 quantize->dequantize of the nope features, the trailing rd (rope) features untouched:
    cat([fp8_qdq(x[..., :-rd]), x[..., -rd:]], -1). When both parts are whole blocks, the blocks are
    independent, so it is the qdq of all of x with the rope features selected back from x: the same
    values, without the cat (IREE materialized it as copies)."""
    D = x.shape[-1]
    if (D - rd) % block or rd % block:
        return torch.cat([quant_sim.fp8_qdq(x[..., :-rd], block), x[..., -rd:]], -1)
    return torch.where(torch.arange(D, device=x.device) < D - rd, quant_sim.fp8_qdq(x, block), x)


@dataclass
class Batch:
    """Per-call positions, shared by every layer. All int64 tensors."""

    tokens: torch.Tensor  # [B,T]
    start: torch.Tensor  # [B] position of tokens[:, 0]
    lengths: torch.Tensor  # [B] real tokens per row
    slots: torch.Tensor  # [B] state slot of each row (distinct)
    pos: torch.Tensor  # [B,T]
    # None: every state write happens at once, for the `lengths` real tokens. A list: the layers read
    # as if their writes had happened but append each write here instead, a callable of the number of
    # tokens per row to keep [B] (speculative verify: the kept count is known only after the logits)
    pending: list | None = None

    @classmethod
    def make(cls, tokens, start, lengths, slots, deferred: bool = False) -> "Batch":
        T = tokens.shape[1]
        pos = start[:, None] + torch.arange(T, device=tokens.device)[None, :]
        return cls(tokens, start, lengths, slots, pos, [] if deferred else None)

    def write(self, fn) -> None:
        """State write fn(lengths [B]): now for `lengths` tokens, or deferred (see `pending`)."""
        if self.pending is None:
            fn(self.lengths)
        else:
            self.pending.append(fn)

    def commit(self, keep: torch.Tensor) -> None:
        """Apply the deferred writes for the first keep[b] tokens of each row (keep <= lengths)."""
        for fn in self.pending or ():
            fn(keep)
        self.pending = None


def ring_rows(q: torch.Tensor, start: torch.Tensor, ring: int, T: int) -> torch.Tensor:
    """Row of position q in cat([ring (positions < start, slot q % ring), fresh chunk (T rows)])."""
    s = start.view(-1, *([1] * (q.dim() - 1)))
    rows = torch.where(q >= s, ring + q - s, torch.remainder(q, ring))
    return rows.clamp(0, ring + T - 1)


def ring_update(old: torch.Tensor, fresh: torch.Tensor, start: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """New ring [B,RS,...]: slot s takes the latest real fresh token [B,T,...] whose position is = s mod RS."""
    RS, T = old.shape[1], fresh.shape[1]
    s = torch.arange(RS, device=old.device)[None, :]
    last = (start + lengths - 1)[:, None]
    q = last - torch.remainder(last - s, RS)  # latest position <= last in slot s
    has = q >= start[:, None]
    t = (q - start[:, None]).clamp(0, T - 1)
    flat = fresh.flatten(2)
    picked = torch.gather(flat, 1, t[..., None].expand(-1, -1, flat.shape[-1])).view(old.shape)
    return torch.where(has.view(*has.shape, *[1] * (old.dim() - 2)), picked, old)


def write_ring(state: torch.Tensor, slots: torch.Tensor, group: int, old: torch.Tensor | None, fresh: torch.Tensor,
               start: torch.Tensor, lengths: torch.Tensor) -> None:
    """state[slots, group] = ring_update(old, fresh, start, lengths), old being that ring before the call.
    A call of a static T <= RS tokens per row (decode, verify) writes its token rows alone: row
    (start + t) % RS takes fresh[t] for a real token t and old's row back for a padding one (the rows of
    one call are distinct). The same ring; writing the whole ring was 3 to 4 dispatches per ring per call.
    There `old` may be None: the padding rows' old values are then read from the state itself."""
    RS, T = state.shape[2], fresh.shape[1]
    if not isinstance(T, int) or T > RS:
        if old is None:
            raise ValueError("write_ring: a call of more tokens than the ring holds needs the ring before the call")
        _set_rows(state, slots, group, None, ring_update(old, fresh, start, lengths))
        return
    t = torch.arange(T, device=fresh.device)[None, :]
    rows = torch.remainder(start[:, None] + t, RS)  # [B,T]
    real = (t < lengths[:, None]).view(*rows.shape, *[1] * (fresh.dim() - 2))
    if old is not None:
        before = gather_rows(old, rows)
    else:
        before = state.flatten(0, 2)[_row_base(state, slots, group)[:, None] + rows]
        # read from the state in a dispatch of its own before a flat write: fused into that write's scatter, IREE
        # 3.13's cuda code generation failed to bufferize it (a read and a write of the state in one dispatch)
        before = fusion_barrier(before) if _flat_write(state, rows) else before
    _set_rows(state, slots, group, rows, torch.where(real, fresh, before))


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [B,N,F], rows [B,...] -> [B,...,F] (advanced indexing: no reshapes of symbolic dims)."""
    b = torch.arange(x.shape[0], device=x.device).view(-1, *([1] * (rows.dim() - 1)))
    return x[b, rows]


def _get(state: torch.Tensor, slots: torch.Tensor, layer: int) -> torch.Tensor:
    """state[slots, layer] for a state tensor [n_slots, n_layers, ...], as a 1-D gather over the
    flattened (slot, layer) rows. Not `state[slots, layer]`: that traces to a select of the layer
    and then a gather, which IREE 3.13's GPU codegen (cuda and gfx942; llvm-cpu is right) compiles
    with the slot stride of the selected view instead of the state's: slot s read the flattened row
    s + layer, i.e. another slot's other layer (bench/slot_gather.py, docs/performance.md)."""
    return state.flatten(0, 1)[slots * state.shape[1] + layer]


def _row_base(state: torch.Tensor, slots: torch.Tensor, group: int) -> torch.Tensor:
    """[B]: the row of state.flatten(0, 2) where (slot, group)'s rows begin, for a state tensor
    [n_slots, n_groups, rows, ...] read in place by global row ids."""
    return (slots * state.shape[1] + group) * state.shape[2]


def _flat_write(state: torch.Tensor, rows: torch.Tensor | None) -> bool:
    """Whether _set_rows writes these rows through one flat index (see there)."""
    return state.shape[0] > 1 and (rows is None or all(isinstance(d, int) for d in rows.shape))


def _set_rows(state: torch.Tensor, slots: torch.Tensor, group: int, rows: torch.Tensor | None,
              value: torch.Tensor) -> None:
    """state[slots[b], group, rows[b, i]] = value[b, i] for a state tensor [n_slots, n_groups, rows, ...],
    rows [B, n] (None: all the rows of each slot's group), value [B, n, ...]: a whole-tensor in-place write
    (export records it as an update of the state argument, export/functionalize.py). Static shapes
    (decode) write a [rows, features] view with one flat index tensor of global rows: indexed by (slot,
    group, row), IREE stacked the three index tensors into its [N, 3] scatter indices, a strided copy or
    fill each, three dispatches a write at batch > 1. A
    prefill's symbolic entry count keeps the three (flattening it made the trace guard its size), and so
    does a state of one slot (IREE 3.13's gfx942 compile of the flat write crashed in Flow's
    DispatchWorkgroupsOp::getResultAccess for n_slots = 1)."""
    if _flat_write(state, rows):
        n = state.shape[0] * state.shape[1] * state.shape[2]
        if rows is None:
            rows = torch.arange(state.shape[2], device=state.device).expand(slots.shape[0], -1)
        flat = (_row_base(state, slots, group)[:, None] + rows).flatten()
        state.view(n, -1).index_put_((flat,), value.flatten(0, rows.dim() - 1).flatten(1).to(state.dtype))
    elif rows is None:
        state.index_put_((slots, torch.full_like(slots, group)), value.to(state.dtype))
    else:
        b = slots[:, None].expand_as(rows)
        state.index_put_((b, torch.full_like(b, group), rows), value.to(state.dtype))


SELECTION_MULTIPLE = 16


def selection_rows(pos: torch.Tensor, W: int, window_row, sel: torch.Tensor | None = None, selected_row=None,
                   multiple: int = SELECTION_MULTIPLE) -> torch.Tensor:
    """[B,T,K] rows a query attends to, -1 for none: the sliding window's positions pos - c (c < W, rows
    window_row(positions); negative positions none), then sel's [B,T,S] entries (rows
    selected_row(entries); -1 stays -1), padded with -1 to a multiple of `multiple` entries. The padding
    is the same attention; IREE 3.13's cuda code for the sparse-attention kernel returns the last row of
    a batch (B > 1) non-finite when K is not a multiple of 16, with every input finite and equal across
    rows: Flash's HCA layers at max_seq_len 256 have K = 130 (docs/performance.md, GPU faults found and
    fixed; reproduce with `git show a7b70ea:bench/sparse_attention_rows.py`). One expression over the K
    columns: the window part, a cat with the selected part and a cat with the padding were two strided
    copies a call at batch > 1."""
    S = 0 if sel is None else sel.shape[-1]
    K = W + S + (-(W + S) % multiple)
    c = torch.arange(K, device=pos.device)
    p = pos[..., None] - c
    # nested selects: a bool `&` does not lower to IREE (torch-mlir)
    rows = torch.where(c < W, torch.where(p >= 0, window_row(p), -1), -1)
    if sel is None:
        return rows
    e = sel[..., (c - W).clamp(0, S - 1)]
    return torch.where(c < W, rows, torch.where(c < W + S, torch.where(e >= 0, selected_row(e), -1), -1))


# ---------------------------------------------------------------------------------------------
# attention


class Compressor(nn.Module):
    """Softmax-gated pooling of m tokens into one KV entry (docs/model.md, Forward pass).

    Ratio 4 pools overlapping windows: entry j mixes window j-1 (first hd features) and window j
    (last hd features), 2m slots in one softmax. Other ratios pool plain windows. Entry j exists once
    token (j+1)m-1 is seen and is roped at position jm. Chunk-general: a call of T tokens completes
    at most T//m + 1 entries; raw K and Z+ape of the last ring tokens are kept in the state.
    """

    def __init__(self, cfg: ModelConfig, ratio: int, hd: int, rotate: bool, dtype: torch.dtype):
        super().__init__()
        self.ratio, self.hd, self.rotate = ratio, hd, rotate
        self.rd = cfg.qk_rope_head_dim
        self.quant_sim = cfg.quant_sim
        self.overlap = ratio == 4
        c = 2 if self.overlap else 1
        self.ape = nn.Parameter(torch.zeros(ratio, c * hd, dtype=torch.float32))
        # kept in the checkpoint's bf16 (the model's dtype), run in fp32 as the reference does (f32_linear:
        # every product exact, f32 sums); held as fp32 they were three bf16 terms, 3x the bytes a step reads
        self.wkv = Linear(cfg.hidden_size, c * hd, dtype)
        self.wgate = Linear(cfg.hidden_size, c * hd, dtype)
        self.norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, b: Batch, ring: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """ring [B,RS,2,c*hd]: K (ring[:, :, 0]) and Z+ape (ring[:, :, 1]) of the last RS tokens before the
        call. Returns (entries [B,E,hd], entry ids [B,E], completed [B,E], the fresh tokens' K and Z+ape
        [B,T,2,c*hd]); the caller writes the ring (write_ring) and the completed entries
        (`compressed_cache`). K and Z travel together: one ring read, one ring write and one gather per
        window where apart each was two."""
        m, hd = self.ratio, self.hd
        B, T, _ = x.shape
        RS = ring.shape[1]
        # K and Z+ape as one [B,T,2,c*hd] projection: wkv and wgate side by side (a constant IREE
        # computes once, at load) and ape with zeros beside it for K. Apart, K and Z were two GEMVs and
        # their stack two strided copies a call (batch > 1)
        F = self.ape.shape[-1]
        w = torch.cat([self.wkv.weight, self.wgate.weight], 0)
        ape = torch.cat([torch.zeros_like(self.ape), self.ape], -1).view(m, 2, F)
        kz = f32_linear(x, w).unflatten(-1, (2, F)) + ape[torch.remainder(b.pos, m)]

        E = T // m + 1
        j = torch.div(b.start, m, rounding_mode="floor")[:, None] + torch.arange(E, device=x.device)
        done = (j + 1) * m <= (b.start + b.lengths)[:, None]
        # the softmax's slots, positions [B,E,S]: window j-1's tokens (their first hd features) then window
        # j's (their last hd) when windows overlap, else window j's; one gather of K and Z+ape at (row,
        # feature half) where a gather per window and a cat of the two made two copies
        S = 2 * m if self.overlap else m
        s = torch.arange(S, device=x.device)
        pos = j[..., None] * m + (s - m if self.overlap else s)
        half = (s >= m).long() if self.overlap else torch.zeros(m, dtype=torch.long, device=x.device)
        # each slot read from the ring (positions before the call) or from this call's rows: the values of
        # one gather from cat([ring, kz], 1), without the copy of the ring that cat made
        rows = ring_rows(pos, b.start, RS, T)
        bi = torch.arange(B, device=x.device).view(-1, 1, 1)
        halves = lambda t: t.unflatten(-1, (-1, hd)).transpose(2, 3)  # noqa: E731  [B,rows,c,2,hd]
        kz_s = torch.where((rows < RS)[..., None, None], halves(ring)[bi, rows.clamp(max=RS - 1), half],
                           halves(kz)[bi, (rows - RS).clamp(min=0), half])  # [B,E,S,2,hd]
        # the slots last, [B,E,2,hd,S] (the gather writes that layout): the softmax and the pooling then reduce
        # along contiguous memory, a warp a feature. Over the slots in place, IREE gave an HCA layer's 128 x 512
        # pooling 4 workgroups of 32 threads on cuda (0.14 ms of a 3.9 ms Flash-4 decode step on an H100)
        kz_s = kz_s.permute(0, 1, 3, 4, 2)
        kc, zc = kz_s[:, :, 0], kz_s[:, :, 1]
        if self.overlap:  # window j-1 of entry 0 does not exist
            ok = (pos >= 0)[:, :, None, :]
            kc, zc = torch.where(ok, kc, 0.0), torch.where(ok, zc, float("-inf"))
        pooled = (kc * zc.softmax(dim=-1)).sum(-1)  # [B,E,hd] fp32

        ent = self.norm(pooled.to(x.dtype))
        ent = rotate_tail(ent, self.rd, *rope_features_at(cos, sin, j * m, hd, self.rd))  # entry j at position jm
        if self.quant_sim:
            if self.rotate:  # indexer keys: Hadamard then FP4 over all dims
                ent = quant_sim.fp4_qdq(quant_sim.hadamard(ent), 32)
            else:  # attention KV: FP8 on the nope dims, rope dims untouched
                ent = fp8_nope(ent, self.rd)
        elif self.rotate:
            ent = quant_sim.hadamard(ent)
        return ent, j, done, kz


def _write_entries(cache: torch.Tensor, b: Batch, group: int, ent: torch.Tensor, j: torch.Tensor,
                   done: torch.Tensor) -> None:
    """Store completed entries at row j; uncompleted ones go to the scratch (last) row."""
    scratch = cache.shape[2] - 1
    rows = torch.where(done, j, scratch).clamp(0, scratch)
    _set_rows(cache, b.slots, group, rows, ent)


def compressed_cache(comp: "Compressor", x: torch.Tensor, b: Batch, group: int, state: dict, kv: str, ring: str,
                     cos: torch.Tensor, sin: torch.Tensor, copy: bool = True) -> torch.Tensor | None:
    """Run compressor `comp` on the chunk and return the cache of state[kv] [B,R+1,F] as this call sees
    it (the entries the chunk completes included); writes (or defers, Batch.pending) the ring
    state[ring] and the completed entries. `copy=False` (writes not deferred): write, return None, the
    caller reads state[kv] in place."""
    old = _get(state[ring], b.slots, group)
    ent, j, done, kz = comp(x, b, old, cos, sin)

    def write(lengths: torch.Tensor) -> None:
        write_ring(state[ring], b.slots, group, old, kz, b.start, lengths)
        if lengths is b.lengths:
            _write_entries(state[kv], b, group, ent, j, done)
            return
        # deferred: entries the kept tokens do not complete leave the scratch row as it was (no trace)
        kept = (j + 1) * comp.ratio <= (b.start + lengths)[:, None]
        _write_entries(state[kv], b, group, torch.where(kept[..., None], ent.to(cache.dtype), cache[:, -1:]), j, kept)

    if b.pending is None:
        b.write(write)
        return _get(state[kv], b.slots, group) if copy else None
    if not copy:
        raise ValueError("compressed_cache: deferred writes need the copy (copy=True)")
    cache = _get(state[kv], b.slots, group)  # as before this call
    b.write(write)
    # deferred: the entries overlaid on a copy, as the write would have left the rows
    rows = torch.where(done, j, cache.shape[1] - 1).clamp(0, cache.shape[1] - 1)
    bi = torch.arange(cache.shape[0], device=cache.device)[:, None].expand_as(rows)
    return cache.index_put((bi, rows), ent.to(cache.dtype))


class Indexer(nn.Module):
    """Lightning indexer of CSA layers: picks index_topk compressed entries per query (docs/model.md, Forward pass)."""

    # Training hook, off by default (used by train.py). The top-k selection is not differentiable,
    # so the indexer learns only from an auxiliary loss that aligns its scores with the main
    # attention. Assign a dict to `aux` and forward fills it with the score operands:
    #   q [B,T,Hi,di], w [B,T,Hi], keys [B,R,di], n_vis [B,T]            (this module)
    #   attn_q [B,T,H,D] (detached), attn_kv [B,R,D] (detached), sel [B,T,k]  (Attention)
    # and detaches x and qr, so that loss trains the indexer only (as DeepSeek does); the values it
    # computes, and every other gradient, are unchanged (no gradient reaches x/qr through a top-k).
    # None (the default): nothing is recorded and nothing is detached.
    aux: dict | None = None

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: str | None):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.rd, self.topk, self.quant_sim = cfg.qk_rope_head_dim, cfg.index_topk, cfg.quant_sim
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype, quant)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, dtype)
        self.compressor = Compressor(cfg, 4, self.head_dim, rotate=True, dtype=dtype)

    def forward(self, x, qr, b: Batch, st: LayerState, state: dict, cos_q, sin_q, cos, sin) -> torch.Tensor:
        B, T, _ = x.shape
        aux = self.aux
        if aux is not None:  # training hook (see `aux`)
            x, qr = x.detach(), qr.detach()
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = rotate_tail(q, self.rd, cos_q, sin_q)
        q = quant_sim.hadamard(q)
        if self.quant_sim:
            q = quant_sim.fp4_qdq(q, 32)
        keys = compressed_cache(self.compressor, x, b, st.group, state, "idx_kv_r4", "idx_cmp_r4",
                                cos, sin)[:, :-1]  # [B,R,di] (scratch row dropped)
        wp = self.weights_proj.weight
        # bf16/f32: f32_linear rounded to x's dtype, the values of weights_proj(x) (f32 sums, one rounding),
        # through the kernel that pads a prefill's rows to a tile so GPUs run it on the matrix cores (as a
        # plain linear over the token count it ran without them)
        w = f32_linear(x, wp).to(x.dtype) if x.dtype in (torch.bfloat16, torch.float32) and wp.dtype == x.dtype \
            else self.weights_proj(x)
        w = w * (self.head_dim**-0.5 * self.n_heads**-0.5)
        n_vis = torch.div(b.pos + 1, 4, rounding_mode="floor")
        if aux is not None:  # training hook (see `aux`)
            aux.update(q=q, w=w, keys=keys.to(q.dtype), n_vis=n_vis)
        return indexer_topk(q, w, keys.to(q.dtype), n_vis, self.topk)


class Attention(nn.Module):
    """Single-head-KV (K = V, 512-d) attention with sink, sliding window, and CSA/HCA (docs/model.md, Forward pass).

    `head_shards` (None here; export/sharding.py sets it for a multi-device export) computes the
    query heads and their output groups from (qr, kvs, idx, cos, sin) instead of `queries` + `attend`.
    """

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, quant: str | None):
        super().__init__()
        c = cfg
        self.H, self.D, self.rd, self.eps = c.num_attention_heads, c.head_dim, c.qk_rope_head_dim, c.rms_norm_eps
        self.G, self.o_lora, self.W = c.o_groups, c.o_lora_rank, c.sliding_window
        self.ratio = c.compress_ratios[layer]
        self.quant_sim = c.quant_sim
        self.scale = self.D**-0.5
        self.attn_sink = nn.Parameter(torch.zeros(self.H, dtype=torch.float32))
        self.head_shards: nn.Module | None = None
        self.wq_a = Linear(c.hidden_size, c.q_lora_rank, dtype, quant)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = Linear(c.q_lora_rank, self.H * self.D, dtype, quant)
        self.wkv = Linear(c.hidden_size, self.D, dtype, quant)
        self.kv_norm = RMSNorm(self.D, c.rms_norm_eps)
        # FP8 in the checkpoint, dequantized to bf16 as the reference's convert.py does
        self.wo_a = Linear(self.H * self.D // self.G, self.G * self.o_lora, dtype)
        self.wo_b = Linear(self.G * self.o_lora, c.hidden_size, dtype, quant)
        if self.ratio:
            self.compressor = Compressor(c, self.ratio, self.D, rotate=False, dtype=dtype)
        if self.ratio == 4:
            self.indexer = Indexer(c, dtype, quant)

    def queries(self, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The H query heads [B,T,H,D] from the q latent qr (normalized without weight, roped)."""
        q = self.wq_b(qr).unflatten(-1, (self.H, self.D))
        q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + self.eps)  # unweighted, in x's dtype
        return rotate_tail(q, self.rd, cos, sin)

    def attend(self, q: torch.Tensor, kvs: torch.Tensor, idx: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, kv_b: torch.Tensor | None = None) -> torch.Tensor:
        """Sparse attention of the heads over kvs rows idx (with kv_b: rows of the tables kvs and kv_b,
        sparse_attention_rows), then the grouped low-rank output projection wo_a: [B,T,G,o_lora] (wo_b
        follows on the flattened groups)."""
        B, T, H, D = q.shape
        if kv_b is None:
            o = sparse_attention(q, kvs, idx, self.attn_sink, self.scale)
        else:
            o = sparse_attention_rows(q, kvs, kv_b, idx, self.attn_sink, self.scale)
        o = rotate_tail(o, self.rd, cos, sin, inverse=True)  # de-rotate with the query's position
        o = o.reshape(B, T, self.G, H * D // self.G)
        wo_a = self.wo_a.weight.to(o.dtype).view(self.G, self.o_lora, H * D // self.G)
        return grouped_linear(o, wo_a)

    def forward(self, x: torch.Tensor, b: Batch, st: LayerState, state: dict, rope: dict) -> torch.Tensor:
        B, T, _ = x.shape
        rd, W = self.rd, self.W
        cos_t, sin_t = rope["cos"], rope["sin"]
        cos, sin = rope["cos_at"], rope["sin_at"]  # [B,T,D] per feature at b.pos (rope_of)

        qa, kva = linear_pair(x, self.wq_a, self.wkv)
        qr = self.q_norm(qa)
        shards = self.head_shards
        q = self.queries(qr, cos, sin) if shards is None else None

        kv = rotate_tail(self.kv_norm(kva), rd, cos, sin)
        if self.quant_sim:
            kv = fp8_nope(kv, rd)

        # One token a row with its writes not deferred (decode), on one device: the call's writes come
        # first and the attention reads the state tensors in place (global row ids into the flattened
        # window ring and compressed cache), where a copy of the slot's ring and of its whole compressed
        # cache was made every call (at Flash's 1M positions 268 MB per CSA layer and step)
        in_place = (shards is None and b.pending is None and isinstance(T, int) and T == 1
                    and not (self.ratio == 4 and self.indexer.aux is not None))
        win = state["win_kv"]
        if in_place:
            write_ring(win, b.slots, st.window, None, kv, b.start, b.lengths)
            base = _row_base(win, b.slots, st.window)
            window_row = lambda p: base[:, None, None] + torch.remainder(p, W)  # noqa: E731
            tables = [win.flatten(0, 2)]
        else:
            ring = _get(win, b.slots, st.window)
            window_row = lambda p: ring_rows(p, b.start, W, T)  # noqa: E731
            sources = [ring, kv]

        sel, selected_row = None, None
        if self.ratio:
            m = self.ratio
            name = f"r{m}"
            cache = compressed_cache(self.compressor, x, b, st.group, state, f"kv_{name}", f"cmp_{name}",
                                     cos_t, sin_t, copy=not in_place)  # [B,R+1,D], entries of this call included
            R = state[f"kv_{name}"].shape[2] - 1
            if m == 4:
                sel = self.indexer(x, qr, b, st, state, cos, sin, cos_t, sin_t)
                if self.indexer.aux is not None:  # training hook (see Indexer.aux)
                    self.indexer.aux.update(attn_q=q.detach(), attn_kv=cache[:, :-1].detach(), sel=sel)
            else:  # HCA: every visible entry
                n_vis = torch.div(b.pos + 1, m, rounding_mode="floor")
                e = torch.arange(R, device=x.device)
                sel = torch.where(e < n_vis[..., None], e, -1)
            if in_place:
                comp = state[f"kv_{name}"]
                cbase = tables[0].shape[0] + _row_base(comp, b.slots, st.group)
                selected_row = lambda e: cbase[:, None, None] + e  # noqa: E731
                tables.append(comp.flatten(0, 2))
            else:
                selected_row = lambda e: W + T + e  # noqa: E731
                sources.append(cache.to(kv.dtype))
        idx = selection_rows(b.pos, W, window_row, sel, selected_row)
        if in_place:
            # a sliding layer has one table: kv_b is the same one, never selected
            o = self.attend(q, tables[0], idx, cos, sin, kv_b=tables[-1])
        else:
            kvs = torch.cat(sources, 1)
            o = self.attend(q, kvs, idx, cos, sin) if shards is None else shards(qr, kvs, idx, cos, sin)
        out = self.wo_b(o.flatten(2))

        if not in_place:
            b.write(lambda lengths: write_ring(win, b.slots, st.window, ring, kv, b.start, lengths))
        return out


# ---------------------------------------------------------------------------------------------
# mHC and blocks


def _hc_mix(h: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """mHC's mixing logits of the flattened streams [B,T,n*d]: (x @ fn^T) / rms(x), fp32."""
    x = h.flatten(2)
    return f32_linear(x, fn) * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + norm_eps)


def _stream_weights(mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, eps: float) -> list[torch.Tensor]:
    """mHC's pre weights sigmoid(mix_i * scale + base_i) + eps, fp32, one [B,T,1] expression per stream i
    of mix [B,T,n] (the values of the same expression over all n at once). Each is read by the collapse
    alone, so IREE fuses it there; one [B,T,n] tensor read as n slices was a dispatch of its own."""
    return [torch.sigmoid(mix[..., i:i + 1] * scale + base[i]) + eps for i in range(mix.shape[-1])]


def _collapse(w: list[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """sum_i w[i] h[:, :, i] over the n streams h [B,T,n,d] with weights w[i] [B,T,1], fp32, added in
    stream order: the values of (w[..., None] * h.float()).sum(2) (torch's CPU sum over that dim adds in
    index order), as one elementwise expression. IREE compiled the multiply-sum as a matvec over a
    materialized f32 copy of h: two dispatches per collapse where this is one."""
    y = w[0] * h[:, :, 0].float()
    for i in range(1, h.shape[2]):
        y = y + w[i] * h[:, :, i].float()
    return y


def hc_pre(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int, eps: float,
           norm_eps: float):
    """Collapse the n streams for a sub-layer; returns (input [B,T,d], post [B,T,n], comb [B,T,n,n])."""
    n = h.shape[2]
    mix = _hc_mix(h, fn, norm_eps)
    pre = _stream_weights(mix[..., :n], scale[0], base[:n], eps)
    post = 2 * torch.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb = hc_sinkhorn(mix, scale, base, n, iters, eps)
    return _collapse(pre, h).to(h.dtype), post, comb


def hc_post(f: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out_k = post_k f + sum_j comb[j, k] res_j (contracting comb's FIRST index), fp32, f.dtype out.

    Evaluated as one elementwise expression in a fixed order, for every k at once:
    post_k f + (((comb[0, k] res_0 + comb[1, k] res_1) + comb[2, k] res_2) + ...), the streams added in
    index order and the mix added to post_k f last. The contraction over n = 4 streams as an einsum
    compiled to a batch matmul per token with K = 4, off the matrix cores; this form is one elementwise
    dispatch. The bf16 operands are promoted by the f32 products (no .float()): a conversion of each
    stream res_j would be the same op as the one in hc_pre's collapse of these streams, which IREE then
    shares between the two and materializes (four more dispatches per call). At batch 8 IREE copies the
    stream and comb slices apart (docs/performance.md, MI300X)."""
    mix = comb[:, :, 0, :, None] * res[:, :, 0, None, :]
    for j in range(1, res.shape[2]):
        mix = mix + comb[:, :, j, :, None] * res[:, :, j, None, :]
    return (post[..., None] * f[:, :, None, :] + mix).to(f.dtype)


def hc_head(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, eps: float,
            norm_eps: float) -> torch.Tensor:
    """Final sigmoid-weighted collapse of the streams (no Sinkhorn, no post)."""
    mix = _hc_mix(h, fn, norm_eps)
    return _collapse(_stream_weights(mix, scale, base, eps), h).to(h.dtype)


def rope_of(m: nn.Module, pos: torch.Tensor) -> dict:
    """{"window"|"compressed": {"cos", "sin", "cos_at", "sin_at"}} for a call at positions pos [B,T]: the
    RoPE tables [max_len, rd/2] `m` holds as buffers rope_<kind>_<part> (a Transformer, or a pipeline
    stage that registers the same buffers), and their pairs at pos expanded per feature [B,T,head_dim]
    (`rope_features_at`). The expansion is made once per call for every layer: made per layer, each rope
    kind cost IREE ~5 gather dispatches per layer (the position gathers and the feature expansions,
    each read by several ropes)."""
    cfg = m.cfg
    out = {}
    for kind in ("window", "compressed"):
        cos, sin = getattr(m, f"rope_{kind}_cos"), getattr(m, f"rope_{kind}_sin")
        cos_at, sin_at = rope_features_at(cos, sin, pos, cfg.head_dim, cfg.qk_rope_head_dim)
        out[kind] = {"cos": cos, "sin": sin, "cos_at": cos_at, "sin_at": sin_at}
    return out


def embed_streams(embed: nn.Embedding, tokens: torch.Tensor, n: int) -> torch.Tensor:
    """Token embeddings as the n mHC residual streams [B,T,n,d] (every stream starts equal)."""
    # one gather of n rows a token: the gather and then a broadcast copy were two dispatches a call
    return embed(tokens[:, :, None].expand(-1, -1, n))


def final_logits(h: torch.Tensor, lengths: torch.Tensor, all_logits: bool, fn: torch.Tensor, base: torch.Tensor,
                 scale: torch.Tensor, norm: RMSNorm, head: nn.Module, cfg: ModelConfig) -> torch.Tensor:
    """Streams [B,T,n,d] -> fp32 logits: [B,V] at each row's last real token, or [B,T,V] with all_logits."""
    if not all_logits:  # only each row's last real position
        last = (lengths - 1).clamp(min=0)
        h = torch.gather(h, 1, last.view(-1, 1, 1, 1).expand(-1, 1, *h.shape[2:]))
    x = norm(hc_head(h, fn, scale, base, cfg.hc_eps, cfg.rms_norm_eps))
    # rows flattened to one 2-D GEMM: IREE folds the weight's transpose into it and reads [V, d] in
    # place; a 3-D x became a batch_matmul on a hoisted [d, V] copy that ran 11x slower on the H200
    out = head(x.flatten(0, -2)).view(*x.shape[:-1], -1)
    return out if all_logits else out[:, 0]


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, quant: str | None,
                 expert_fmt: str | None):
        super().__init__()
        n, d = cfg.hc_mult, cfg.hidden_size
        self.iters, self.hc_eps, self.norm_eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.rope_kind = "compressed" if cfg.compress_ratios[layer] else "window"
        self.attn = Attention(cfg, layer, dtype, quant)
        self.ffn = MoE(cfg, layer, dtype, quant, expert_fmt)
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        mix = (2 + n) * n
        for kind in ("attn", "ffn"):
            setattr(self, f"hc_{kind}_fn", nn.Parameter(torch.zeros(mix, n * d, dtype=torch.float32)))
            setattr(self, f"hc_{kind}_base", nn.Parameter(torch.zeros(mix, dtype=torch.float32)))
            setattr(self, f"hc_{kind}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))

    def forward(self, h: torch.Tensor, b: Batch, st: LayerState, state: dict, rope: dict,
                ids: torch.Tensor) -> torch.Tensor:
        x, post, comb = hc_pre(h, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, self.iters,
                               self.hc_eps, self.norm_eps)
        h = hc_post(self.attn(self.attn_norm(x), b, st, state, rope[self.rope_kind]), h, post, comb)
        x, post, comb = hc_pre(h, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, self.iters,
                               self.hc_eps, self.norm_eps)
        return hc_post(self.ffn(self.ffn_norm(x), ids), h, post, comb)


class MTPBlock(Block):
    """Multi-token prediction (mtp.k): predicts token t+2 from the backbone's last streams at t
    and the embedding of token t+1 (docs/model.md, Forward pass); shares embed and head with the model."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, quant: str | None,
                 expert_fmt: str | None):
        super().__init__(cfg, layer, dtype, quant, expert_fmt)
        d, n = cfg.hidden_size, cfg.hc_mult
        self.e_proj = Linear(d, d, dtype, quant)
        self.h_proj = Linear(d, d, dtype, quant)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * d, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))


# ---------------------------------------------------------------------------------------------
# the model


class Transformer(nn.Module):
    """DeepSeek-V4: embed -> n streams -> blocks (mHC) -> hc_head -> norm -> head (+ MTP blocks).

    `quantized=True` holds linears as in the released checkpoint (FP8 + E8M0 block scales,
    routed experts in the config's expert_dtype); `False` holds every weight in `dtype`.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, quantized: bool = False):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        quant = "fp8" if quantized and cfg.quantization_config else None
        expert_fmt = cfg.expert_dtype if quantized and cfg.expert_dtype in ("fp4", "fp8") else None
        n, d = cfg.hc_mult, cfg.hidden_size
        self.layout = StateLayout(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, d, dtype=dtype)
        self.layers = nn.ModuleList(Block(cfg, i, dtype, quant, expert_fmt) for i in range(cfg.n_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = Head(d, cfg.vocab_size, dtype)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * d, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.mtp = nn.ModuleList(MTPBlock(cfg, cfg.n_layers + k, dtype, quant, expert_fmt) for k in range(cfg.n_mtp))
        if quant and (cfg.quantization_config or {}).get("scale_fmt") == "fp32":
            # -Base checkpoints store the FP8 block scales as float32 (docs/model.md, Configuration); kernels take both
            for mod in self.modules():
                if isinstance(mod, Linear) and mod.scale is not None:
                    mod.scale = nn.Parameter(torch.empty(mod.scale.shape, dtype=torch.float32), requires_grad=False)
        self.set_rope_tables()

    def set_rope_tables(self) -> None:
        """(Re)compute the RoPE tables (non-persistent buffers, never in a checkpoint), on the CPU."""
        cfg, rd = self.cfg, self.cfg.qk_rope_head_dim
        for kind, base, yarn in (("window", cfg.rope_theta, None), ("compressed", cfg.compress_rope_theta, cfg.yarn)):
            with torch.device("cpu"):
                cos, sin = rope_table(rd, cfg.max_seq_len, base, yarn)
            self.register_buffer(f"rope_{kind}_cos", cos, persistent=False)
            self.register_buffer(f"rope_{kind}_sin", sin, persistent=False)

    def hidden(self, tokens: torch.Tensor, start_pos: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
               state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Backbone streams after the last block, [B,T,n,d] (what MTP consumes)."""
        return self.streams(Batch.make(tokens, start_pos, lengths, slots), state)

    def streams(self, b: Batch, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """`hidden` of a Batch (whose `pending` may defer the state writes)."""
        rope = rope_of(self, b.pos)
        h = embed_streams(self.embed, b.tokens, self.cfg.hc_mult)
        for i, layer in enumerate(self.layers):
            h = layer(h, b, self.layout.layers[i], state, rope, b.tokens)
        return h

    def logits(self, h: torch.Tensor, lengths: torch.Tensor, all_logits: bool, head_params=None,
               norm: RMSNorm | None = None) -> torch.Tensor:
        fn, base, scale = head_params or (self.hc_head_fn, self.hc_head_base, self.hc_head_scale)
        return final_logits(h, lengths, all_logits, fn, base, scale, norm or self.norm, self.head, self.cfg)

    def forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                state: dict[str, torch.Tensor], all_logits: bool = False) -> torch.Tensor:
        """fp32 logits: [B,V] at each row's last real token, or [B,T,V] with all_logits."""
        h = self.hidden(tokens, start_pos, lengths, slots, state)
        return self.logits(h, lengths, all_logits)

    def mtp_logits(self, h: torch.Tensor, next_tokens: torch.Tensor, start_pos: torch.Tensor, lengths: torch.Tensor,
                   slots: torch.Tensor, state: dict[str, torch.Tensor], k: int = 0,
                   all_logits: bool = False) -> torch.Tensor:
        """MTP block k: logits for token t+2 from backbone streams h at t and the ids of t+1."""
        x = self.mtp_streams(h, Batch.make(next_tokens, start_pos, lengths, slots), state, k)
        return self.mtp_head(x, lengths, all_logits, k)

    def mtp_streams(self, h: torch.Tensor, b: Batch, state: dict[str, torch.Tensor], k: int = 0) -> torch.Tensor:
        """MTP block k's output streams [B,T,n,d] from backbone streams h at t and b.tokens = the ids of t+1."""
        blk = self.mtp[k]
        e = blk.enorm(self.embed(b.tokens))
        x = (blk.e_proj(e)[:, :, None, :] + blk.h_proj(blk.hnorm(h))).to(self.dtype)
        return blk(x, b, self.layout.layers[self.cfg.n_layers + k], state, rope_of(self, b.pos), b.tokens)

    def mtp_head(self, x: torch.Tensor, lengths: torch.Tensor, all_logits: bool, k: int = 0) -> torch.Tensor:
        """fp32 logits of MTP block k's streams x (its own hc_head and norm, the shared head)."""
        blk = self.mtp[k]
        return self.logits(x, lengths, all_logits, (blk.hc_head_fn, blk.hc_head_base, blk.hc_head_scale), blk.norm)


def empty_model(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, quantized: bool = True) -> Transformer:
    """A Transformer on the CPU whose parameters are allocated but never written: built on the meta
    device, then `to_empty` (torch.empty touches no page), so Flash's ~150 GB cost address space, not
    memory, until something reads them. For tracing (the graph needs shapes and dtypes only) and for
    loaders that then fill every parameter."""
    with torch.device("meta"):
        model = Transformer(cfg, dtype=dtype, quantized=quantized)
    model = model.to_empty(device="cpu")
    model.set_rope_tables()
    return model


@torch.no_grad()
def init_random(model: Transformer, seed: int = 0, std: float = 0.02) -> Transformer:
    """Random weights in the spirit of HF's _init_weights (docs/model.md, Random weights); float weights only. Which
    parameter gets what is `init_rule` (dsv4.contract.random_weights: the torch-free `dsv4 weights
    random` follows the same rules)."""
    from dsv4.contract.random_weights import init_rule

    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    for name, p in model.named_parameters():
        if p.dtype in (torch.uint8, torch.float8_e4m3fn):
            raise ValueError("init_random fills float weights; build the model with quantized=False")
        rule = init_rule(name)
        if rule == "tid2eid":
            p.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                                 for _ in range(cfg.vocab_size)]))
        elif rule == "ones":
            p.fill_(1.0)
        elif rule == "zeros":
            p.zero_()
        else:
            p.copy_((torch.randn(p.shape, generator=g) * std).to(p.dtype))
    return model
