"""model/quant/formats.py against independent references: the formats' definitions evaluated in float64
Python, nearest-value rounding by exhaustive search (ties to the even code), torch's own dtypes,
and hand-written known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dsv4.model.quant.formats import (
    E4M3FN,
    E4M3FNUZ,
    FormatError,
    as_e8m0_bytes,
    dequant_fp8_block,
    dequant_mxfp4,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    e8m0_encode,
    fp8_decode,
    fp8_encode,
    fp8_fn_to_fnuz,
    fp8_fnuz_to_fn,
    fp8_from_bytes,
    mxfp4_to_fp8,
    pack_e2m1,
    unpack_e2m1,
)

NAN = float("nan")
ALL_BYTES = torch.arange(256, dtype=torch.int32).to(torch.uint8)

# ---------------------------------------------------------------------------------------------
# independent float64 definitions
# ---------------------------------------------------------------------------------------------

# (bias, fnuz) straight from the format definitions
FP8_DEFS = {E4M3FN: (7, False), E4M3FNUZ: (8, True)}
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def fp8_value(code: int, fmt: torch.dtype) -> float:
    bias, fnuz = FP8_DEFS[fmt]
    if (fnuz and code == 0x80) or (not fnuz and code & 0x7F == 0x7F):
        return NAN
    e, m = (code >> 3) & 15, code & 7
    mag = (m / 8) * 2.0 ** (1 - bias) if e == 0 else (1 + m / 8) * 2.0 ** (e - bias)
    return -mag if code & 0x80 else mag


def magnitude_table(fmt) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative finite values of a format and their codes, ascending."""
    if fmt == "e2m1":
        codes = np.arange(8)
        vals = np.array(E2M1_TABLE[:8])
    else:
        codes = np.array([c for c in range(128) if not math.isnan(fp8_value(c, fmt))])
        vals = np.array([fp8_value(int(c), fmt) for c in codes])
    assert np.all(np.diff(vals) > 0)
    return vals, codes


def ref_encode(x: np.ndarray, fmt) -> np.ndarray:
    """Nearest representable value (saturating), ties to the even code; returns codes (-1 for NaN)."""
    vals, codes = magnitude_table(fmt)
    a = np.minimum(np.abs(x), vals[-1])
    d = np.abs(a[:, None] - vals[None, :])
    best = d.min(axis=1, keepdims=True)
    cand = np.where(d == best, codes[None, :], 10**6)
    # at most two candidates; prefer the even one
    even = np.where(cand % 2 == 0, cand, 10**6).min(axis=1)
    mag = np.where(even < 10**6, even, cand.min(axis=1))
    neg = np.signbit(x)
    if fmt == "e2m1":
        out = mag | (neg * 8)
    elif fmt == E4M3FNUZ:
        out = mag | np.where(mag == 0, 0, neg * 0x80)  # no -0 in fnuz
    else:
        out = mag | (neg * 0x80)
    return np.where(np.isnan(x), -1, out)


def grid_and_ties(fmt, beyond: float) -> np.ndarray:
    """All grid values, all midpoints, midpoints +- one float32 ulp, both signs, plus far values."""
    vals, _ = magnitude_table(fmt)
    mids = (vals[:-1] + vals[1:]) / 2
    m32 = mids.astype(np.float32)
    near = np.concatenate([np.nextafter(m32, np.float32(0)), np.nextafter(m32, np.float32(np.inf))])
    pos = np.concatenate([vals, mids, near, [vals[-1] * 1.0001, beyond, 1e30, np.inf, vals[1] / 4]])
    return np.concatenate([pos, -pos]).astype(np.float32)


def log_uniform(n: int, lo: float, hi: float, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    mag = np.exp2(g.uniform(lo, hi, n))
    return (mag * g.choice([-1.0, 1.0], n)).astype(np.float32)


def f32_bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().view(torch.int32)


# ---------------------------------------------------------------------------------------------
# FP8
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [E4M3FN, E4M3FNUZ])
def test_fp8_decode_all_codes_matches_definition_and_torch(fmt):
    t = ALL_BYTES.view(fmt)
    got = fp8_decode(t, fmt)
    assert got.dtype == torch.float32
    ref = torch.tensor([fp8_value(c, fmt) for c in range(256)], dtype=torch.float64)
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(f32_bits(got)[~nan], f32_bits(ref.float())[~nan])  # signs of zero included
    tor = t.float()  # torch's own conversion
    assert torch.equal(torch.isnan(tor), nan)
    assert torch.equal(f32_bits(got)[~nan], f32_bits(tor)[~nan])


def test_fp8_known_codes():
    fn = fp8_decode(torch.tensor([0x7E, 0x80, 0x7F, 0x01, 0x08, 0x38], dtype=torch.uint8).view(E4M3FN), E4M3FN)
    assert fn[0] == 448 and torch.signbit(fn[1]) and fn[1] == 0 and torch.isnan(fn[2])
    assert fn[3] == 2.0**-9 and fn[4] == 2.0**-6 and fn[5] == 1.0
    uz = fp8_decode(torch.tensor([0x7F, 0x80, 0x00, 0x01, 0x40], dtype=torch.uint8).view(E4M3FNUZ), E4M3FNUZ)
    assert uz[0] == 240 and torch.isnan(uz[1]) and uz[2] == 0 and uz[3] == 2.0**-10 and uz[4] == 1.0


@pytest.mark.parametrize("fmt", [E4M3FN, E4M3FNUZ])
def test_fp8_encode_all_codes_roundtrip(fmt):
    vals = ALL_BYTES.view(fmt).float()
    ok = ~torch.isnan(vals)
    codes = fp8_encode(vals[ok], fmt)
    assert codes.dtype == fmt
    assert torch.equal(codes.view(torch.uint8), ALL_BYTES[ok])


@pytest.mark.parametrize("fmt,beyond", [(E4M3FN, 464.0), (E4M3FNUZ, 248.0)])
def test_fp8_encode_matches_nearest_even_reference(fmt, beyond):
    # edge values: whole grid (subnormals, max, -0), every tie and its neighbours, past saturation
    # (beyond = the would-be tie with the next binade), inf; plus random log-uniform values
    x = np.concatenate([grid_and_ties(fmt, beyond), log_uniform(20000, -14, 10, seed=1), [0.0, -0.0]])
    x = x.astype(np.float32)
    got = fp8_encode(torch.from_numpy(x), fmt)
    ref = ref_encode(x.astype(np.float64), fmt)
    assert np.array_equal(got.view(torch.uint8).numpy().astype(np.int64), ref)
    # decode(encode(x)) is the rounded value: error at most half a grid step, x itself when on grid
    dec = fp8_decode(got, fmt).double().numpy()
    mx = magnitude_table(fmt)[0][-1]
    xc = np.clip(x.astype(np.float64), -mx, mx)
    step = np.maximum(2.0 ** (np.floor(np.log2(np.maximum(np.abs(xc), 2.0 ** (1 - FP8_DEFS[fmt][0])))) - 3), 0)
    assert np.all(np.abs(dec - xc) <= step / 2)
    # and torch's own (clamped) cast agrees bit for bit
    assert torch.equal(got.view(torch.uint8), torch.from_numpy(x).clamp(-mx, mx).to(fmt).view(torch.uint8))


@pytest.mark.parametrize("fmt", [E4M3FN, E4M3FNUZ])
def test_fp8_encode_specials(fmt):
    x = torch.tensor([NAN, -0.0, float("inf"), -float("inf"), 1e-30, -1e-30])
    enc = fp8_encode(x, fmt)
    dec = fp8_decode(enc, fmt)
    mx = 448.0 if fmt == E4M3FN else 240.0
    assert torch.isnan(dec[0])
    assert dec[2] == mx and dec[3] == -mx and dec[4] == 0 and dec[5] == 0
    b = enc.view(torch.uint8)
    if fmt == E4M3FN:
        assert b[1] == 0x80 and b[5] == 0x80  # -0 kept
    else:
        assert b[1] == 0x00 and b[5] == 0x00 and b[0] == 0x80  # no -0 in fnuz; 0x80 is NaN


def test_fp8_cross_format_misuse_raises():
    fn = fp8_encode(torch.tensor([1.0, 2.0]), E4M3FN)
    uz = fp8_encode(torch.tensor([1.0, 2.0]), E4M3FNUZ)
    with pytest.raises(FormatError, match="fp8_fn_to_fnuz"):
        fp8_decode(uz, E4M3FN)  # FNUZ writer, OCP reader
    with pytest.raises(FormatError):
        fp8_decode(fn, E4M3FNUZ)
    with pytest.raises(FormatError, match="fp8_from_bytes"):
        fp8_decode(fn.view(torch.uint8), E4M3FN)  # untyped bytes
    with pytest.raises(FormatError):
        fp8_decode(torch.tensor([1.0]), E4M3FN)
    with pytest.raises(FormatError):
        fp8_decode(fn, torch.float16)  # not an FP8 format
    with pytest.raises(FormatError):
        dequant_fp8_block(torch.zeros(4, 4, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.uint8))
    with pytest.raises(FormatError):
        fp8_fn_to_fnuz(uz, torch.zeros(1, 1, dtype=torch.uint8))
    with pytest.raises(FormatError):
        fp8_fnuz_to_fn(fn, torch.zeros(1, 1, dtype=torch.uint8))
    # the sanctioned way: name the format
    raw = torch.tensor([0x38, 0x40], dtype=torch.uint8)
    assert fp8_decode(fp8_from_bytes(raw, E4M3FN), E4M3FN).tolist() == [1.0, 2.0]
    assert fp8_decode(fp8_from_bytes(raw, E4M3FNUZ), E4M3FNUZ).tolist() == [0.5, 1.0]
    assert fp8_from_bytes(raw.view(torch.int8), E4M3FN).dtype == E4M3FN
    with pytest.raises(FormatError):
        fp8_from_bytes(torch.tensor([1.0]), E4M3FN)


# ---------------------------------------------------------------------------------------------
# fn <-> fnuz
# ---------------------------------------------------------------------------------------------


def _byte_scale_values(b: list[int]) -> list[float]:
    return [2.0 ** (x - 127) for x in b]


@pytest.mark.parametrize(
    "scale",
    [
        torch.tensor([[1, 100], [127, 130], [200, 253]], dtype=torch.uint8),
        torch.tensor([[1.0, 0.37], [3e-5, 1e30], [2.0**-120, 5.5]], dtype=torch.float32),
    ],
)
def test_fn_to_fnuz_preserves_values_all_codes(scale):
    # weight [3*128, 2*128] holding every non-NaN fn code in every block
    codes = [c for c in range(256) if c & 0x7F != 0x7F]
    w = torch.tensor(codes, dtype=torch.uint8).repeat(384 * 256 // len(codes) + 1)[: 384 * 256]
    w_fn = w.reshape(384, 256).view(E4M3FN)
    w_uz, s_uz = fp8_fn_to_fnuz(w_fn, scale)
    assert w_uz.dtype == E4M3FNUZ and s_uz.dtype == scale.dtype
    # float64 reference products from the definitions
    if scale.dtype == torch.uint8:
        s_fn64 = torch.tensor([_byte_scale_values(r) for r in scale.tolist()], dtype=torch.float64)
        s_uz64 = torch.tensor([_byte_scale_values(r) for r in s_uz.tolist()], dtype=torch.float64)
    else:
        s_fn64, s_uz64 = scale.double(), s_uz.double()
    lut_fn = torch.tensor([fp8_value(c, E4M3FN) for c in range(256)], dtype=torch.float64)
    lut_uz = torch.tensor([fp8_value(c, E4M3FNUZ) for c in range(256)], dtype=torch.float64)
    exp = lambda s: s.repeat_interleave(128, 0).repeat_interleave(128, 1)  # noqa: E731
    v_fn = lut_fn[w_fn.view(torch.uint8).long()] * exp(s_fn64)
    v_uz = lut_uz[w_uz.view(torch.uint8).long()] * exp(s_uz64)
    assert not torch.isnan(v_uz).any()
    assert torch.equal(v_fn, v_uz)
    # the library's own dequant agrees, too
    assert torch.equal(dequant_fp8_block(w_fn, scale), dequant_fp8_block(w_uz, s_uz))
    # -0 (0x80) became +0, all other bits unchanged
    b_in, b_out = w_fn.view(torch.uint8), w_uz.view(torch.uint8)
    assert (b_out[b_in == 0x80] == 0).all()
    assert torch.equal(b_out[b_in != 0x80], b_in[b_in != 0x80])
    # and back
    w_back, s_back = fp8_fnuz_to_fn(w_uz, s_uz)
    assert torch.equal(s_back, scale)
    assert torch.equal(w_back.view(torch.uint8), b_out)
    assert torch.equal(dequant_fp8_block(w_back, s_back), dequant_fp8_block(w_fn, scale))


def test_fn_to_fnuz_edge_cases():
    one = torch.ones(1, 1, dtype=torch.uint8) * 127
    w = torch.tensor([[0x7E, 0xFE, 0x80, 0x00]], dtype=torch.uint8).view(E4M3FN)
    w_uz, s_uz = fp8_fn_to_fnuz(w, one)
    assert s_uz.item() == 128
    assert fp8_decode(w_uz, E4M3FNUZ).tolist() == [[224.0, -224.0, 0.0, 0.0]]  # 448 -> 224 (<= 240)
    # E8M0 scale given as float8_e8m0fnu is accepted (viewed as bytes), returned as uint8
    _, s2 = fp8_fn_to_fnuz(w, one.view(torch.float8_e8m0fnu))
    assert s2.dtype == torch.uint8 and s2.item() == 128
    for nan in (0x7F, 0xFF):
        with pytest.raises(ValueError, match="NaN"):
            fp8_fn_to_fnuz(torch.tensor([[nan]], dtype=torch.uint8).view(E4M3FN), one)
    with pytest.raises(ValueError, match="0xFE"):
        fp8_fn_to_fnuz(w, torch.full((1, 1), 0xFE, dtype=torch.uint8))
    with pytest.raises(ValueError):
        fp8_fn_to_fnuz(w, torch.full((1, 1), 0xFF, dtype=torch.uint8))
    with pytest.raises(ValueError):
        fp8_fn_to_fnuz(w, torch.full((1, 1), 3e38))
    with pytest.raises(FormatError):
        fp8_fn_to_fnuz(w, torch.ones(1, 1, dtype=torch.bfloat16))
    # inverse: fnuz NaN, +-240 and an unhalvable scale raise
    for bad in (0x80, 0x7F, 0xFF):
        with pytest.raises(ValueError):
            fp8_fnuz_to_fn(torch.tensor([[bad]], dtype=torch.uint8).view(E4M3FNUZ), one)
    with pytest.raises(ValueError):
        fp8_fnuz_to_fn(w_uz, torch.zeros(1, 1, dtype=torch.uint8))
    with pytest.raises(ValueError):
        fp8_fnuz_to_fn(w_uz, torch.full((1, 1), 2.0**-149))


# ---------------------------------------------------------------------------------------------
# E8M0
# ---------------------------------------------------------------------------------------------


def test_e8m0_decode_all_bytes():
    got = e8m0_decode(ALL_BYTES)
    assert got.dtype == torch.float32
    ref = torch.tensor([2.0 ** (b - 127) for b in range(255)], dtype=torch.float64).float()
    assert torch.equal(f32_bits(got[:255]), f32_bits(ref))  # incl. 2^-127 (a float32 subnormal)
    assert torch.isnan(got[255])
    tor = ALL_BYTES.view(torch.float8_e8m0fnu).float()
    assert torch.equal(f32_bits(got[:255]), f32_bits(tor[:255])) and torch.isnan(tor[255])
    assert torch.equal(e8m0_decode(ALL_BYTES.view(torch.float8_e8m0fnu))[:255], got[:255])


def test_e8m0_encode():
    pows = torch.tensor([2.0**e for e in range(-127, 128)], dtype=torch.float64)
    assert torch.equal(e8m0_encode(pows), ALL_BYTES[:255])
    assert e8m0_encode(pows).dtype == torch.uint8
    assert torch.equal(e8m0_encode(pows.float()), ALL_BYTES[:255])
    assert torch.equal(e8m0_decode(e8m0_encode(pows)).double(), pows)
    with pytest.raises(ValueError, match="power of two"):
        e8m0_encode(torch.tensor([1.0, 3.0]))
    up = e8m0_encode(torch.tensor([3.0, 0.3, 1.0, 2.0**-127 * 1.5], dtype=torch.float64), round_up=True)
    assert up.tolist() == [129, 127 - 1, 127, 1]  # 4, 0.5, 1, 2^-126
    for bad in ([0.0], [-1.0], [float("inf")], [NAN], [2.0**128], [2.0**-128]):
        with pytest.raises(ValueError):
            e8m0_encode(torch.tensor(bad, dtype=torch.float64))
    t = torch.tensor([1.0, 0.5]).to(torch.float8_e8m0fnu)
    assert as_e8m0_bytes(t).dtype == torch.uint8 and as_e8m0_bytes(t).tolist() == [127, 126]
    with pytest.raises(FormatError):
        as_e8m0_bytes(torch.tensor([1.0]))


# ---------------------------------------------------------------------------------------------
# E2M1 / MXFP4
# ---------------------------------------------------------------------------------------------


def test_e2m1_decode_table():
    got = e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert got.tolist() == E2M1_TABLE
    assert torch.signbit(got[8]) and not torch.signbit(got[0])


def test_e2m1_encode_known_answers():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -100.0, float("inf"), -0.0, -0.1, 0.26, -5.1])
    # ties go to the even code: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4
    want = [0, 2, 2, 4, 4, 6, 6, 7, 7, 15, 7, 8, 8, 1, 15]
    assert e2m1_encode(x).tolist() == want
    with pytest.raises(ValueError):
        e2m1_encode(torch.tensor([NAN]))


def test_e2m1_encode_matches_reference():
    x = np.concatenate([grid_and_ties("e2m1", 7.0), log_uniform(5000, -4, 3.5, seed=2), [0.0, -0.0]])
    got = e2m1_encode(torch.from_numpy(x.astype(np.float32)))
    assert got.dtype == torch.uint8
    assert np.array_equal(got.numpy().astype(np.int64), ref_encode(x.astype(np.float32).astype(np.float64), "e2m1"))
    assert torch.equal(e2m1_encode(e2m1_decode(torch.arange(16))), torch.arange(16, dtype=torch.uint8))


def test_nibble_order_known_answer():
    # element 2i in the LOW nibble
    assert pack_e2m1(torch.tensor([1, 2, 15, 0])).tolist() == [0x21, 0x0F]
    assert unpack_e2m1(torch.tensor([0x21, 0xF0], dtype=torch.uint8)).tolist() == [1, 2, 0, 15]
    # checkpoint int8 storage: 0xC3 = -61 as int8 -> low 0x3 (1.5), high 0xC (-2)
    assert unpack_e2m1(torch.tensor([-61], dtype=torch.int8)).tolist() == [3, 12]
    packed = torch.full((1, 16), 0x3C, dtype=torch.uint8)  # low 0xC = -2, high 0x3 = 1.5
    w = dequant_mxfp4(packed, torch.tensor([[128]], dtype=torch.uint8))  # scale 2
    assert w.shape == (1, 32) and w[0, :4].tolist() == [-4.0, 3.0, -4.0, 3.0]
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (5, 64), generator=g)
    assert torch.equal(unpack_e2m1(pack_e2m1(codes)), codes.int())


def test_dequant_mxfp4_reference():
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (7, 96), generator=g)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    sb = torch.randint(100, 150, (7, 3), generator=g).to(torch.uint8)
    ref = torch.tensor(E2M1_TABLE, dtype=torch.float64)[codes] * torch.exp2(sb.double() - 127).repeat_interleave(32, 1)
    assert torch.equal(dequant_mxfp4(packed, sb).double(), ref)
    assert torch.equal(dequant_mxfp4(packed.view(torch.int8), sb), dequant_mxfp4(packed, sb))
    with pytest.raises(ValueError):
        dequant_mxfp4(packed, sb[:, :2])


def test_dequant_fp8_block_reference_ragged():
    g = torch.Generator().manual_seed(4)
    n, k = 130, 200  # ceil -> [2, 2] scale
    b = torch.randint(0, 256, (n, k), generator=g).to(torch.uint8)
    b[(b & 0x7F) == 0x7F] = 0x3F
    s = torch.randint(110, 140, (2, 2), generator=g).to(torch.uint8)
    lut = torch.tensor([fp8_value(c, E4M3FN) for c in range(256)], dtype=torch.float64)
    ref = lut[b.long()] * torch.exp2(s.double() - 127).repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    assert torch.equal(dequant_fp8_block(b.view(E4M3FN), s).double(), ref)
    with pytest.raises(ValueError):
        dequant_fp8_block(b.view(E4M3FN), s[:1])


def _mx_case(n: int, k: int, lo: int, hi: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    sb = torch.randint(lo, hi + 1, (n, k // 32), generator=g).to(torch.uint8)
    return packed, sb


@pytest.mark.parametrize("n,k", [(256, 256), (130, 160)])
def test_mxfp4_to_fp8_exact_on_representative_scales(n, k):
    # sub-scales spread over 2^14 inside each block (checkpoint scales sit far closer together)
    packed, sb = _mx_case(n, k, 110, 124, seed=n + k)
    w, s = mxfp4_to_fp8(packed, sb, strict=True)
    assert w.dtype == E4M3FN and s.dtype == torch.uint8
    assert s.shape == (math.ceil(n / 128), math.ceil(k / 128))
    assert torch.equal(dequant_fp8_block(w, s), dequant_mxfp4(packed, sb))
    # new scale = block max / 2^6, from the bytes directly
    want = [[max(sb[i * 128:(i + 1) * 128, j * 4:(j + 1) * 4].flatten().tolist()) - 6 for j in range(s.shape[1])] for i in range(s.shape[0])]
    assert s.tolist() == want
    assert fp8_decode(w, E4M3FN).abs().max() <= 384


def test_mxfp4_to_fp8_tiny_scales_clamp_new_byte_at_zero():
    packed, sb = _mx_case(128, 128, 0, 4, seed=9)
    w, s = mxfp4_to_fp8(packed, sb, strict=True)
    assert s.tolist() == [[0]]
    assert torch.equal(dequant_fp8_block(w, s), dequant_mxfp4(packed, sb))


# |v| = a * 2^p with a in {1, 3}
TWO_ADIC = {0.5: -1, 1.0: 0, 1.5: -1, 2.0: 1, 3.0: 0, 4.0: 2, 6.0: 1}


def test_mxfp4_to_fp8_exactness_boundary():
    # measured: code x shift d is exact iff 2-adic exponent(fp4 value) + d >= -9 (docstring claim)
    for d in range(-14, 7):
        codes = torch.arange(16).repeat(128, 2)  # [128, 32]: one 32-group per row
        sb = torch.full((128, 4), 100 + d, dtype=torch.uint8)
        sb[0, 1] = 106  # block max 106 -> new byte 100, so row groups with byte 100+d shift by d
        codes = torch.cat([codes, torch.zeros(128, 96, dtype=codes.dtype)], 1)
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
        w, s = mxfp4_to_fp8(packed, sb)
        assert s.item() == 100
        got = dequant_fp8_block(w, s)[1:, :32].double()
        want = dequant_mxfp4(packed, sb)[1:, :32].double()
        for c in range(16):
            v = E2M1_TABLE[c]
            exact = v == 0 or TWO_ADIC[abs(v)] + d >= -9
            assert bool((got[:, c] == want[:, c]).all()) == exact, (d, c)
    # strict mode catches a sub-scale 2^20 below its block max
    packed, sb = _mx_case(128, 128, 120, 120, seed=5)
    sb[0, 0] = 140
    with pytest.raises(ValueError, match="not exact"):
        mxfp4_to_fp8(packed, sb, strict=True)
    w, s = mxfp4_to_fp8(packed, sb)
    bad = (dequant_fp8_block(w, s) != dequant_mxfp4(packed, sb)).sum().item()
    assert bad > 0
