"""The model's quantization simulations where the model applies them, against an independent
float64 re-computation of the spec (§6) for one attention layer of each kind (window-only, CSA
ratio 4 with the lightning indexer, HCA ratio 16):

* FP8 linears (wq_a, wq_b, wkv, wo_b, indexer.wq_b): the activation quantized per token per
  128-block to e4m3 with a power-of-two scale 2^ceil(log2(max(amax, 1e-4) / 448));
* window KV and compressed KV: the nope dims quantize->dequantize e4m3, block 64, same scale rule;
* indexer queries and compressed keys: Walsh-Hadamard (n^-0.5) then e2m1, block 32, scale
  2^ceil(log2(max(amax, 6 * 2^-126) / 6)).

The reference rounds with torch's float8_e4m3fn cast (the spec's rounding) and its own e2m1
nearest-even table lookup, never with dsv4.model.quant.sim. It is evaluated twice, simulations on
and off; the model (simulations on, fp32) must sit far closer to "on" than "on" is to "off", so a
missing, misplaced or mis-blocked simulation fails: the distance is measured per layer, on the
layer's output and on the indexer's query/key operands (read through Indexer.aux).

Checked by planting (not committed): every simulation a no-op -> all 3 fail; only the activation
quantization -> 3 fail; only the window-KV FP8 -> 3; only the indexer-query FP4 -> the CSA case;
indexer keys at block 64 -> CSA; compressed-KV FP8 over the rope dims too -> CSA and HCA.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.model.config import ModelConfig
from dsv4.model.model import Transformer, init_random, rope_of
from dsv4.model.state import new_state

pytestmark = pytest.mark.usefixtures("one_thread")

T = 40  # prompt length: 10 ratio-4 entries (the indexer picks 4), 2 ratio-16 entries, 5 windows of 8
FP8_LINEARS = ("wq_a", "wq_b", "wkv", "wo_b")
# Fraction of the on/off distance the model may be from the "on" reference. fp32 vs float64 moves
# a value across an e4m3 rounding boundary only when it sits within ~1e-7 relative of one, which
# flips a few elements by one e4m3 step; the measured ratios are < 3e-7 (printed), so 0.01 leaves
# room for such flips while any dropped or misplaced simulation makes the ratio ~1.
CLOSE = 0.01


# ------------------------------------------------------------------ the spec's roundings (float64)

def e4m3_qdq(x: torch.Tensor, block: int) -> torch.Tensor:
    xb = x.unflatten(-1, (-1, block))
    s = torch.exp2(torch.ceil(torch.log2(xb.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0)))
    return ((xb / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).double() * s).flatten(-2)


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value, ties to the even code (mantissa bit 0), after clamping to +-6."""
    a = v.abs().clamp(max=6.0)
    d = (a[..., None] - E2M1).abs() + 1e-12 * (torch.arange(8) % 2)  # odd codes lose exact ties
    return torch.sign(v) * E2M1[d.argmin(-1)]


def e2m1_qdq(x: torch.Tensor, block: int) -> torch.Tensor:
    xb = x.unflatten(-1, (-1, block))
    s = torch.exp2(torch.ceil(torch.log2(xb.abs().amax(-1, keepdim=True).clamp_min(6.0 * 2.0**-126) / 6.0)))
    return (e2m1_round(xb / s) * s).flatten(-2)


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return x @ h / math.sqrt(n)


# ------------------------------------------------------------------ the reference layer (float64)

def to_fp8(lin: torch.nn.Module) -> None:
    """Make a float Linear an FP8 one: e4m3fn weight, E8M0 byte per 128x128 block (checkpoint layout)."""
    w = lin.weight.data.double()
    n, k = w.shape
    blocks = w.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))  # [N/128,128,K/128,128]
    e = torch.ceil(torch.log2(blocks.abs().amax((1, 3)) / 448.0))
    s = torch.exp2(e).repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    lin.weight = torch.nn.Parameter((w / s).to(torch.float8_e4m3fn), requires_grad=False)
    lin.scale = torch.nn.Parameter((e + 127).to(torch.uint8), requires_grad=False)


def weight(lin: torch.nn.Module) -> torch.Tensor:
    w = lin.weight.data.double()
    if lin.scale is not None:
        s = torch.exp2(lin.scale.double() - 127).repeat_interleave(128, 0).repeat_interleave(128, 1)
        w = w * s[: w.shape[0], : w.shape[1]]
    return w


def rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.double()


def rope(x: torch.Tensor, rd: int, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved rotation of the last rd dims; cos/sin [T, rd/2] broadcast over any head dim."""
    while cos.dim() < x.dim():
        cos, sin = cos[:, None], sin[:, None]
    s = -sin if inverse else sin
    a, b = x[..., -rd::2], x[..., -rd + 1::2]
    rot = torch.stack([a * cos - b * s, a * s + b * cos], -1).flatten(-2)
    return torch.cat([x[..., :-rd], rot], -1)


def ref_compress(mod, x, m, cos, sin, eps, rd, quant: bool, kv: bool) -> torch.Tensor:
    """Completed entries of a prefill from position 0: softmax(z)-weighted pooling per feature."""
    hd = mod.hd
    k = x @ weight(mod.wkv).T
    z = x @ weight(mod.wgate).T + mod.ape.double()[torch.arange(x.shape[0]) % m]
    ents = []
    for j in range(x.shape[0] // m):
        cur = slice(j * m, (j + 1) * m)
        if m == 4:  # overlapping: the previous window's first hd features join the softmax
            kp = k[cur.start - m:cur.start, :hd] if j else torch.zeros(m, hd, dtype=torch.float64)
            zp = z[cur.start - m:cur.start, :hd] if j else torch.full((m, hd), -math.inf, dtype=torch.float64)
            kc, zc = torch.cat([kp, k[cur, hd:]]), torch.cat([zp, z[cur, hd:]])
        else:
            kc, zc = k[cur], z[cur]
        ents.append((kc * zc.softmax(0)).sum(0))
    e = rms(torch.stack(ents), mod.norm.weight, eps)
    e = rope(e, rd, cos[::m][: e.shape[0]], sin[::m][: e.shape[0]])
    if kv:
        return torch.cat([e4m3_qdq(e[:, :-rd], 64), e[:, -rd:]], -1) if quant else e
    e = walsh_hadamard(e)
    return e2m1_qdq(e, 32) if quant else e


def ref_attention(attn, x: torch.Tensor, cfg: ModelConfig, cos, sin, quant: bool) -> dict:
    """One prefill of the layer from an empty state; returns its output and the indexer operands."""
    H, D, rd, W, eps, G = cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim, cfg.sliding_window, \
        cfg.rms_norm_eps, cfg.o_groups
    Tn = x.shape[0]

    def lin(v, mod):  # FP8 linears quantize their activation per 128-block
        return (e4m3_qdq(v, 128) if quant and mod.scale is not None else v) @ weight(mod).T

    qr = rms(lin(x, attn.wq_a), attn.q_norm.weight, eps)
    q = lin(qr, attn.wq_b).unflatten(-1, (H, D))
    q = rope(rms(q, None, eps), rd, cos[:Tn], sin[:Tn])
    kv = rope(rms(lin(x, attn.wkv), attn.kv_norm.weight, eps), rd, cos[:Tn], sin[:Tn])
    if quant:
        kv = torch.cat([e4m3_qdq(kv[:, :-rd], 64), kv[:, -rd:]], -1)
    rows = [[s for s in range(max(0, t - W + 1), t + 1)] for t in range(Tn)]  # window: own KV rows
    src, out = kv, {}
    m = attn.ratio
    if m:
        ent = ref_compress(attn.compressor, x, m, cos, sin, eps, rd, quant, kv=True)
        src = torch.cat([kv, ent])
        if m == 4:
            ix = attn.indexer
            iq = lin(qr, ix.wq_b).unflatten(-1, (ix.n_heads, ix.head_dim))
            iq = walsh_hadamard(rope(iq, rd, cos[:Tn], sin[:Tn]))
            iq = e2m1_qdq(iq, 32) if quant else iq
            keys = ref_compress(ix.compressor, x, 4, cos, sin, eps, rd, quant, kv=False)
            w = x @ weight(ix.weights_proj).T * (ix.head_dim**-0.5 * ix.n_heads**-0.5)
            score = ((iq @ keys.T).relu() * w[..., None]).sum(1)  # [T, R]
            out.update(q=iq, keys=keys)
            for t in range(Tn):
                vis = (t + 1) // 4
                best = score[t, :vis].argsort(descending=True)[: ix.topk].tolist()
                rows[t] += [Tn + e for e in best]
        else:
            for t in range(Tn):
                rows[t] += [Tn + e for e in range((t + 1) // m)]
    o = torch.zeros(Tn, H, D, dtype=torch.float64)
    sink = attn.attn_sink.double()
    for t in range(Tn):
        kvs = src[rows[t]]  # [K, D]
        s = q[t] @ kvs.T / math.sqrt(D)  # [H, K]
        p = torch.exp(torch.cat([s, sink[:, None]], 1) - torch.cat([s, sink[:, None]], 1).amax(1, keepdim=True))
        p = p / p.sum(1, keepdim=True)
        o[t] = p[:, :-1] @ kvs
    o = rope(o, rd, cos[:Tn], sin[:Tn], inverse=True).reshape(Tn, G, -1)
    wo_a = attn.wo_a.weight.double().view(G, cfg.o_lora_rank, -1)
    o = torch.einsum("tgk,grk->tgr", o, wo_a).flatten(1)
    out["out"] = lin(o, attn.wo_b)
    return out


# ------------------------------------------------------------------ the test

@pytest.fixture(scope="module")
def captured():
    """A tiny model with FP8 attention linears (random weights), one prefill of T tokens; each
    attention layer's input, output and indexer operands recorded."""
    cfg = ModelConfig.preset("tiny")
    assert cfg.quant_sim
    model = init_random(Transformer(cfg, dtype=torch.float32), seed=3).eval()
    seen = {}
    for i, blk in enumerate(model.layers):
        attn = blk.attn
        for name in FP8_LINEARS:
            to_fp8(getattr(attn, name))
        if attn.ratio == 4:
            to_fp8(attn.indexer.wq_b)

        def hook(mod, args, output, i=i):
            seen.setdefault(i, {}).update(x=args[0].detach().clone(), out=output.detach().clone())
        attn.register_forward_hook(hook)
    tokens = torch.randint(2, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(5))
    for blk in model.layers:  # each CSA layer's indexer records its score operands (Indexer.aux)
        if blk.attn.ratio == 4:
            blk.attn.indexer.aux = {}
    with torch.no_grad():
        model(tokens, torch.tensor([0]), torch.tensor([T]), torch.tensor([0]), new_state(cfg, 1, torch.float32))
    for i, blk in enumerate(model.layers):
        if blk.attn.ratio == 4:
            seen[i].update(q=blk.attn.indexer.aux["q"][0].detach(), keys=blk.attn.indexer.aux["keys"][0].detach())
            blk.attn.indexer.aux = None
    return cfg, model, seen


@pytest.mark.parametrize("ratio", [0, 4, 16], ids=["window", "csa", "hca"])
@torch.no_grad()
def test_layer_with_quant_sims_matches_float64_reference(captured, ratio):
    cfg, model, seen = captured
    i = next(i for i, blk in enumerate(model.layers) if blk.attn.ratio == ratio)
    blk = model.layers[i]
    kind = rope_of(model, torch.zeros(1, 1, dtype=torch.long))[blk.rope_kind]
    cos, sin = kind["cos"].double(), kind["sin"].double()
    x = seen[i]["x"][0].double()
    on = ref_attention(blk.attn, x, cfg, cos, sin, quant=True)
    off = ref_attention(blk.attn, x, cfg, cos, sin, quant=False)
    names = ["out"] + (["q", "keys"] if ratio == 4 else [])
    for name in names:
        got = seen[i][name]
        if name == "out":
            got = got[0]
        got = got.double()[: on[name].shape[0]]  # compressed keys: the completed entries only
        err = float((got - on[name]).norm())
        sim = float((on[name] - off[name]).norm())
        print(f"[quant-sim ref] layer {i} (ratio {ratio}) {name}: |model - on| {err:.3e}, |on - off| {sim:.3e}, "
              f"ratio {err / sim:.2e}")
        assert sim > 1e-3 * float(on[name].norm()), f"{name}: the simulations should change the result"
        assert err < CLOSE * sim, f"layer {i} {name}: model is {err / sim:.2f} of the way from 'on' to 'off'"


def test_pow2_block_scale_is_the_references_exponent_bit_ceil() -> None:
    """2^ceil(log2(amax / max)) as the reference computes it (fast_log2_ceil: the exponent bits of the
    float32 ratio, +1 when its mantissa is non-zero), for random ratios and for ratios one ulp on either
    side of a power of two, where a float32 log2 rounds onto the power and ceil misses the +1."""
    import numpy as np

    from dsv4.model.kernels.qdq import pow2_block_scale

    g = torch.Generator().manual_seed(0)
    pows = torch.exp2(torch.arange(-30, 30, dtype=torch.float32))
    ratios = torch.cat([torch.rand(4096, generator=g) * 10.0 ** torch.randint(-8, 8, (4096,), generator=g),
                        pows, torch.nextafter(pows, pows * 2), torch.nextafter(pows, pows / 2)]).float()
    for fmt_max in (448.0, 6.0):
        amax = ratios * fmt_max
        r = (amax / fmt_max).numpy().view(np.int32)
        e = ((r >> 23) & 0xFF) - 127 + ((r & 0x7FFFFF) != 0)
        want = torch.from_numpy(np.ldexp(1.0, e).astype(np.float32))
        assert torch.equal(pow2_block_scale(amax, fmt_max), want), fmt_max
