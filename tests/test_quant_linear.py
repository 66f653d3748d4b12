"""model/kernels/linear.py against a float64 reference written from the spec's formulas (§4.3, §6):
the activation is quantized here in float64 (per token per 128-K block, scale 2^ceil(log2(amax/448)),
amax floored at 1e-4, nearest e4m3fn value by exhaustive search), weights are decoded from the
format definitions, and the GEMM is a float64 matmul."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dsv4.model.quant.formats import E4M3FN, E4M3FNUZ, FormatError, fp8_fn_to_fnuz
from dsv4.model.kernels.linear import fp8_block_linear, linear, mxfp4_linear

E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def e4m3fn_value(c: int) -> float:
    e, m = (c >> 3) & 15, c & 7
    mag = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if c & 0x80 else mag


FN_LUT = torch.tensor([e4m3fn_value(c) for c in range(256)], dtype=torch.float64)  # NaN codes unused
FN_GRID = torch.tensor(sorted({abs(e4m3fn_value(c)) for c in range(127)}), dtype=torch.float64)


def ref_round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3fn magnitude (saturating at 448), ties to the even mantissa, sign restored."""
    a = v.abs().clamp(max=448.0).unsqueeze(-1)
    d = (a - FN_GRID).abs()
    best = d.min(-1, keepdim=True).values
    idx = torch.arange(len(FN_GRID))
    tied = d == best
    # grid index parity == code parity (code c has magnitude FN_GRID[c]); prefer the even one
    pick = torch.where(tied & (idx % 2 == 0), idx, len(FN_GRID)).min(-1).values
    pick = torch.where(pick == len(FN_GRID), torch.where(tied, idx, len(FN_GRID)).min(-1).values, pick)
    return torch.copysign(FN_GRID[pick], v)


def ref_act_qdq(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    k = x.shape[-1]
    nb = math.ceil(k / 128)
    xb = F.pad(x, (0, nb * 128 - k)).unflatten(-1, (nb, 128))
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    return (ref_round_e4m3(xb / s) * s).flatten(-2)[..., :k]


def rand_fp8_bytes(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    b = torch.randint(0, 256, (n, k), generator=g).to(torch.uint8)
    b[(b & 0x7F) == 0x7F] = 0x3F  # no NaN codes in a weight
    return b


def expand(s64: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return s64.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


def rand_x(shape, g, dtype=torch.float32) -> torch.Tensor:
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 6, shape[:-1] + (1,), generator=g).float())
    return x.to(dtype)


def test_ref_round_sanity():
    v = torch.tensor([0.0, 1.0, 1.0625, 1.0625 + 1e-9, 17.0, 500.0, -2.0**-10, -3 * 2.0**-10, 2.0**-10 + 1e-12], dtype=torch.float64)
    assert ref_round_e4m3(v).tolist() == [0.0, 1.0, 1.0, 1.125, 16.0, 448.0, -0.0, -2.0**-8, 2.0**-9]


@pytest.mark.parametrize("n,k", [(256, 384), (200, 320), (72, 100)])
@pytest.mark.parametrize("scale_kind", ["e8m0", "f32"])
def test_fp8_block_linear_vs_float64(n, k, scale_kind):
    g = torch.Generator().manual_seed(n * 7 + k)
    b = rand_fp8_bytes(n, k, g)
    nb, kb = math.ceil(n / 128), math.ceil(k / 128)
    if scale_kind == "e8m0":
        sbytes = torch.randint(115, 125, (nb, kb), generator=g).to(torch.uint8)
        scale, s64 = sbytes, torch.exp2(sbytes.double() - 127)
    else:
        scale = torch.rand((nb, kb), generator=g) * 0.01 + 1e-3
        s64 = scale.double()
    w64 = FN_LUT[b.long()] * expand(s64, n, k)
    x = rand_x((2, 5, k), g)
    x[0, 0] = 0.0  # all-zero token: amax floor, no NaN
    y = fp8_block_linear(x, b.view(E4M3FN), scale)
    assert y.dtype == torch.float32 and y.shape == (2, 5, n)
    xq = ref_act_qdq(x)
    ref = xq @ w64.T
    bound = 2e-6 * (xq.abs() @ w64.abs().T) + 1e-30
    assert ((y.double() - ref).abs() <= bound).all()
    assert (y[0, 0] == 0).all()
    # the activation quantization is really there: the unquantized product differs measurably
    unq = x.double() @ w64.T
    assert ((unq - ref).abs() > 50 * bound).any()
    assert (unq - ref).abs().max() > 1e-3 * unq.abs().max()
    # the fnuz twin (same bits, doubled scale) gives identical results
    w_uz, s_uz = fp8_fn_to_fnuz(b.view(E4M3FN), scale)
    assert torch.equal(fp8_block_linear(x, w_uz, s_uz), y)
    # dispatcher
    assert torch.equal(linear(x, b.view(E4M3FN), scale), y)


def test_fp8_block_linear_bf16_and_saturation_edges():
    g = torch.Generator().manual_seed(11)
    n, k = 128, 256
    b = rand_fp8_bytes(n, k, g)
    s = torch.full((1, 2), 120, dtype=torch.uint8)
    x = rand_x((3, k), g).to(torch.bfloat16)
    x[1, 5] = 1e4  # one huge value: its block scale is set by it, small values flush
    x[2, :128] = 1e-7  # below the amax floor
    y = fp8_block_linear(x, b.view(E4M3FN), s)
    assert y.dtype == torch.bfloat16
    ref = ref_act_qdq(x) @ (FN_LUT[b.long()] * 2.0**-7).T
    torch.testing.assert_close(y.double(), ref, rtol=2**-7, atol=1e-6 * ref.abs().max().item())
    assert torch.isfinite(y.float()).all()


@pytest.mark.parametrize("n,k", [(96, 256), (64, 192)])
def test_mxfp4_linear_vs_float64(n, k):
    g = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 16, (n, k), generator=g)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)  # low nibble = element 2i
    sb = torch.randint(118, 130, (n, k // 32), generator=g).to(torch.uint8)
    w64 = torch.tensor(E2M1_TABLE, dtype=torch.float64)[codes] * torch.exp2(sb.double() - 127).repeat_interleave(32, 1)
    x = rand_x((4, 3, k), g)
    y = mxfp4_linear(x, packed, sb)
    assert y.dtype == torch.float32 and y.shape == (4, 3, n)
    xq = ref_act_qdq(x)
    ref = xq @ w64.T
    bound = 2e-6 * (xq.abs() @ w64.abs().T) + 1e-30
    assert ((y.double() - ref).abs() <= bound).all()
    unq = x.double() @ w64.T
    assert (unq - ref).abs().max() > 1e-3 * unq.abs().max()
    # checkpoint int8 storage and the dispatcher give the same result; bf16 in -> bf16 out
    assert torch.equal(linear(x, packed.view(torch.int8), sb), y)
    yb = mxfp4_linear(x.bfloat16(), packed, sb)
    assert yb.dtype == torch.bfloat16
    # swapped nibbles must change the answer (the test can see the layout)
    swapped = ((packed >> 4) | (packed << 4)).to(torch.uint8)
    assert not torch.allclose(mxfp4_linear(x, swapped, sb), y)


def test_linear_dispatch_errors():
    x = torch.randn(2, 128)
    w = torch.randn(8, 128)
    assert torch.equal(linear(x, w), F.linear(x, w))
    assert linear(x.bfloat16(), w).dtype == torch.bfloat16
    fp8 = w.to(E4M3FN)
    with pytest.raises(TypeError):
        linear(x, fp8)  # FP8 without its scale
    with pytest.raises(TypeError):
        linear(x, torch.zeros(8, 64, dtype=torch.uint8))
    with pytest.raises(TypeError):
        linear(x, w, torch.ones(1, 1))  # scale for a plain weight
    with pytest.raises(TypeError):
        linear(x, torch.zeros(8, 128, dtype=torch.int32), torch.ones(1, 1))
    with pytest.raises(TypeError):
        linear(x, w.to(torch.float8_e5m2), torch.ones(1, 1))
    with pytest.raises(FormatError):
        fp8_block_linear(x, fp8, torch.ones(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError):
        fp8_block_linear(x, fp8, torch.ones(2, 1, dtype=torch.uint8))  # wrong scale shape
    with pytest.raises(ValueError):
        fp8_block_linear(torch.randn(2, 64), fp8, torch.ones(1, 1, dtype=torch.uint8))


class _Fp8Mod(torch.nn.Module):
    def __init__(self, w: torch.Tensor, s: torch.Tensor, packed: torch.Tensor, sb: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("w", w)
        self.register_buffer("s", s)
        self.register_buffer("packed", packed)
        self.register_buffer("sb", sb)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.w, self.s) + linear(x, self.packed, self.sb)


@pytest.mark.parametrize("fmt", [E4M3FN, E4M3FNUZ])
def test_export_has_no_float8_conversion(fmt):
    """The graph IREE receives only bitcasts float8 storage; no f8 -> float cast (docs/export.md, IREE 3.13 traps)."""
    g = torch.Generator().manual_seed(1)
    w = rand_fp8_bytes(64, 128, g).view(E4M3FN)
    s = torch.full((1, 1), 120, dtype=torch.uint8)
    if fmt == E4M3FNUZ:
        w, s = fp8_fn_to_fnuz(w, s)
    packed = torch.randint(0, 256, (64, 64), generator=g).to(torch.uint8)
    sb = torch.full((64, 4), 125, dtype=torch.uint8)
    m = _Fp8Mod(w, s, packed, sb)
    x = torch.randn(2, 3, 128, generator=g, dtype=torch.float32).bfloat16()
    seq = torch.export.Dim("seq", min=1, max=64)
    ep = torch.export.export(m, (x,), dynamic_shapes={"x": {1: seq}}, strict=False)
    f8 = {torch.float8_e4m3fn, torch.float8_e4m3fnuz}
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        for a in node.args:
            val = getattr(a, "meta", {}).get("val") if isinstance(a, torch.fx.Node) else None
            if isinstance(val, torch.Tensor) and val.dtype in f8:
                assert node.target == torch.ops.aten.view.dtype, node.format_node()
    x2 = torch.randn(2, 7, 128, generator=g).bfloat16()
    assert torch.equal(ep.module()(x2), m(x2))


def test_fp8_act_amax_floor():
    """Tokens whose 128-blocks all have amax < 1e-4 use the floored scale 2^-22 (values land in the
    e4m3 subnormal range, so the floor visibly changes the result)."""
    g = torch.Generator().manual_seed(5)
    n, k = 16, 256
    b = rand_fp8_bytes(n, k, g)
    s = torch.full((1, 2), 127, dtype=torch.uint8)
    w64 = FN_LUT[b.long()]
    x = torch.randn(3, k, generator=g) * 1e-8
    y = fp8_block_linear(x, b.view(E4M3FN), s).double()
    xq = ref_act_qdq(x)
    ref = xq @ w64.T
    assert ((y - ref).abs() <= 2e-6 * (xq.abs() @ w64.abs().T) + 1e-30).all()
    # what an un-floored scale would give is measurably different
    xb = x.double().unflatten(-1, (2, 128))
    s_nofloor = torch.exp2(torch.ceil(torch.log2(xb.abs().amax(-1, keepdim=True) / 448.0)))
    ref_nofloor = (ref_round_e4m3(xb / s_nofloor) * s_nofloor).flatten(-2) @ w64.T
    assert (ref_nofloor - ref).abs().max() > 1e-3 * ref.abs().max()


@pytest.mark.parametrize("fmt,weight_only", [("fp8", False), ("fp4", False), ("plain", False), ("fp8", True),
                                             ("fp4", True)])
def test_stacked_linear_and_quantized_moe_vs_float64(fmt, weight_only):
    """The MoE reference (stacked experts, one dequantize for all) against a float64 per-token,
    per-expert loop written from the formulas: x -> act qdq -> W1/W3 -> clamped SwiGLU x gate weight
    -> (activation dtype) -> act qdq -> W2, summed over the token's experts. With the quantized linears'
    `weight_only` alternatives (the verification mode: no activation quantization) the formulas drop
    the act qdq and the fp32 result must match float64 to summation order, with no FP8 flips."""
    from contextlib import nullcontext

    from dsv4.model.kernels import KERNELS
    from dsv4.model.kernels.linear import stacked_linear, weight_only_linears
    from dsv4.model.kernels.moe import moe_experts

    alts = {op for op, k in KERNELS.items() if "weight_only" in k.alternatives}
    assert alts == {"fp8_block_linear", "mxfp4_linear", "fp8_block_linear_stacked", "fp8_block_linear_shared",
                    "mxfp4_linear_stacked"}
    mode = weight_only_linears() if weight_only else nullcontext()

    g = torch.Generator().manual_seed({"fp8": 1, "fp4": 2, "plain": 3}[fmt])
    E, d, inter, N, limit = 5, 256, 128, 6, 2.0

    def weight(o, i):
        if fmt == "fp8":
            b = torch.stack([rand_fp8_bytes(o, i, g) for _ in range(E)])
            sb = torch.randint(118, 124, (E, math.ceil(o / 128), math.ceil(i / 128)), generator=g).to(torch.uint8)
            w64 = torch.stack([FN_LUT[b[e].long()] * expand(torch.exp2(sb[e].double() - 127), o, i) for e in range(E)])
            return b.view(E4M3FN), sb, w64
        if fmt == "fp4":
            codes = torch.randint(0, 16, (E, o, i), generator=g)
            packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
            sb = torch.randint(118, 124, (E, o, i // 32), generator=g).to(torch.uint8)
            w64 = torch.tensor(E2M1_TABLE, dtype=torch.float64)[codes] * torch.exp2(sb.double() - 127).repeat_interleave(32, -1)
            return packed, sb, w64
        w = torch.randn(E, o, i, generator=g) * 0.05
        return w, None, w.double()

    (w1, s1, r1), (w2, s2, r2), (w3, s3, r3) = weight(inter, d), weight(d, inter), weight(inter, d)
    x = rand_x((N, d), g)
    weights = torch.rand(N, 2, generator=g)
    indices = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(N)])

    with mode:
        st = stacked_linear(x, w1, s1)
        st3 = stacked_linear(x.expand(E, N, d).contiguous(), w1, s1)  # the 3-D form, one x per expert
        per_expert = [linear(x, w1[e], None if s1 is None else s1[e]) for e in range(E)]
        y = moe_experts(x, weights, indices, w1, s1, w2, s2, w3, s3, limit)
    assert st.shape == (E, N, inter)
    torch.testing.assert_close(st3, st, rtol=1e-5, atol=1e-5)
    for e in range(E):  # the stacked form is the per-expert `linear`, up to fp32 summation order
        torch.testing.assert_close(st[e], per_expert[e], rtol=1e-5, atol=1e-5)

    qdq = ref_act_qdq if fmt != "plain" and not weight_only else (lambda t: t.double())
    ref = torch.zeros(N, d, dtype=torch.float64)
    for n in range(N):
        for j in range(2):
            e = int(indices[n, j])
            gg = qdq(x[n]) @ r1[e].T
            uu = qdq(x[n]) @ r3[e].T
            a = torch.nn.functional.silu(gg.clamp(max=limit)) * uu.clamp(-limit, limit) * float(weights[n, j])
            ref[n] += qdq(a.float()) @ r2[e].T
    assert y.dtype == torch.float32
    # the only slack: fp32 GEMMs, and a rare one-code FP8 flip of the re-quantized intermediate
    err = (y.double() - ref).abs()
    assert err.max() <= (1e-5 if weight_only else 1e-3) * ref.abs().max(), (fmt, err.max().item(), ref.abs().max().item())
    assert (err <= 1e-5 * ref.abs().max()).float().mean() > 0.95
    # the clamp is exercised
    assert (qdq(x) @ r1[0].T).max() > limit
