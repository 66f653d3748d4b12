"""Token choice inside the compiled module: the ``sample_bs{N}`` entry points.

    sample(logits f32[N,V], temperature f32[N], top_k i64[N], top_p f32[N], key i64[N]) -> ids i64[N]

(-1 for a row whose logits are not all finite, as the step's own argmax: the runtime raises.)

Why: a sampled request otherwise reads its row of logits back to the host every step (Flash's
129,280 x 4 B per row, 33 MB at batch 64) and sorts it there. Called on the decode's logits, which
stay on the device, the host sends five numbers per row and reads one id back.

Row by row, the filters of the host sampler (runtime/sampling.py), with no sort:
- temperature 0: the first argmax (greedy);
- top-k: the k-th largest scaled logit, searched RADIX_BITS bits at a time over its order key (each
  round counts the tokens at or above every candidate digit at once; exact: the threshold is one of
  the row's own values); every token at or above it kept;
- top-p: the largest probability threshold whose kept mass still reaches top_p of the top-k mass
  (the same search over 31 bits: probabilities are non-negative, so their order keys fit in 31 bits);
- the draw, Gumbel-max: the argmax over kept tokens of x/T + G_i, G_i = -log(-log(u_i)), an exact
  sample from softmax(x/T) restricted to the kept set. u_i comes from a counter hash of (key, i),
  so a row's token depends only on its logits and its 32-bit key (the host draws one per token from
  the request's seed): batched and solo runs pick the same token.
The kept sets differ from the host sampler's only at exact ties with a threshold (the host keeps the
lower ids, this keeps every tied token) and, for top-p, where float32 and float64 mass sums fall on
different sides of top_p. Counts and sums run in float32: the GPU backends fail on int64
reductions (kernels/topk.py).

Every vocabulary-long reduction runs in two levels, over the row cut into up to PIECES pieces: a GPU
gives each (row, piece) its own workgroup, where a row-long reduction gets one workgroup per row
(measured on the H200 with the sampler alone at Flash's vocabulary: docs/performance.md).
"""

from __future__ import annotations

import torch

from .kernels.topk import _order_key
from .kernels.barrier import fusion_barrier

__all__ = ["sample", "kept", "gumbel", "hash_uniform", "all_finite", "first_argmax"]

_M32 = 0xFFFFFFFF


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    # a tensor shift: spelled with int64 `//` and `%`, as torch-mlir lowers them, the hash came out
    # wrong on llvm-cpu for 32-bit inputs (14 of 8,192 values in one test); `x >> s` (a scalar
    # shift) does not lower at all. Tensor shifts and masks are exact.
    return torch.bitwise_right_shift(x, torch.tensor(s, dtype=torch.int64))


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """x * m mod 2^32 for x in [0, 2^32) held in int64, with no int64 overflow (16-bit halves)."""
    lo = torch.bitwise_and(x, 0xFFFF) * m
    hi = torch.bitwise_and(_shr(x, 16) * m, 0xFFFF)
    return torch.bitwise_and(lo + hi * 65536, _M32)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (the "lowbias32" constants): a bijection of [0, 2^32)."""
    x = torch.bitwise_xor(x, _shr(x, 16))
    x = _mul32(x, 0x7FEB352D)
    x = torch.bitwise_xor(x, _shr(x, 15))
    x = _mul32(x, 0x846CA68B)
    return torch.bitwise_xor(x, _shr(x, 16))


def hash_uniform(key: torch.Tensor, n: int) -> torch.Tensor:
    """[R, n] float32 uniforms in (0, 1), row r from key[r] (int64, its low 32 bits used): u_i =
    (top 23 bits of mix(mix(key) + i) + 1/2) / 2^23, exact in float32 whether or not the compiler
    fuses the multiply-add. Distinct i give distinct hashes (mix is a bijection)."""
    idx = torch.arange(n, dtype=torch.int64, device=key.device)
    h = _mix32(torch.bitwise_and(_mix32(torch.bitwise_and(key.reshape(-1, 1), _M32)) + idx, _M32))
    return (_shr(h, 9).float() + 0.5) * (1.0 / 2**23)


PIECES = 128  # Flash's vocabulary, 129,280 = 128 x 1,010
RADIX_BITS = 4


def _pieces(x: torch.Tensor, fill: float) -> torch.Tensor:
    """[R, V] -> [R, P, ceil(V / P)], the tail padded with `fill`: P = PIECES, fewer for a vocabulary
    under 64 x PIECES (pieces of at least 64)."""
    r, v = x.shape
    p = max(1, min(PIECES, v // 64))
    if v % p:
        x = torch.nn.functional.pad(x, (0, p - v % p), value=fill)
    return x.reshape(r, p, -1)


def _row_sum(x: torch.Tensor) -> torch.Tensor:
    return _pieces(x, 0.0).sum(-1).sum(-1, keepdim=True)


def _row_max(x: torch.Tensor) -> torch.Tensor:
    return _pieces(x, float("-inf")).amax(-1).amax(-1, keepdim=True)


def first_argmax(x: torch.Tensor, two_level: bool = True) -> torch.Tensor:
    """torch.argmax(x, -1, keepdim=True) (the first maximal index, [R, 1]) as a max and a min reduction,
    each in two levels over PIECES pieces (one workgroup per row would read the whole vocabulary);
    `two_level=False`: one level each.

    Why not aten.argmax: IREE 3.13's gfx942 backend fails on it ("'func.func' op failed to
    distribute"), and the CUDA backend (sm_89) fails the same way on an int64 min reduction, so the
    index minimum runs in float32. Rows without a maximum (all NaN) give the last index."""
    n = x.shape[-1]
    cols = torch.arange(n, device=x.device, dtype=torch.float32)  # exact below 2^24
    if not two_level:
        hit = x == x.amax(-1, keepdim=True)
        return torch.where(hit, cols, float(n)).amin(-1, keepdim=True).clamp(max=n - 1).long()
    idx = torch.where(x == _row_max(x), cols, float(n))
    return _pieces(idx, float(n)).amin(-1).amin(-1, keepdim=True).clamp(max=n - 1).long()


def all_finite(x: torch.Tensor) -> torch.Tensor:
    """[R] bool: no NaN or inf in row r of x [R, V] (the row sum is finite; aten.isfinite does not
    lower in torch-mlir, an ordered compare with inf does: false for NaN and inf)."""
    return _row_sum(x.float())[:, 0].abs() < float("inf")


def _threshold(key: torch.Tensor, weight: torch.Tensor, need: torch.Tensor, bits: int) -> torch.Tensor:
    """Per row, the largest t in [0, 2^bits) with sum(weight[key >= t]) >= need[row] (key: order keys,
    int64 [R, V]; weight float32 [R, V] >= 0; need float32 [R, 1]); 0 when no t qualifies.
    RADIX_BITS bits a round from the top: the sum falls as t grows, so the largest digit whose
    candidate still qualifies is the count of candidates that do (one [R, digits] reduction)."""
    kp, wp = _pieces(key, -1), _pieces(weight, 0.0)  # padding: never >= a candidate (all >= 1), no weight
    t = torch.zeros_like(key[:, :1])
    hi = bits
    while hi > 0:
        lo = hi - (hi % RADIX_BITS or RADIX_BITS)
        c = t + torch.arange(1, 2 ** (hi - lo), dtype=key.dtype, device=key.device) * 2 ** lo  # [R, digits]
        s = torch.where(kp[:, None] >= c[:, :, None, None], wp[:, None], 0.0).sum(-1).sum(-1)
        t = t + (s >= need).float().sum(-1, keepdim=True).long() * 2 ** lo
        hi = lo
    return t


def kept(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The filters of `sample` without the draw: (scaled logits x/T [N, V], kept tokens [N, V] bool,
    sampled rows [N, 1] bool (temperature > 0)). The sampling distribution of a sampled row is
    softmax(x/T) over its kept tokens (model/speculative.py reads it directly)."""
    x = logits.float()
    n, v = x.shape
    temp = temperature.float().reshape(n, 1)
    hot = temp > 0
    # in a dispatch of its own: multi-use fusion (export/compile.py) put x / T, which is also stored, into
    # the row maximum below, and the cuda and gfx942 code of that failed to distribute (the tiny model's 512 words)
    xs = fusion_barrier(x / torch.where(hot, temp, 1.0))
    # top-k: the k-th largest order key; every token at or above it stays
    k = top_k.reshape(n, 1)
    k = torch.where(torch.logical_and(k > 0, k < v), k, v).float()
    ks = _order_key(xs)
    keep = ks >= _threshold(ks, torch.ones_like(xs), k, 32)
    # top-p over the renormalised top-k set: probabilities >= 0 order as their float32 bits
    p = torch.where(keep, torch.exp(xs - _row_max(xs)), 0.0)
    tp = top_p.float().reshape(n, 1)
    need = tp * _row_sum(p)
    pk = _order_key(p) - 2**31  # [0, 2^31) for p >= 0
    keep = torch.logical_and(keep, torch.logical_or(tp >= 1.0, pk >= _threshold(pk, p, need, 31)))
    return xs, keep, hot


def gumbel(u: torch.Tensor) -> torch.Tensor:
    """Gumbel noise -log(-log(u)) of uniforms u in (0, 1)."""
    return -torch.log(-torch.log(u))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           key: torch.Tensor) -> torch.Tensor:
    """ids [N] (int64): one token per row of logits [N, V] (the module docstring has the rules), -1
    where a row holds NaN or inf.
    temperature <= 0 is greedy; top_k <= 0 or >= V and top_p >= 1 switch those filters off."""
    x = logits.float()
    xs, keep, hot = kept(x, temperature, top_k, top_p)
    g = gumbel(hash_uniform(key, x.shape[1]))
    drawn = first_argmax(torch.where(keep, xs + g, float("-inf")))
    ids = torch.where(hot, drawn, first_argmax(x))
    return torch.where(all_finite(x)[:, None], ids, -1).reshape(x.shape[0])  # -1: non-finite logits
