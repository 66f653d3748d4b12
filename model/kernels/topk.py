"""Top-k index selection, the one place every top-k of the model goes through (indexer, MoE gate).

Contract (the tie rule): the indices of the k largest entries along the last dim, largest first;
equal values are taken in ascending index order, i.e. exactly
``torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]``. -0.0 equals +0.0, -inf
entries are ordinary (lowest) values, so a row with fewer than k finite entries fills the rest with
the lowest-index -inf entries (callers that mask decide validity by position, see indexer.py).
torch.topk itself breaks ties in an unspecified order, which is why the reference is a stable sort
(eager only: IREE 3.13 does not lower aten.sort.stable).

Export uses ``topk_select`` (implementation "select"): IREE 3.13 returns wrong top-k *indices* when a
topk/sort follows other work on a dynamic token dim (docs/export.md, IREE 3.13 traps), and
``iree_linalg_ext.topk`` at k = 512 fails on cuda (128 KiB of shared memory) and runs ~25x slower on
llvm-cpu (docs/kernels.md). ``topk_select`` ranks all pairs (``topk_rank``: 5 dispatches) where the
entries are a static N <= RANK_MAX_N (the MoE gate's 256 experts), or a static N <= STATIC_RANK_MAX_N
over static rows (a decode call's indexer up to 8k positions of context), and runs the radix select
(``topk_radix``: ~31 dispatches with its compaction and ordering, whatever k) otherwise (a prefill's
indexer, and decode at longer contexts: its compares stay linear in the entries). Both use only elementwise ops, reductions, prefix counts as GEMMs and a flat
index_put, so neither graph grows with k.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from . import kernel
from .barrier import fusion_barrier

__all__ = ["topk_indices", "topk", "topk_select", "topk_rank", "topk_radix", "radix_threshold", "pair_rank",
           "record_topk", "RANK_MAX_N", "STATIC_RANK_MAX_N"]


def _order_key(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 in [0, 2^32) with the same order (-0.0 and +0.0 map to one key; NaN on top)."""
    x = torch.where(x == 0, torch.zeros((), dtype=x.dtype, device=x.device), x)
    bits = x.view(torch.int32).long()
    # negative floats: larger magnitude bits = smaller value, so mirror them below 2^31 with
    # ~bits (== -bits - 1). Not `-bits`: torch-mlir lowers an integer neg through float32
    # (sitofp, negf, fptosi), which merges negative floats up to ~128 ulp apart.
    return torch.where(bits < 0, torch.bitwise_not(bits), bits + 2**31)


def _order_key32(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int32 with the same order under a signed compare (-0.0 and +0.0 one key; +NaN on
    top, -NaN at the bottom). Negative floats: ~bits - 2^31 = -(magnitude bits) - 1, so a larger
    magnitude gives a smaller key. int32, not _order_key's int64: IREE 3.13's gfx942 codegen of the
    [N, N] i64 compare-and-count did not finish in 2 minutes (the int32 one: 1 s)."""
    x = torch.where(x == 0, torch.zeros((), dtype=x.dtype, device=x.device), x)
    bits = x.view(torch.int32)
    return torch.where(bits < 0, torch.bitwise_not(bits) - 2**31, bits)


RADIX_BITS = 4  # bits of the order key per radix_threshold round (divides 32)


@kernel("radix_threshold", args={"key": "R, N", "k": int}, results={"t": "R, 1"}, dtypes={"key": (torch.int64,)},
        result_dtypes={"t": torch.int64}, mlir="topk.mlir.jinja")
def radix_threshold(key: torch.Tensor, k: int) -> torch.Tensor:
    """Step 1 of topk_radix: per row of order keys [R, N] (int64 in [0, 2^32)), the largest t with
    count(key >= t) >= k, found a digit of RADIX_BITS bits at a time, highest first: the round with
    digit weight w counts key >= t + j w for every digit j > 0 at once (float32 counts) and adds w
    times the number of j whose count reaches k (the counts fall with j: that is the largest such j).
    8 rounds of 4 bits give the t of 32 one-bit bisection rounds. Compiled (topk.mlir.jinja) for
    gfx942 alone: 16 dispatches (a count and an update per round) where the one-bit rounds made 32;
    compute per round is 15 compares per key (decode rows: trivial)."""
    t = torch.zeros_like(key[:, :1])
    j = torch.arange(1, 2**RADIX_BITS, device=key.device)
    for shift in range(32 - RADIX_BITS, -1, -RADIX_BITS):
        n = (key[:, None, :] >= t[:, :, None] + (j << shift)[None, :, None]).float().sum(-1)  # [R, 2^B - 1]
        t = t + ((n >= k).long().sum(-1, keepdim=True) << shift)
    return t


@kernel("pair_rank", args={"key": "R, N", "by_value": int}, results={"rank": "R, N"}, static=("N",),
        dtypes={"key": (torch.int32, torch.int64)}, result_dtypes={"rank": torch.float32}, mlir="pair_rank.mlir.jinja")
def pair_rank(key: torch.Tensor, by_value: int) -> torch.Tensor:
    """Per row of int32 or int64 keys [R, N], float32 counts (exact below 2^24): rank_i = #{j < i: key_j == key_i},
    plus #{j: key_j > key_i} when `by_value`. With it, entry i's place in the stable descending order (a
    permutation of 0..N-1: topk_rank, and topk_radix's ordering step); without, its place among the
    equal keys (the routed MoE's counting sort, moe.pair_ranks). The kernel reads each key pair
    without an index tensor, the form IREE's aggressive fusion compiles for the GPUs
    (pair_rank.mlir.jinja)."""
    i = torch.arange(key.shape[-1], device=key.device)
    rank = torch.logical_and(key[:, None, :] == key[:, :, None], i[None, None, :] < i[None, :, None])
    if by_value:
        rank = torch.logical_or(rank, key[:, None, :] > key[:, :, None])
    return rank.float().sum(-1)


PREFIX_CHUNK = 256  # entries per chunk of prefix_count's triangular GEMM


def prefix_count(m: torch.Tensor, chunk: int = PREFIX_CHUNK) -> torch.Tensor:
    """Inclusive prefix sums along the last dim of a 0/1 tensor [R, N], float32, exact.

    = m.cumsum(-1), but as GEMMs with a triangular ones matrix: IREE compiles a cumsum to a scan run
    sequentially along the row (`scan_64x256xf32`: 30 % of the embedded default's decode step at
    batch 64 on the H200). Rows are cut into chunks of `chunk` entries: within a chunk
    one [chunk, chunk] triangle, then each chunk's total is carried to the later chunks. The
    operands are 0/1 in bf16 (exact; GPUs take their matrix cores) and every sum is an integer
    <= chunk (within a chunk; exact in bf16 up to 256) or <= N (the carry, in float32: exact below 2^24).
    A traced (symbolic) R or N keeps the cumsum. N: the model's top-ks all have a static one (the
    experts, the state's compressed entries). R: a prefill's rows are of unknown divisibility, so
    IREE 3.13 runs the GEMM without the matrix cores (docs/kernels.md); the embedded default's
    batched prefill was 8 % slower with it on the H200, its decode at batch 64 21 % faster."""
    R, n = m.shape
    if not (isinstance(n, int) and isinstance(R, int)):
        return m.float().cumsum(-1)
    c = min(chunk, n)
    if c > 256:
        raise ValueError(f"prefix_count: chunk {c} > 256 is not exact in bf16")
    nc = -(-n // c)
    x = torch.nn.functional.pad(m.to(torch.bfloat16), (0, nc * c - n)).view(R, nc, c)
    i = torch.arange(c, device=m.device)
    upper = (i[:, None] <= i[None, :]).to(torch.bfloat16)  # [i, j]: entry i counts toward the sum at j
    inner = torch.matmul(x, upper).float()  # [R, nc, c]
    if nc > 1:
        ic = torch.arange(nc, device=m.device)
        # chunk b adds the totals of the chunks a < b: a select and a sum, not a GEMM (gfx942 fused a
        # [R, nc] x [nc, nc] one with the sums above into a dispatch needing 257 KB of shared memory)
        carry = torch.where(ic[None, :] < ic[:, None], inner[..., -1][:, None, :], 0.0).sum(-1)  # [R, nc]
        inner = inner + carry[..., None]
    return inner.reshape(R, nc * c)[:, :n]


def topk_radix(x: torch.Tensor, k: int) -> torch.Tensor:
    """Exact top-k by radix select (the contract above), as export traces it.

    1. Find the k-th largest order key a 4-bit digit at a time (8 rounds, each one reduction of
       15 counts count(key >= t + j w)): t = the largest key with at least k entries >= t.
    2. Select key > t, plus the first (k - count(key > t)) entries with key == t (a prefix count).
    3. Compact the selected positions, in index order, into k slots with one flat index_put (the
       rest go to a trash slot per row, and the slot is clamped into the row, so a wrong count can
       never write outside it); a flat index_put is the form IREE compiles everywhere.
    4. Order the k picks: rank = #picks with a larger key + #equal picks before it (a k x k
       comparison), then out[r] = the pick whose rank is r (a second k x k reduction; exact in
       float32). Not a second index_put: IREE 3.13's cuda code for a scatter whose indices are
       computed in the same dispatch stages them in shared memory without a barrier, so threads
       read other threads' slots before they are written (a garbage index: the 64-row abort).
    Counts run in float32 (exact below 2^24 entries): the GPU backends fail on int64 reductions."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    if isinstance(n, int) and k > n:
        raise ValueError(f"top-k: k={k} is larger than the {n} entries")
    key = _order_key(x.float().reshape(-1, n))
    rows = key.shape[0]
    # t in a dispatch of its own: the threshold's last update fused with the count `gt.sum` below (two
    # chained reductions) failed to bufferize on gfx942
    t = fusion_barrier(radix_threshold(key, k))
    gt = key > t
    need = k - gt.float().sum(-1, keepdim=True)
    eq = key == t
    sel = torch.logical_or(gt, torch.logical_and(eq, prefix_count(eq) <= need))
    row = torch.arange(rows, device=x.device)[:, None]
    slot = torch.where(sel, prefix_count(sel).long() - 1, k).clamp(0, k) + row * (k + 1)
    cols = torch.arange(n, device=x.device).expand(rows, n)
    picks = torch.zeros(rows * (k + 1), dtype=torch.long, device=x.device)
    picks = picks.index_put((slot.reshape(-1),), cols.reshape(-1)).view(rows, k + 1)[:, :k]
    # the picks' keys shifted into int32 (the same order): pair_rank's keys
    rank = pair_rank((key.gather(-1, picks) - 2**31).to(torch.int32), 1)  # a permutation of 0..k-1 per row
    pos = torch.arange(k, device=x.device)
    hit = rank[:, None, :] == pos[None, :, None].float()  # [rows, rank r, pick j]
    # a select, not hit * picks: IREE treats a multiply-sum as a contraction and materializes hit
    out = torch.where(hit, picks[:, None, :].float(), 0.0).sum(-1)
    return out.long().view(*lead, k)


RANK_MAX_N = 256  # topk_select ranks all pairs up to this many entries (N^2 compares per row)
# ... and up to this many over static rows (decode): at most 64 rows x 2048^2 = 2.7e8 compares per call,
# one pair_rank dispatch where the radix select takes ~31 small ones (Flash-4 decode_bs1 at its 4096
# positions: 1024 compressed entries; docs/performance.md)
STATIC_RANK_MAX_N = 2048


def topk_rank(x: torch.Tensor, k: int) -> torch.Tensor:
    """Exact top-k (the contract above) by ranking all pairs, for a static N <= STATIC_RANK_MAX_N.

    rank_i = #{j: key_j > key_i} + #{j < i: key_j == key_i} is entry i's place in the stable
    descending order (a permutation of 0..N-1); out[r] = the i whose rank is r. Two reductions, over
    [R, N, N] and [R, k, N] compares (65k and 1.5k a row for the gate's 6 of 256), where the radix
    select takes 8 count-and-update rounds and its compaction. Counts and indices are float32 (exact
    below 2^24): the GPU backends fail on int64 reductions."""
    n = x.shape[-1]
    if not isinstance(n, int) or n > STATIC_RANK_MAX_N:
        raise ValueError(f"topk_rank: needs a static entry count <= {STATIC_RANK_MAX_N}, got {n}")
    if k > n:
        raise ValueError(f"top-k: k={k} is larger than the {n} entries")
    lead = x.shape[:-1]
    rank = pair_rank(_order_key32(x.float().reshape(-1, n)), 1)  # [R, N]
    i = torch.arange(n, dtype=torch.float32, device=x.device)
    hit = rank[:, None, :] == torch.arange(k, dtype=torch.float32, device=x.device)[None, :, None]  # [R, k, N]
    # a select, not hit * i: IREE treats a multiply-sum as a contraction and materializes hit
    out = torch.where(hit, i[None, None, :], 0.0).sum(-1)
    return out.long().view(*lead, k)


def topk_select(x: torch.Tensor, k: int) -> torch.Tensor:
    """The export's top-k: ``topk_rank`` for a static N <= RANK_MAX_N, or N <= STATIC_RANK_MAX_N when
    every leading dim is static too (decode), else ``topk_radix``."""
    n = x.shape[-1]
    static_rows = all(isinstance(d, int) for d in x.shape[:-1])
    ranked = isinstance(n, int) and (n <= RANK_MAX_N or (static_rows and n <= STATIC_RANK_MAX_N))
    return topk_rank(x, k) if ranked else topk_radix(x, k)


@kernel("topk", args={"x": "..., N", "k": int}, results={"indices": "..., k"},
        result_dtypes={"indices": torch.int64}, alternatives={"radix": topk_radix, "select": topk_select})
def topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] (int64) of the k largest entries along the last dim, largest first, ties by index."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


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
    """The model's top-k: the `topk` kernel hook (see the module docstring), recorded for probes."""
    out = topk(x, k)
    if _recording is not None:
        _recording.append((x, out))
    return out
