"""MoE expert hook: routed SwiGLU experts weighted by the gate (docs/model.md, Forward pass).

Reference semantics: every token runs its top-k experts; g = w1 x, u = w3 x in fp32, clamped
(g <= L, |u| <= L), a = silu(g) * u * weight, out = w2(a in the activation dtype), summed in fp32.
This reference evaluates every expert on every token and zeroes the unrouted ones (what eager runs);
the result for a routed token is the same as running only its experts. `moe_experts_routed` below
is that: only the selected experts' packed weights are gathered and dequantized, one per slot
(decode) or in expert-grouped blocks (prefill). The hot spot `moe_experts` (declared at the end)
runs the reference eagerly; export traces its `routed` implementation by default.
"""

from __future__ import annotations

from typing import ContextManager

import torch

from . import kernel, overrides, runs_reference
from ..quant.formats import FP8_BLOCK
from .linear import (_BYTES, _F, _MLIR, _SCALES, _check_mxfp4, gathered_linear, is_packed_mxfp4_stack,
                     mxfp4_linear_gathered, stacked_linear)
from .qdq import fp8_qdq
from .barrier import fusion_barrier
from .topk import pair_rank


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    g, u = g.float(), u.float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    return torch.nn.functional.silu(g) * u


@kernel("mxfp4_swiglu_gathered", args={"x": "G, M, K", "gate": "G, M, N", "rweights": "G, M", "packed": "E, N, KP",
                                        "scale": "E, N, KS", "sel": "G", "limit": float, "x_quantized": int},
        results={"y": "G, M, N"}, static=("E", "N", "K", "KP", "KS"),
        dtypes={"x": _F, "gate": _F, "rweights": (torch.float32,), "packed": _BYTES, "scale": _SCALES[:2],
                "sel": (torch.int64,)}, mlir=_MLIR, trace_sizes=("M",))
def mxfp4_swiglu_gathered(x: torch.Tensor, gate: torch.Tensor, rweights: torch.Tensor, packed: torch.Tensor,
                          scale: torch.Tensor, sel: torch.Tensor, limit: float, x_quantized: int) -> torch.Tensor:
    """The routed experts' up projection and SwiGLU: u = mxfp4_linear_gathered(x, packed, scale, sel), then
    (swiglu(gate, u, limit) * rweights[..., None]) in x's dtype. gate [G, M, N] is the gate projection's
    output (w1), rweights [G, M] f32 the rows' routing weights. Its kernel is the gathered GEMM (kernel_gemm)
    with this as its epilogue: the SwiGLU of a GEMM that is its own dispatch region cannot join the GEMM's
    dispatch otherwise, and took one of its own a layer. x_quantized: as mxfp4_linear_gathered's."""
    u = mxfp4_linear_gathered(x, packed, scale, sel, x_quantized)
    return (swiglu(gate, u, limit) * rweights[..., None]).to(x.dtype)


def gathered_swiglu(x: torch.Tensor, gate: torch.Tensor, rweights: torch.Tensor, weight: torch.Tensor,
                    scale: torch.Tensor | None, sel: torch.Tensor, limit: float,
                    x_quantized: bool = False) -> torch.Tensor:
    """(swiglu(gate, gathered_linear(x, weight, scale, sel, x_quantized), limit) * rweights[..., None]) in x's
    dtype, for the weight formats `gathered_linear` takes; packed MXFP4 goes through `mxfp4_swiglu_gathered`."""
    if is_packed_mxfp4_stack(weight, scale):
        _check_mxfp4(x, weight, scale, "gathered_swiglu")
        return mxfp4_swiglu_gathered(x, gate, rweights.float(), weight, scale, sel, limit, int(x_quantized))
    return (swiglu(gate, gathered_linear(x, weight, scale, sel, x_quantized), limit) * rweights[..., None]).to(x.dtype)


def _group(t: torch.Tensor | None, e0: int, e1: int) -> torch.Tensor | None:
    return None if t is None else t[e0:e1]


EXPERT_GROUP = 16  # experts dequantized together: bounds eager memory for 256-expert layers


def moe_experts_reference(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                w1: torch.Tensor, s1: torch.Tensor | None, w2: torch.Tensor, s2: torch.Tensor | None,
                w3: torch.Tensor, s3: torch.Tensor | None, limit: float) -> torch.Tensor:
    """x [N,d], weights/indices [N,k]; w1/w3 [E,I,.], w2 [E,d,.] stacked (scales [E,..] or None) -> fp32 [N,d].

    Experts run in groups of EXPERT_GROUP through `stacked_linear` (same numerics as `linear` per
    expert); for the small presets that is a single group, which keeps the traced graph small."""
    E = w1.shape[0]
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e0 in range(0, E, EXPERT_GROUP):
        e1 = min(E, e0 + EXPERT_GROUP)
        ids = torch.arange(e0, e1, device=x.device)
        # [e, N, 1]: each expert's gate weight per token, 0 where the token is not routed to it
        we = (weights[None] * (indices[None] == ids[:, None, None])).sum(-1, keepdim=True)
        g = stacked_linear(x, w1[e0:e1], _group(s1, e0, e1))
        u = stacked_linear(x, w3[e0:e1], _group(s3, e0, e1))
        a = swiglu(g, u, limit) * we
        y = y + stacked_linear(a.to(x.dtype), w2[e0:e1], _group(s2, e0, e1)).float().sum(0)
    return y


# ---------------------------------------------------------------------------------------------
# routed form: only the selected experts' (packed) weights are gathered, every row runs its own
# experts. Export traces it for the `moe_experts` kernel by default; eager keeps the reference.

# Rows per block of the grouped path (one gathered expert serves Mb token slots), decode batches and
# prefill alike. Big blocks mean fewer expert reads (bs64 Flash: 264 vs 256 experts) and GEMMs that
# a GPU runs well: on the H200 the largest of a Flash prefill's block GEMMs took 1,482 ms per
# 128-token call with 4 rows per block and 6.8 ms with 16 (TTFT 3.1 s -> 0.18 s; docs/performance.md).
# The price is padded rows (<= E*Mb per layer and chunk; bench/moe_bytes.py prints the ratio).
GROUP_BLOCK = 16
# A prefill's (a dynamic pair count's) blocks: every one of the grouped_blocks bound runs, and each
# gathers and decodes its expert's weights, so fewer, fuller blocks read fewer bytes (Flash, 8 x 256
# tokens: 448 blocks of 64 rows against 1,024 of 16).
PREFILL_GROUP_BLOCK = 64
# ... unless an entry's largest call routes at most this many pairs to an expert on average (its pair count's
# upper bound / E): then its blocks hold GROUP_BLOCK rows. Every block of the bound (E + P / Mb) decodes its
# expert's whole weight; the gathered GEMM alone took ~7.8 us a block at 16 rows and ~11.6 us at 64 on an
# H100 (docs/kernels.md), equal at P ~ 12.4 E. A 128-token prompt (3 pairs an expert) took Flash-4 to its
# first token in 35.0 against 43.5-44.4 ms; 8 rows of 128 (24) prefilled 10.3k against 11.3k tokens/s.
SMALL_PREFILL_PAIRS_PER_EXPERT = 12
# A static pair count above this is a prefill-sized call (an export's --static-prefill chunk: Flash's shortest,
# 128 tokens x top-6, has 768; every decode batch exported has fewer: 64 rows x top-6 = 384): it takes the
# blocks of `prefill_block` and its tokens quantized once before the blocks (moe_experts_routed). At or below
# it, a static count keeps decode's forms.
STATIC_PREFILL_PAIRS_MIN = 512
# pair_ranks counts a static P up to this in one P x P compare (1M compares), more in two levels: the P x P count
# is quadratic (38M compares a layer for Flash-4's 8 x 128 chunk), and the two levels took 4-5 more dispatches a
# layer for its 128-token chunk (768 pairs)
PAIRWISE_RANKS_MAX = 1024
# The most (token, slot) pairs the one-row-a-pair path takes in `moe_experts_routed_blocks` (a GPU-only
# export's routed MoE); more go through the 16-row blocks. Both read the experts in place on the GPU; on
# the H100 (Flash w1 alone, docs/kernels.md) 6 experts took 0.14-0.15 ms as one-row GEMVs against
# 0.25-0.27 ms as 16-row blocks, 48 took 0.78-0.85 ms as GEMVs (copied) against 0.55-0.62 ms as blocks.
# 24 (batch 4 at top-6) keeps batches 1-4 on the GEMVs; between 6 and 48 the crossover is not measured.
ONE_ROW_PAIRS_MAX = 24


_NOT_FIRST = 1e30  # above any sum of k routing weights (each <= routed_scaling_factor)


def merged_slot_weights(weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """[N,k] routing weights with repeated experts of one token merged into the first slot naming
    that expert (the later slots get 0), summed in slot order exactly as the reference does, so a
    token that lists an expert twice is one expert application, bit for bit the reference."""
    same = indices[:, :, None] == indices[:, None, :]  # [N,k,k]: slot j names the expert of slot j'
    k = indices.shape[1]
    i = torch.arange(k, device=indices.device)
    # one reduction: an earlier slot of the same expert adds _NOT_FIRST (the slot then gets 0), a later
    # or the same one its weight, the others 0 -- for a first slot the reference's terms, summed in the
    # same order (two reductions, the sum and the earlier-slot count, were two dispatches at batch 64)
    terms = torch.where(same, torch.where(i[None, :] < i[:, None], _NOT_FIRST, weights[:, None, :]), 0.0)
    total = terms.sum(-1)
    return torch.where(total < _NOT_FIRST, total, torch.zeros((), dtype=weights.dtype))


def _expert_rows(xs: torch.Tensor, ws: torch.Tensor, sel: torch.Tensor, w1, s1, w2, s2, w3, s3,
                 limit: float, x_quantized: bool = False) -> torch.Tensor:
    """xs [G,M,d] rows, ws [G,M] routing weights, sel [G] the expert of each group -> fp32 [G,M,d].

    Same numerics per row as the reference (stacked_linear per expert, fp32 clamped SwiGLU, weight
    applied before w2, w2's input in the activation dtype); only sel's weights are read/dequantized
    (MXFP4 in place, `gathered_linear`). x_quantized: xs holds fp8_act_qdq's values already."""
    # decode's rows in dispatches of their own: multi-use fusion (export/compile.py) put their producers
    # into the expert GEMMs' activation block amax, which gfx942 failed to compile at K = 128 (the tiny models)
    static = all(isinstance(n, int) for n in xs.shape)
    barrier = fusion_barrier if static else (lambda t: t)
    xs = barrier(xs)
    g = gathered_linear(xs, w1, s1, sel, x_quantized)
    a = barrier(gathered_swiglu(xs, g, ws, w3, s3, sel, limit, x_quantized))
    return gathered_linear(a, w2, s2, sel).float()


def grouped_blocks(n_pairs: int, n_experts: int, block: int) -> int:
    """Static upper bound on the Mb-row blocks that hold n_pairs (token, slot) pairs grouped by
    expert, each expert's group padded to a multiple of Mb: sum_e ceil(c_e/Mb) <= m + (P - m) // Mb
    with m = min(E, P) groups (one more non-empty group adds at most one block). A traced (symbolic)
    pair count gets E + P // Mb + 1, valid for every P: the spare empty block keeps the count above 1
    (a traced size the tracer can see as 1 gets specialized: one expert per device and short prompts
    made torch.export require T >= 32 with blocks of 64)."""
    if isinstance(n_pairs, int):
        m = min(n_experts, n_pairs)
        return m + (n_pairs - m) // block
    return n_experts + n_pairs // block + 1


def is_prefill_pairs(n_pairs: int | torch.SymInt) -> bool:
    """Whether a pair count is a prefill's: traced (a dynamic chunk), or static above STATIC_PREFILL_PAIRS_MIN."""
    return not isinstance(n_pairs, int) or n_pairs > STATIC_PREFILL_PAIRS_MIN


def prefill_block(n_pairs: int | torch.SymInt, n_experts: int) -> int:
    """The block rows of a prefill's pair count: GROUP_BLOCK when its largest value (a static count itself, a
    traced one the upper bound of the range torch.export's dynamic dims give it) is at most
    SMALL_PREFILL_PAIRS_PER_EXPERT pairs an expert, else PREFILL_GROUP_BLOCK."""
    most = n_pairs if isinstance(n_pairs, int) else n_pairs.node.shape_env.bound_sympy(n_pairs.node.expr).upper
    small = (isinstance(most, int) or most.is_finite) and int(most) <= SMALL_PREFILL_PAIRS_PER_EXPERT * n_experts
    return GROUP_BLOCK if small else PREFILL_GROUP_BLOCK


RANK_CHUNK = 256  # pairs per chunk of pair_ranks' export form


def pair_ranks(e: torch.Tensor, n_experts: int, pairwise: bool | None = None) -> torch.Tensor:
    """[P] expert ids -> [P] int64: how many earlier pairs chose the same expert (the stable
    counting-sort rank). `pairwise` (the default when tracing for export): compare-and-count, parallel
    reductions only. A static P up to PAIRWISE_RANKS_MAX (decode, a short static prefill) one P x P count;
    a dynamic or larger one (a prefill: P = tokens x top-k) two levels over chunks of RANK_CHUNK pairs
    (_chunked_ranks), because a P x P count is quadratic: 58 % of an 8 x 512-token prefill of the embedded
    default on the H200 (docs/kernels.md, The routed MoE).
    Otherwise the one-hot cumsum, O(P*E) memory instead of O(P^2), which IREE compiles to a scan run
    sequentially along the pairs (9.5 ms of a 105 ms Flash decode step at batch 64 on the H200,
    docs/performance.md). Counts are summed in f32 (exact below 2^24 pairs): IREE 3.13's cuda backend
    fails to compile an integer sum whose input is computed in the same dispatch ("failed to
    distribute"; docs/kernels.md)."""
    if pairwise is None:
        pairwise = torch.compiler.is_exporting()
    if pairwise:
        P = e.shape[0]
        if not isinstance(P, int) or P > PAIRWISE_RANKS_MAX:  # a decode's P x P form was measured clean on cuda
            return _chunked_ranks(e, n_experts)
        # the P x P count as the pair_rank kernel (one row of P keys), on the int64 ids as they come: a cast
        # to int32 was a dispatch a routed layer (Flash-4 decode_bs64). The barrier keeps the ids' producer
        # out of the count: a top-k gate's float-to-int conversion fused in, and gfx942's compile of the
        # count did not finish in 150 s (0.6 s without it)
        return pair_rank(fusion_barrier(e)[None, :], 0)[0].to(torch.int64)
    onehot = (e[:, None] == torch.arange(n_experts, device=e.device)[None, :]).to(torch.int64)  # [P,E]
    return onehot.cumsum(0).gather(1, e[:, None])[:, 0] - 1


def _chunked_ranks(e: torch.Tensor, n_experts: int, chunk: int = RANK_CHUNK) -> torch.Tensor:
    """pair_ranks in two levels: the earlier pairs of the same expert inside a pair's chunk (a P x chunk
    count), plus those of the earlier chunks (each chunk's per-expert counts, [chunks, E], summed over
    the chunks before). P x (chunk + E) work instead of P x P; no scan, no padding of the dynamic P."""
    P = e.shape[0]
    dev = e.device
    i = torch.arange(P, device=dev)
    cols = torch.arange(chunk, device=dev)
    chunk_of = torch.div(i, chunk, rounding_mode="floor")
    j = (chunk_of * chunk)[:, None] + cols[None, :]  # [P, chunk]: the pairs of i's chunk
    same = (e[j.clamp(max=P - 1)] == e[:, None]).to(torch.float32)
    # the mask in a dispatch of its own: every routed layer computes the same mask, and the one
    # producer fused into the first layer's count (and stored for the others) failed to distribute on gfx942
    earlier = fusion_barrier((j < i[:, None]).to(torch.float32))
    inside = (same * earlier).sum(1)  # a bool `&` does not lower
    # one chunk more than needed, and never 1: a traced chunk count the tracer could see as 1 gets
    # specialized (its broadcasting and contiguity guards), the extra chunk is empty
    n_chunks = P // chunk + 2
    c = torch.arange(n_chunks, device=dev)
    members = c[:, None] * chunk + cols[None, :]  # [chunks, chunk]
    valid = (members < P).to(torch.float32)
    experts = torch.arange(n_experts, device=dev)
    hits = (e[members.clamp(max=P - 1)][:, :, None] == experts[None, None, :]).to(torch.float32)
    counts = (hits * valid[:, :, None]).sum(1)  # [chunks, E]
    # [chunks, E]: the counts of the chunks before, a select-and-sum over the few chunks (P / 256 + 2). As
    # the product of the earlier-chunk mask and the counts it was a matmul to IREE (f32, two dynamic
    # dims of a few rows) that no GPU backend runs on its matrix cores; as a select it is a reduction,
    # in the same number of dispatches. Integer counts: exact in f32 in any order.
    before = torch.where((c[None, :] < c[:, None])[:, :, None], counts[None, :, :], 0.0).sum(1)
    own = chunk_of * n_experts + e  # 1-D gather: a 2-index one does not lower
    return (inside + before.flatten()[own]).to(torch.int64)


def moe_experts_routed(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                       w1: torch.Tensor, s1: torch.Tensor | None, w2: torch.Tensor, s2: torch.Tensor | None,
                       w3: torch.Tensor, s3: torch.Tensor | None, limit: float,
                       block: int | None = None, pair_max: int | None = None) -> torch.Tensor:
    """`moe_experts` computing only the routed experts (same signature and result up to fp32 order).

    Static rule on the (token, slot) pair count P = N*k, N the flattened tokens:
      * P static and P <= E (and <= pair_max, when given) (decode): each pair gathers its expert's
        packed weights (P expert reads, P rows: exactly the routed FLOPs);
      * otherwise (prefill, T dynamic; or big decode batches): counting sort by expert (pair_ranks,
        no sort/topk: docs/export.md, IREE 3.13 traps), each expert's rows padded to a multiple of `block`,
        a static bound of blocks (grouped_blocks), each block gathers one expert's weights and
        multiplies `block` rows (default GROUP_BLOCK; prefill_block's choice for a prefill's P,
        is_prefill_pairs).
        Rows <= P + E*block: within 1.5x of the routed FLOPs once P >= 2*E*block.
    Empty trailing blocks compute zeros with the last expert's weights and are never read back."""
    N, k = indices.shape
    E, d = w1.shape[0], x.shape[-1]
    if weights.shape != indices.shape or x.shape[0] != N:
        raise ValueError(f"moe_experts_routed: x {tuple(x.shape)}, weights {tuple(weights.shape)}, "
                         f"indices {tuple(indices.shape)} disagree")
    P = N * k
    if block is None:
        block = prefill_block(P, E) if is_prefill_pairs(P) else GROUP_BLOCK
    if block < 1:
        raise ValueError(f"moe_experts_routed: block must be >= 1, got {block}")
    # a prefill with packed MXFP4 experts: each token's activation quantized once here (the fp8_qdq kernel: the
    # GEMMs' own arithmetic, whose powers of two are exact on llvm-cpu too; its values are exact in x's dtype),
    # where the expert GEMMs quantized every copy of it in their blocks, padded rows included (~20 rows a
    # token in Flash-4's 8 x 128 chunk). Decode keeps the GEMMs' own: hoisted, its calls took one more
    # dispatch a layer. A ragged last block (d not a multiple of 128) stays with the GEMMs too, and so does the
    # gathered GEMM's torch reference (llvm-cpu's lowering): it quantizes inside the stacked linear, which a
    # weight-only export (`--kernel '*=weight_only'`) leaves unquantized
    xq = (is_packed_mxfp4_stack(w1, s1) and is_prefill_pairs(P) and d % FP8_BLOCK == 0
          and not runs_reference("mxfp4_linear_gathered"))
    if xq:
        x = fp8_qdq(x[None, None], FP8_BLOCK)[0, 0]
    e = indices.reshape(-1)
    wp = merged_slot_weights(weights, indices).reshape(-1)
    tok = torch.arange(N, device=x.device)[:, None].expand(N, k).reshape(-1)
    one_row_max = E if pair_max is None else min(E, pair_max)
    if isinstance(P, int) and P <= one_row_max:
        # the merged weights behind a barrier: fused into the SwiGLU's epilogue, their k x k reduction made
        # that a reduction dispatch computing the [P, inter] epilogue slowly (0.21 ms a layer on the H100)
        out = _expert_rows(x[tok][:, None, :], fusion_barrier(wp)[:, None], e, w1, s1, w2, s2, w3, s3, limit, xq)
        return out.view(N, k, d).sum(1)
    # pairs per expert, summed in f32 as pair_ranks does (exact; IREE's cuda backend failed on the integer sum)
    count = (torch.arange(E, device=x.device)[:, None] == e[None, :]).to(torch.float32).sum(1).to(torch.int64)
    rank = pair_ranks(e, E)  # position of the pair in its expert's group
    nblk = (count + block - 1) // block
    # each expert's first block: the blocks of the experts before it, a masked sum (exact in f32) where a
    # cumsum was a scan IREE runs sequentially, plus a dispatch for the difference
    ids = torch.arange(E, device=x.device)
    blk_start = torch.where(ids[None, :] < ids[:, None], nblk[None, :].to(torch.float32), 0.0).sum(1).to(torch.int64)
    blk_end = blk_start + nblk
    dest = blk_start[e] * block + rank  # row of each pair in the padded buffer, all distinct
    G = grouped_blocks(P, E, block)
    b = torch.arange(G, device=x.device)
    sel = (blk_end[None, :] <= b[:, None]).sum(1).clamp(max=E - 1)  # expert of each block
    if isinstance(G, int):  # static blocks (decode, a static prefill): one row index (a pair of index tensors
        # is stacked into IREE's [P, 2] scatter indices, two strided copies a layer)
        xs = x.new_zeros(G * block, d).index_put((dest,), x[tok]).view(G, block, d)
        ws = wp.new_zeros(G * block).index_put((dest,), wp).view(G, block)
    else:  # (block, row in block) of each pair; 2-D indices keep a symbolic G free of reshape guards
        at = (dest // block, dest % block)
        xs = x.new_zeros(G, block, d).index_put(at, x[tok])
        ws = wp.new_zeros(G, block).index_put(at, wp)
    out = _expert_rows(xs, ws, sel, w1, s1, w2, s2, w3, s3, limit, xq)
    # pairs are token-major, so each token's k results are a gather and a sum (no scatter-add:
    # aten.index_add does not lower in torch-mlir)
    return out.flatten(0, 1)[dest].view(N, k, d).sum(1)  # 1-D gather: a 2-index one does not lower


def moe_experts_routed_blocks(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                              w1: torch.Tensor, s1: torch.Tensor | None, w2: torch.Tensor, s2: torch.Tensor | None,
                              w3: torch.Tensor, s3: torch.Tensor | None, limit: float) -> torch.Tensor:
    """`moe_experts_routed` with the one-row-a-pair path up to ONE_ROW_PAIRS_MAX pairs only: a decode
    batch with more pairs takes the 16-row blocks, which GPU exports read in place (kernel_gemm)."""
    return moe_experts_routed(x, weights, indices, w1, s1, w2, s2, w3, s3, limit, pair_max=ONE_ROW_PAIRS_MAX)


def routed_moe() -> ContextManager[None]:
    """Context: the `moe_experts` hook runs `moe_experts_routed` (what export installs by default)."""
    return overrides({"moe_experts": moe_experts_routed})


# The hot spot: eager (and the tests' oracle) runs the all-experts reference; `dsv4 export` traces
# the routed form unless `--kernel moe_experts=reference` asks for the reference.
moe_experts = kernel("moe_experts", alternatives={"routed": moe_experts_routed,
                                                  "routed_blocks": moe_experts_routed_blocks})(moe_experts_reference)
