"""Low-precision encodings: the one module that knows how bytes map to numbers (docs/model.md, Quantization formats and Reference numerics).

Formats handled here:
  * E2M1 (FP4) codes, packed two per byte, LOW nibble = element 2i (the MXFP4 expert checkpoint layout);
  * E8M0 scales (pure exponent, value 2^(byte-127), 0xFF = NaN), stored as torch.uint8 because
    iree-turbine cannot take float8_e8m0fnu parameters (docs/export.md, IREE 3.13 traps);
  * FP8 e4m3fn (OCP: bias 7, max 448, 0x7F/0xFF NaN, 0x80 = -0) and e4m3fnuz (gfx942: bias 8, max 240,
    0x80 = NaN, no -0).

Rules that keep the MI300X bug class (one side writes FNUZ bytes, the other reads them as OCP) out:
  * an FP8 tensor always carries its format as its torch dtype; raw bytes become FP8 only through
    `fp8_from_bytes(raw, fmt)`, which names the format;
  * decoders take the expected format and raise FormatError on any other dtype.

Decoders (`fp8_decode`, `e8m0_decode`, `e2m1_decode`, `unpack_e2m1`, the dequantize helpers) are
export-friendly: integer/bit ops and a float32 bitcast only, no float8 casts (an f8 -> f32 `extf` does
not compile for gfx942 without the emulation flag), no `.item()`, no branching on values.
Encoders and the offline converters (`fp8_fn_to_fnuz`, `mxfp4_to_fp8`) run eagerly on checkpoints and
validate their input, so they may raise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "FormatError",
    "E4M3FN",
    "E4M3FNUZ",
    "FP8_FORMATS",
    "Fp8Format",
    "E2M1_VALUES",
    "E2M1_MAX",
    "E4M3_MAX",
    "MXFP4_BLOCK",
    "FP8_BLOCK",
    "e2m1_encode",
    "e2m1_decode",
    "pack_e2m1",
    "unpack_e2m1",
    "e8m0_decode",
    "e8m0_encode",
    "as_e8m0_bytes",
    "scale_to_float",
    "fp8_encode",
    "fp8_decode",
    "fp8_from_bytes",
    "fp8_fn_to_fnuz",
    "fp8_fnuz_to_fn",
    "mxfp4_to_fp8",
    "dequant_fp8_block",
    "dequant_mxfp4",
]


class FormatError(TypeError):
    """A tensor's storage format (dtype) is not the one the caller asked to decode."""


# --------------------------------------------------------------------------------------------------
# FP8 format descriptions
# --------------------------------------------------------------------------------------------------

E4M3FN = torch.float8_e4m3fn
E4M3FNUZ = torch.float8_e4m3fnuz


@dataclass(frozen=True)
class Fp8Format:
    """The parameters of an e4m3 variant (3 mantissa bits, 4 exponent bits)."""

    dtype: torch.dtype
    bias: int
    max: float
    fnuz: bool  # True: 0x80 is the only NaN and there is no -0

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - 3)


E4M3_MAX = 448.0  # the largest finite e4m3fn value (OCP); the activations' FP8 range
FP8_FORMATS: dict[torch.dtype, Fp8Format] = {
    E4M3FN: Fp8Format(E4M3FN, bias=7, max=E4M3_MAX, fnuz=False),
    E4M3FNUZ: Fp8Format(E4M3FNUZ, bias=8, max=240.0, fnuz=True),
}

FP8_BLOCK = 128  # FP8 weight scales: one per 128x128 block
MXFP4_BLOCK = 32  # MXFP4 scales: one per 32 consecutive K elements

_BYTE_DTYPES = (torch.uint8, torch.int8)


def _fp8_format(fmt: torch.dtype) -> Fp8Format:
    try:
        return FP8_FORMATS[fmt]
    except KeyError:
        raise FormatError(f"not an FP8 format: {fmt}; expected one of {list(FP8_FORMATS)}") from None


def _check_fp8(t: torch.Tensor, fmt: torch.dtype, what: str) -> Fp8Format:
    """Raise FormatError unless `t` is stored as `fmt` (names the likely mix-up in the message)."""
    spec = _fp8_format(fmt)
    if t.dtype == fmt:
        return spec
    if t.dtype in FP8_FORMATS:
        raise FormatError(
            f"{what}: tensor is {t.dtype} but is being decoded as {fmt}. The two e4m3 variants share "
            f"bits but not values (bias 7 vs 8, different NaN/-0 codes); convert explicitly with "
            f"fp8_fn_to_fnuz / fp8_fnuz_to_fn (which also rescale the block scale)."
        )
    if t.dtype in _BYTE_DTYPES:
        raise FormatError(
            f"{what}: got raw {t.dtype} bytes where {fmt} was expected; name the format explicitly "
            f"with fp8_from_bytes(raw, {fmt})."
        )
    raise FormatError(f"{what}: expected an FP8 tensor of dtype {fmt}, got {t.dtype}")


def _as_bytes_i32(t: torch.Tensor) -> torch.Tensor:
    """uint8/int8 storage (or any 1-byte dtype) -> int32 holding the unsigned byte value 0..255."""
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    return t.to(torch.int32)


def _f32_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


# --------------------------------------------------------------------------------------------------
# E2M1 (FP4)
# --------------------------------------------------------------------------------------------------

E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
E2M1_MAX = 6.0


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Float -> E2M1 codes (uint8 0..15, bit 3 = sign): round to nearest, ties to even code, saturate at +-6.

    Eager/offline helper (used to build test and converted weights); NaN has no E2M1 code -> raises.
    """
    x = x.float()
    if torch.isnan(x).any():
        raise ValueError("e2m1_encode: NaN has no E2M1 encoding")
    a = x.abs().clamp(max=E2M1_MAX)
    # grid step per binade: 0.5 below 2, 1 in [2, 4), 2 in [4, 6]; round() is half-to-even and the
    # even multiple of the step is always the even code here
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    v = torch.round(a / step) * step
    mag = torch.where(v < 2.0, v * 2.0, torch.where(v < 4.0, v + 2.0, v * 0.5 + 4.0))
    code = mag.to(torch.int32) | (torch.signbit(x).to(torch.int32) << 3)
    return code.to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (low 4 bits of any integer tensor) -> float32, with bit ops only (no table, no fp4 dtype)."""
    c = codes.to(torch.int32)
    sign = (c >> 3) & 1
    e = (c >> 1) & 3
    m = c & 1
    # e>0: 2^(e-1) * (1 + m/2) -> float32 exponent field e-1+127, mantissa top bit m
    normal = _f32_from_bits(((e + 126) << 23) | (m << 22))
    mag = torch.where(e == 0, m.to(torch.float32) * 0.5, normal)
    return torch.where(sign == 1, -mag, mag)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes [..., K] -> uint8 [..., K/2]; element 2i in the LOW nibble, 2i+1 in the high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: last dim must be even, got {codes.shape[-1]}")
    c = codes.to(torch.int32) & 0xF
    pairs = c.unflatten(-1, (-1, 2))
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8/int8 [..., K/2] -> E2M1 codes int32 [..., K] (low nibble first), export-friendly bit ops."""
    p = _as_bytes_i32(packed)
    return torch.stack([p & 0xF, (p >> 4) & 0xF], dim=-1).flatten(-2)


# --------------------------------------------------------------------------------------------------
# E8M0 scales
# --------------------------------------------------------------------------------------------------


def as_e8m0_bytes(t: torch.Tensor) -> torch.Tensor:
    """E8M0 scale tensor -> its uint8 bytes; accepts uint8 or float8_e8m0fnu (viewed, no data movement)."""
    if t.dtype == torch.uint8:
        return t
    if t.dtype == torch.float8_e8m0fnu:
        return t.view(torch.uint8)
    raise FormatError(f"E8M0 scales must be uint8 or float8_e8m0fnu, got {t.dtype}")


def e8m0_decode(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 2^(b-127) (b=0 -> 2^-127, a float32 subnormal; 0xFF -> NaN), bit ops only.

    Written as an exponent-field bitcast rather than exp2 so it is exact on every backend.
    """
    b = _as_bytes_i32(as_e8m0_bytes(scale))
    bits = torch.where(b == 0, 1 << 22, b << 23)
    return torch.where(b == 0xFF, float("nan"), _f32_from_bits(bits))


def e8m0_encode(x: torch.Tensor, *, round_up: bool = False) -> torch.Tensor:
    """Power-of-two floats -> E8M0 bytes (uint8). Exact; raises on non-powers of two unless round_up
    (then the next power of two above). Raises on <=0, inf, NaN and on values outside 2^-127..2^127."""
    xd = x.double()
    if not torch.isfinite(xd).all() or (xd <= 0).any():
        raise ValueError("e8m0_encode: scales must be finite and > 0")
    m, e = torch.frexp(xd)  # x = m * 2^e, m in [0.5, 1)
    exact = m == 0.5
    if not round_up and not exact.all():
        bad = xd[~exact].flatten()[:4].tolist()
        raise ValueError(f"e8m0_encode: not a power of two: {bad} (pass round_up=True to round up)")
    b = torch.where(exact, e - 1, e).to(torch.int64) + 127
    if (b < 0).any() or (b > 254).any():
        raise ValueError("e8m0_encode: scale outside the E8M0 range 2^-127..2^127")
    return b.to(torch.uint8)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A dequant scale as float32: E8M0 (uint8 / float8_e8m0fnu) decoded, float32 passed through."""
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        return e8m0_decode(scale)
    if scale.dtype == torch.float32:
        return scale
    raise FormatError(f"scales must be uint8/float8_e8m0fnu (E8M0) or float32, got {scale.dtype}")


# --------------------------------------------------------------------------------------------------
# FP8 e4m3fn / e4m3fnuz
# --------------------------------------------------------------------------------------------------


def fp8_encode(x: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """Float -> FP8 tensor of dtype `fmt`: round to nearest even, saturate at +-max (inf included), NaN -> NaN.

    Input is taken as float32 (float64 is rounded to float32 first, as torch's own cast does). The
    clamp matters: torch's fnuz cast turns out-of-range values into NaN instead of saturating.
    Eager helper; in-graph code should quantize in the value domain (quant_sim.round_to_e4m3).
    """
    spec = _fp8_format(fmt)
    return x.float().clamp(-spec.max, spec.max).to(fmt)


def fp8_decode(t: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """FP8 tensor stored as `fmt` -> float32, bit-exact with torch's own dtype conversion.

    Raises FormatError if `t` is the other e4m3 variant or raw bytes (the fn/fnuz mix-up). Pure
    integer ops + a float32 bitcast, so IREE compiles it for any target (no f8 `extf`).
    """
    spec = _check_fp8(t, fmt, "fp8_decode")
    b = _as_bytes_i32(t)
    sign = (b >> 7) & 1
    e = (b >> 3) & 0xF
    m = b & 7
    normal = _f32_from_bits(((e + (127 - spec.bias)) << 23) | (m << 20))
    subnormal = m.to(torch.float32) * spec.min_subnormal
    mag = torch.where(e == 0, subnormal, normal)
    val = torch.where(sign == 1, -mag, mag)
    nan = (b == 0x80) if spec.fnuz else ((b & 0x7F) == 0x7F)
    return torch.where(nan, float("nan"), val)


def fp8_from_bytes(raw: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """Reinterpret raw uint8/int8 bytes as FP8 format `fmt` (a view). The only sanctioned way to give
    untyped bytes an FP8 meaning: the caller must name the format."""
    _fp8_format(fmt)
    if raw.dtype not in _BYTE_DTYPES:
        raise FormatError(f"fp8_from_bytes: expected uint8/int8 bytes, got {raw.dtype}")
    return raw.view(torch.uint8).view(fmt)


def _scale_times_pow2(scale: torch.Tensor, k: int, what: str) -> torch.Tensor:
    """Multiply a dequant scale by 2^k (k = +-1) exactly: E8M0 byte + k, or float32 * 2^k."""
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        b = as_e8m0_bytes(scale).to(torch.int16)
        if (b == 0xFF).any():
            raise ValueError(f"{what}: scale has NaN (0xFF) E8M0 bytes")
        nb = b + k
        if (nb < 0).any() or (nb > 254).any():
            raise ValueError(f"{what}: E8M0 scale out of range after x2^{k} (byte 0xFE cannot double, 0x00 cannot halve)")
        return nb.to(torch.uint8)
    if scale.dtype == torch.float32:
        out = scale * (2.0**k)
        if not torch.isfinite(out).all() or not torch.equal(out * (2.0**-k), scale):
            raise ValueError(f"{what}: float32 scale x2^{k} overflows or loses bits")
        return out
    raise FormatError(f"{what}: scales must be uint8/float8_e8m0fnu (E8M0) or float32, got {scale.dtype}")


def fp8_fn_to_fnuz(weight_fn: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP e4m3fn weight + dequant scale -> e4m3fnuz weight + scale for gfx942 (native fnuz), same values.

    Why this is a bit reinterpretation: both formats are sign/4-bit exponent/3-bit mantissa; fnuz has
    exponent bias 8 instead of 7, so the same bits mean exactly half the value (normals and subnormals
    alike). Doubling the scale (E8M0 byte + 1, float32 x2, both exact) restores every product
    fp8 * scale. All finite fn codes map to finite fnuz codes: fn's max 0x7E = 448 becomes 224 <= 240,
    and fnuz's only extra finite codes (0x7F/0xFF = +-240) are never produced. Special codes:
    fn 0x80 (-0) is NaN in fnuz, so it becomes 0x00 (+0, same product); fn NaN (0x7F/0xFF) raises.
    A scale that cannot double (E8M0 0xFE, float32 overflow) or is NaN raises.
    Scales are returned as uint8 (E8M0) or float32, whatever the input kind was.
    """
    _check_fp8(weight_fn, E4M3FN, "fp8_fn_to_fnuz")
    b = weight_fn.view(torch.uint8)
    if ((b & 0x7F) == 0x7F).any():
        raise ValueError("fp8_fn_to_fnuz: weight contains e4m3fn NaN codes (0x7F/0xFF)")
    b = torch.where(b == 0x80, torch.zeros_like(b), b)
    return b.view(E4M3FNUZ), _scale_times_pow2(scale, 1, "fp8_fn_to_fnuz")


def fp8_fnuz_to_fn(weight_fnuz: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of fp8_fn_to_fnuz: same bits, value doubles, scale halves (E8M0 byte - 1, float32 / 2).

    Raises on fnuz NaN (0x80), on +-240 (0x7F/0xFF: 480 is past fn's 448 and those bits are NaN in
    fn), and on scales that cannot halve exactly (E8M0 0x00, float32 losing a bit).
    """
    _check_fp8(weight_fnuz, E4M3FNUZ, "fp8_fnuz_to_fn")
    b = weight_fnuz.view(torch.uint8)
    if (b == 0x80).any():
        raise ValueError("fp8_fnuz_to_fn: weight contains the e4m3fnuz NaN code (0x80)")
    if ((b & 0x7F) == 0x7F).any():
        raise ValueError("fp8_fnuz_to_fn: +-240 (0x7F/0xFF) has no e4m3fn counterpart (would be NaN)")
    return b.view(E4M3FN), _scale_times_pow2(scale, -1, "fp8_fnuz_to_fn")


# --------------------------------------------------------------------------------------------------
# Block-scaled dequantization and MXFP4 -> FP8 re-encoding
# --------------------------------------------------------------------------------------------------


def _expand_block_scale(s: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """[..., ceil(n/block), ceil(k/block)] -> [..., n, k] by repetition (expand+reshape: static, export-friendly)."""
    *lead, nb, kb = s.shape
    s = s[..., :, None, :, None].expand(*lead, nb, block, kb, block)
    return s.reshape(*lead, nb * block, kb * block)[..., :n, :k]


def _check_block_scale_shape(scale: torch.Tensor, lead: tuple[int, ...], n: int, k: int, block: int,
                             what: str) -> None:
    want = (*lead, math.ceil(n / block), math.ceil(k / block))
    if tuple(scale.shape) != want:
        raise ValueError(f"{what}: scale shape {tuple(scale.shape)} != {want} for weight {[*lead, n, k]} (block {block})")


def dequant_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """FP8 weight [..., N, K] (e4m3fn or e4m3fnuz, per its dtype) x block scale [..., ceil(N/b), ceil(K/b)]
    (E8M0 uint8 or float32) -> float32 [..., N, K]: W[o,k] = fp8[o,k] * scale[o//b, k//b] (docs/model.md, Quantization formats).
    Leading dims (stacked experts) carry their own scales."""
    if weight.dtype not in FP8_FORMATS:
        _check_fp8(weight, E4M3FN, "dequant_fp8_block")  # raises with the right message
    if weight.dim() < 2:
        raise ValueError(f"dequant_fp8_block: weight must be [..., N, K], got {tuple(weight.shape)}")
    *lead, n, k = weight.shape
    _check_block_scale_shape(scale, tuple(lead), n, k, block, "dequant_fp8_block")
    w = fp8_decode(weight, weight.dtype)
    return w * _expand_block_scale(scale_to_float(scale), n, k, block)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 packed [..., N, K/2] (uint8/int8) + E8M0 scale [..., N, K/32] -> float32 [..., N, K] (docs/model.md, Quantization formats)."""
    if packed.dtype not in _BYTE_DTYPES:
        raise FormatError(f"dequant_mxfp4: packed weight must be uint8/int8, got {packed.dtype}")
    if packed.dim() < 2:
        raise ValueError(f"dequant_mxfp4: packed weight must be [..., N, K/2], got {tuple(packed.shape)}")
    k = packed.shape[-1] * 2
    want = (*packed.shape[:-1], k // MXFP4_BLOCK)
    if k % MXFP4_BLOCK or tuple(scale.shape) != want:
        raise ValueError(f"dequant_mxfp4: scale shape {tuple(scale.shape)} != {want} for K={k}")
    v = e2m1_decode(unpack_e2m1(packed))
    s = e8m0_decode(scale)
    return (v.unflatten(-1, (-1, MXFP4_BLOCK)) * s[..., None]).flatten(-2)


def mxfp4_to_fp8(
    packed: torch.Tensor, scale: torch.Tensor, *, block: int = FP8_BLOCK, strict: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 [N, K/2] + E8M0 [N, K/32] -> e4m3fn [N, K] + E8M0 uint8 [ceil(N/128), ceil(K/128)]
    (convert.py --expert-dtype fp8, docs/model.md, Quantization formats).

    Per 128x128 block: new scale byte = max(sub-scale bytes) - 6 (i.e. max/2^6, clamped at byte 0),
    values = fp4 * 2^(sub - new). The shift d = sub - new is <= 6, so |values| <= 6 * 2^6 = 384 <= 448.
    When it is exact: an FP4 magnitude is a*2^p with a in {1, 3}, p >= -1; a*2^(p+d) is an e4m3fn value
    iff p + d >= -9 (its smallest subnormal is 2^-9). So every element is exact when each per-32
    sub-scale is at least 2^-14 of its block's largest (d >= -8); further below, small codes round
    (RNE) or flush to 0. strict=True raises if any element is inexact.
    """
    codes = unpack_e2m1(packed)
    n, k = codes.shape
    sb = as_e8m0_bytes(scale).to(torch.int32)
    if k % MXFP4_BLOCK or block % MXFP4_BLOCK or tuple(sb.shape) != (n, k // MXFP4_BLOCK):
        raise ValueError(f"mxfp4_to_fp8: scale shape {tuple(sb.shape)} != {(n, k // MXFP4_BLOCK)} for K={k}")
    if (sb == 0xFF).any():
        raise ValueError("mxfp4_to_fp8: NaN (0xFF) E8M0 sub-scales")
    nb, kb = math.ceil(n / block), math.ceil(k / block)
    per = block // MXFP4_BLOCK
    padded = F.pad(sb, (0, kb * per - sb.shape[1], 0, nb * block - n))  # 0 bytes never raise a max
    new = (padded.view(nb, block, kb, per).amax(dim=(1, 3)) - 6).clamp_min(0)  # [nb, kb]
    new_per_sub = new.repeat_interleave(block, 0)[:n].repeat_interleave(per, 1)[:, : sb.shape[1]]
    d = (sb - new_per_sub).double()
    vals = e2m1_decode(codes).double().unflatten(-1, (-1, MXFP4_BLOCK)) * torch.exp2(d)[..., None]
    vals = vals.flatten(-2)
    w = fp8_encode(vals, E4M3FN)
    if strict:
        bad = int((fp8_decode(w, E4M3FN).double() != vals).sum())
        if bad:
            raise ValueError(f"mxfp4_to_fp8: {bad} of {vals.numel()} values are not exact in e4m3fn")
    return w, new.to(torch.uint8)
