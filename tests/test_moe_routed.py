"""The routed MoE (model/kernels/moe.py `moe_experts_routed`, what export installs for the
`moe_experts` hook) against float64 references and against the all-experts reference.

Cases: decode path (P = tokens x k <= E: one gathered expert per slot) and grouped path (counting
sort into `block`-row blocks), batch 1..64, MXFP4 / FP8 / plain experts, experts repeated across a
batch (and one expert taking every token), an expert repeated within a token, hash-routed layers
and the shared expert (the whole MoE block), rows with length 0 in a batch (the whole model), the
trace with a dynamic token dim (no sort/topk in the graph) and, marked slow, a 2-layer model
compiled for llvm-cpu against eager.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from dsv4.model import kernels as mk
from dsv4.model.config import ModelConfig
from dsv4.model.kernels.moe import (GROUP_BLOCK, grouped_blocks, merged_slot_weights, moe_experts,
                                    moe_experts_routed, pair_ranks, routed_moe)
from dsv4.model.model import Transformer, init_random
from dsv4.model.moe import MoE
from dsv4.model.state import new_state

pytestmark = pytest.mark.usefixtures("one_thread")

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _fp8_value(b: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes -> float64 from the format's definition (bias 7, subnormals below exponent 1)."""
    b = b.long()
    s, e, m = (b >> 7) & 1, (b >> 3) & 15, b & 7
    v = torch.where(e == 0, m.double() / 8 * 2.0 ** -6, (1 + m.double() / 8) * torch.exp2(e.double() - 7))
    return torch.where(s == 1, -v, v)


def _act_qdq64(x: torch.Tensor) -> torch.Tensor:
    """The reference act_quant per 128-K block (pow2 scale of amax/448, e4m3 RNE), float64."""
    xb = x.double().unflatten(-1, (-1, 128))
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    return ((xb / s).float().to(torch.float8_e4m3fn).double() * s).flatten(-2)


def expert_weights(fmt: str | None, E: int, o: int, i: int, g: torch.Generator):
    """(stored weight, its scale or None, float64 value [E,o,i]) in one of the checkpoint formats."""
    if fmt == "fp8":
        b = torch.randint(0, 0x7E, (E, o, i), generator=g, dtype=torch.uint8)
        b |= torch.randint(0, 2, (E, o, i), generator=g, dtype=torch.uint8) << 7
        sb = torch.randint(118, 124, (E, math.ceil(o / 128), math.ceil(i / 128)), generator=g).to(torch.uint8)
        sc = torch.exp2(sb.double() - 127).repeat_interleave(128, 1)[:, :o].repeat_interleave(128, 2)[:, :, :i]
        return b.view(torch.float8_e4m3fn), sb, _fp8_value(b) * sc
    if fmt == "fp4":
        codes = torch.randint(0, 16, (E, o, i), generator=g)
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
        sb = torch.randint(118, 124, (E, o, i // 32), generator=g).to(torch.uint8)
        return packed, sb, torch.tensor(E2M1, dtype=torch.float64)[codes] * torch.exp2(sb.double() - 127).repeat_interleave(32, -1)
    w = torch.randn(E, o, i, generator=g, dtype=torch.float64) * 0.15
    return w, None, w


def formula_moe(x, weights, indices, r1, r2, r3, limit, quantized: bool) -> torch.Tensor:
    """float64 per token: sum over its distinct experts (a repeated expert's weights summed) of
    w2(act(clamped SwiGLU(w1 x, w3 x) * weight)), written from docs/model.md, Forward pass / §6."""
    qdq = _act_qdq64 if quantized else (lambda t: t.double())
    y = torch.zeros(x.shape, dtype=torch.float64)
    qx = qdq(x)
    for n in range(x.shape[0]):
        for e in dict.fromkeys(indices[n].tolist()):
            we = float(weights[n][indices[n] == e].sum())
            g = (qx[n] @ r1[e].T).float().double()
            u = (qx[n] @ r3[e].T).float().double()
            a = torch.nn.functional.silu(g.clamp(max=limit)) * u.clamp(-limit, limit) * we
            y[n] += qdq(a.to(x.dtype)) @ r2[e].T
    return y


def _close(got: torch.Tensor, want: torch.Tensor, what) -> None:
    """Allows only fp32 GEMM order and a rare one-code FP8 flip of the re-quantized intermediate."""
    err = (got.double() - want.double()).abs()
    top = want.abs().max()
    assert err.max() <= 1e-3 * top, (what, err.max().item(), top.item())
    assert (err <= 1e-5 * top).double().mean() >= 0.99, (what, (err <= 1e-5 * top).double().mean().item())


def _routing(N: int, E: int, k: int, g: torch.Generator, kind: str):
    indices = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    if kind == "one-expert-takes-all":  # every token routes to expert 3 (plus others): one big group
        indices[:, 0] = 3
        indices[:, 1:] = torch.where(indices[:, 1:] == 3, 0, indices[:, 1:])
    elif kind == "repeat-in-token":  # slots 0 and 2 name the same expert (hash tables may do this)
        indices[:, 2] = indices[:, 0]
    return torch.rand(N, k, generator=g, dtype=torch.float64) + 0.1, indices


@pytest.mark.parametrize("fmt", ["fp4", "fp8", None])
@pytest.mark.parametrize("N", [1, 2, 3, 16, 64])
def test_routed_vs_float64_and_reference(fmt, N):
    """E=16, k=6: N=1,2 take the decode path (P <= E), N >= 3 the grouped path; each against the
    float64 formula and the all-experts reference, for three routings."""
    g = torch.Generator().manual_seed(N * 7 + len(str(fmt)))
    E, d, inter, k, limit = 16, 256, 128, 6, 2.0
    (w1, s1, r1), (w2, s2, r2), (w3, s3, r3) = (expert_weights(fmt, E, o, i, g)
                                                for o, i in ((inter, d), (d, inter), (inter, d)))
    x = torch.randn(N, d, generator=g, dtype=torch.float64)
    for kind in ("random", "one-expert-takes-all", "repeat-in-token"):
        weights, indices = _routing(N, E, k, g, kind)
        ref = moe_experts(x, weights, indices, w1, s1, w2, s2, w3, s3, limit)
        want = formula_moe(x, weights, indices, r1, r2, r3, limit, fmt is not None)
        for block in (GROUP_BLOCK, 5) + ((1,) if N <= 16 else ()):  # block 1 = one expert read per slot
            got = moe_experts_routed(x, weights, indices, w1, s1, w2, s2, w3, s3, limit, block=block)
            assert got.dtype == torch.float32 and got.shape == (N, d)
            _close(got, ref, (kind, block, "vs reference"))
            _close(got, want, (kind, block, "vs float64"))
        if N <= 2:  # the decode's pairs through the 16-row blocks instead (moe_experts_routed_blocks past 24 pairs)
            got = moe_experts_routed(x, weights, indices, w1, s1, w2, s2, w3, s3, limit, pair_max=0)
            _close(got, want, (kind, "pair_max 0", "vs float64"))
        assert (x @ r1[indices[0]].transpose(1, 2)).abs().max() > limit  # the clamp is exercised


def test_routed_blocks_takes_one_row_pairs_up_to_24(monkeypatch):
    """A GPU export's routed MoE (moe_experts_routed_blocks): up to ONE_ROW_PAIRS_MAX = 24 pairs one row a
    pair (decode batches 1-4 at top-6), above that 16-row blocks, although the pairs still fit E."""
    from dsv4.model.kernels import moe

    seen = []
    real = moe._expert_rows
    monkeypatch.setattr(moe, "_expert_rows", lambda xs, *a, **kw: seen.append(tuple(xs.shape)) or real(xs, *a, **kw))
    g = torch.Generator().manual_seed(3)
    E, d, k = 64, 32, 6
    w1, w2, w3 = (torch.randn(E, o, i, generator=g) for o, i in ((16, d), (d, 16), (16, d)))
    for N in (4, 5):
        x = torch.randn(N, d, generator=g)
        weights, indices = _routing(N, E, k, g, "random")
        got = moe.moe_experts_routed_blocks(x, weights, indices, w1, None, w2, None, w3, None, 10.0)
        _close(got, moe_experts(x, weights, indices, w1, None, w2, None, w3, None, 10.0), N)
    assert moe.ONE_ROW_PAIRS_MAX == 24
    assert seen == [(24, 1, d), (grouped_blocks(30, E, GROUP_BLOCK), GROUP_BLOCK, d)]


def test_grouped_blocks_is_a_tight_bound():
    """Every way of spreading P pairs over E experts fits in grouped_blocks(P, E, Mb) blocks, and
    some spread needs all of them; the traced (symbolic) bound E + P // Mb is never smaller."""
    for E, Mb in ((3, 1), (3, 2), (4, 3), (5, 4)):
        for P in range(0, 13):
            need = max((sum(-(-c // Mb) for c in counts)
                        for counts in itertools.product(range(P + 1), repeat=E) if sum(counts) == P), default=0)
            assert grouped_blocks(P, E, Mb) == need, (E, Mb, P)
            assert E + P // Mb >= need


def test_eager_gathered_linear_bounds_its_decoded_copies(monkeypatch):
    """Eager `mxfp4_linear_gathered` decodes the selected experts in chunks (a Flash prefill gathers
    ~570 experts: 19 GB of f32 at once ran a 141 GB GPU out of memory beside the compiled module);
    the chunks' results are the one-shot result bit for bit, and a float64 product of the decoded
    operands within fp32 summation error."""
    from dsv4.model.quant.formats import dequant_mxfp4
    from dsv4.model.kernels import linear as lin

    g = torch.Generator().manual_seed(3)
    E, N, K, G, M = 5, 16, 64, 11, 3
    packed = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(120, 130, (E, N, K // 32), generator=g, dtype=torch.uint8)
    x, sel = torch.randn(G, M, K, generator=g), torch.randint(0, E, (G,), generator=g)
    whole = lin.mxfp4_linear_gathered(x, packed, scale, sel, 0)
    monkeypatch.setattr(lin, "_EAGER_DECODE_BYTES", 3 * N * K * 8)  # 3 experts per chunk: 4 chunks
    chunked = lin.mxfp4_linear_gathered(x, packed, scale, sel, 0)
    assert torch.equal(whole, chunked)
    w = dequant_mxfp4(packed, scale).double()[sel]  # [G, N, K]
    ref = lin.fp8_act_qdq(x).double() @ w.transpose(1, 2)  # the linear's activation rounding
    torch.testing.assert_close(chunked.double(), ref, rtol=1e-5, atol=1e-4)


def test_merged_slot_weights():
    w = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    i = torch.tensor([[5, 2, 5, 5]])
    assert merged_slot_weights(w, i).tolist() == [[0.1 + 0.3 + 0.4, 0.2, 0.0, 0.0]]


@pytest.mark.parametrize("form", ["cumsum", "pairwise", "chunked"])
def test_pair_ranks_count_earlier_pairs_of_the_same_expert(form):
    from dsv4.model.kernels.moe import _chunked_ranks

    g = torch.Generator().manual_seed(3)
    # chunked: a prefill's two levels (chunks of RANK_CHUNK = 256): one chunk, several, a partial last one
    for P, E in ((1, 4), (37, 5), (200, 256), (600, 7), (600, 256), (512, 3)):
        e = torch.randint(0, E, (P,), generator=g)
        want = [sum(1 for j in range(i) if e[j] == e[i]) for i in range(P)]  # the definition, by loops
        got = _chunked_ranks(e, E) if form == "chunked" else pair_ranks(e, E, pairwise=form == "pairwise")
        assert got.tolist() == want, (P, E)


def test_bad_input_is_named():
    x = torch.zeros(3, 8)
    w = torch.zeros(4, 16, 8)
    with pytest.raises(ValueError, match="disagree"):
        moe_experts_routed(x, torch.zeros(2, 2), torch.zeros(3, 2, dtype=torch.int64), w, None,
                           torch.zeros(4, 8, 16), None, w, None, 10.0)
    with pytest.raises(ValueError, match="block must be >= 1"):
        moe_experts_routed(x, torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.int64), w, None,
                           torch.zeros(4, 8, 16), None, w, None, 10.0, block=0)


def _fill(module: torch.nn.Module, g: torch.Generator) -> None:
    """Random values for every parameter of an MoE block (bytes for the quantized ones)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("tid2eid"):
                p.copy_(torch.randint(0, p.shape[-1] + 5, p.shape, generator=g))  # repeats within a row too
            elif p.dtype == torch.float8_e4m3fn:
                b = torch.randint(0, 0x7E, p.shape, generator=g, dtype=torch.uint8)
                p.data = b.view(torch.float8_e4m3fn)
            elif p.dtype == torch.uint8:
                lo, hi = (118, 124) if name.endswith("scale") else (0, 256)
                p.copy_(torch.randint(lo, hi, p.shape, generator=g, dtype=torch.uint8))
            elif name.endswith("_scale"):
                p.copy_(torch.exp2(torch.randint(-9, -5, p.shape, generator=g).double()))
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.1)


@pytest.mark.parametrize("fmt", ["fp4", "fp8", None])
@pytest.mark.parametrize("layer", [0, 1])  # tiny: layer 0 is hash-routed (tid2eid), layer 1 top-k
def test_moe_block_hash_and_topk_layers(fmt, layer):
    """The whole MoE block (gate, routed experts, clamped shared expert) in float64 with the routed
    experts equals the reference block, for tokens 1..64."""
    cfg = ModelConfig.preset("tiny").replace(quant_sim=False, expert_dtype=fmt)
    assert cfg.is_hash_layer(0) and not cfg.is_hash_layer(1)
    blk = MoE(cfg, layer, torch.float64, None, fmt)
    _fill(blk, torch.Generator().manual_seed(layer + 10 * len(str(fmt))))
    g = torch.Generator().manual_seed(5)
    for n in (1, 3, 64):
        x = torch.randn(1, n, cfg.hidden_size, generator=g, dtype=torch.float64)
        ids = torch.randint(0, cfg.vocab_size, (1, n), generator=g)
        with torch.no_grad():
            want = blk(x, ids)
            with routed_moe():
                got = blk(x, ids)
        _close(got, want, (fmt, layer, n))


@pytest.mark.parametrize("B", [1, 5, 64])
def test_whole_model_float64_with_padding_rows(B):
    """Tiny model in float64, a batch whose rows have different lengths, some 0 (padding rows still
    run through the MoE): logits with the routed experts equal the reference's."""
    cfg = ModelConfig.preset("tiny").replace(quant_sim=False)
    model = init_random(Transformer(cfg, dtype=torch.float64), seed=3).eval()
    g = torch.Generator().manual_seed(B)
    T = 5
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    if B > 1:
        lengths[1] = 0
    args = (tokens, torch.zeros(B, dtype=torch.int64), lengths, torch.arange(B))
    with torch.no_grad():
        want = model(*args, new_state(cfg, B, torch.float64), all_logits=True)
        with routed_moe():
            got = model(*args, new_state(cfg, B, torch.float64), all_logits=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_trace_with_dynamic_tokens_has_no_sort_and_matches():
    """torch.export with a dynamic token count: the grouped path traces (bound E + P // Mb), has no
    sort/topk/argsort node, and the exported program matches the reference at several sizes."""
    g = torch.Generator().manual_seed(9)
    E, d, inter, k = 8, 128, 128, 2
    (w1, s1, _), (w2, s2, _), (w3, s3, _) = (expert_weights("fp4", E, o, i, g)
                                             for o, i in ((inter, d), (d, inter), (inter, d)))

    class M(torch.nn.Module):
        def forward(self, x, w, i):
            return moe_experts_routed(x, w, i, w1, s1, w2, s2, w3, s3, 10.0)

    N = torch.export.Dim("N", min=2, max=256)
    ex = (torch.randn(8, d), torch.rand(8, k), torch.randint(0, E, (8, k)))
    prog = torch.export.export(M(), ex, dynamic_shapes=({0: N}, {0: N}, {0: N}), strict=False)
    targets = {str(n.target) for n in prog.graph.nodes if n.op == "call_function"}
    assert not [t for t in targets if any(s in t for s in ("sort", "topk", "argsort"))], targets
    for n in (2, 5, 40):
        x, w, i = torch.randn(n, d, generator=g), torch.rand(n, k, generator=g), torch.randint(0, E, (n, k), generator=g)
        _close(prog.module()(x, w, i), moe_experts(x, w, i, w1, s1, w2, s2, w3, s3, 10.0), n)


def _routed_f32(seed: int, E: int, d: int, inter: int):
    """(module computing moe_experts_routed with random f32 experts, its experts (w1, w2, w3))."""
    from dsv4.model.kernels import moe

    g = torch.Generator().manual_seed(seed)
    w1, w2, w3 = (torch.randn(E, o, i, generator=g) for o, i in ((inter, d), (d, inter), (inter, d)))

    class M(torch.nn.Module):
        def forward(self, x, w, i):
            return moe.moe_experts_routed(x, w, i, w1, None, w2, None, w3, None, 10.0)

    return M(), (w1, w2, w3)


def test_prefill_blocks_follow_the_largest_call(monkeypatch):
    """A traced (prefill) pair count takes 16-row blocks when its largest value routes at most
    SMALL_PREFILL_PAIRS_PER_EXPERT = 12 pairs to an expert on average, else 64-row blocks; either way the
    exported program matches the reference."""
    from dsv4.model.kernels import moe

    rows = []
    real = moe._expert_rows
    monkeypatch.setattr(moe, "_expert_rows", lambda xs, *a, **kw: rows.append(xs.shape[1]) or real(xs, *a, **kw))
    g = torch.Generator().manual_seed(11)
    E, d, k = 8, 32, 2
    m, (w1, w2, w3) = _routed_f32(11, E, d, 16)
    assert moe.SMALL_PREFILL_PAIRS_PER_EXPERT == 12
    ex = (torch.randn(8, d), torch.rand(8, k), torch.randint(0, E, (8, k)))
    for most, want in ((48, 16), (49, 64)):  # 48 tokens x 2 slots = 12 pairs for each of 8 experts
        rows.clear()
        N = torch.export.Dim("N", min=2, max=most)
        prog = torch.export.export(m, ex, dynamic_shapes=({0: N}, {0: N}, {0: N}), strict=False)
        assert rows == [want], (most, rows)
        for n in (2, 30, most):
            x, w, i = torch.randn(n, d, generator=g), torch.rand(n, k, generator=g), torch.randint(0, E, (n, k), generator=g)
            _close(prog.module()(x, w, i), moe_experts(x, w, i, w1, None, w2, None, w3, None, 10.0), (most, n))


def test_static_prefill_pairs_take_the_prefill_forms(monkeypatch):
    """A static pair count above STATIC_PREFILL_PAIRS_MIN (a --static-prefill chunk) takes the prefill's
    blocks, at or below it decode's 16-row blocks; one above PAIRWISE_RANKS_MAX the two-level ranks, at or
    below it the P x P count. The exported programs match the reference."""
    from dsv4.model.kernels import moe

    rows, chunked = [], []
    real_rows, real_ranks = moe._expert_rows, moe._chunked_ranks
    monkeypatch.setattr(moe, "_expert_rows", lambda xs, *a, **kw: rows.append(xs.shape[1]) or real_rows(xs, *a, **kw))
    monkeypatch.setattr(moe, "_chunked_ranks", lambda *a, **kw: chunked.append(True) or real_ranks(*a, **kw))
    g = torch.Generator().manual_seed(12)
    E, d, k = 8, 16, 2
    m, (w1, w2, w3) = _routed_f32(12, E, d, 8)
    assert (moe.STATIC_PREFILL_PAIRS_MIN, moe.PAIRWISE_RANKS_MAX) == (512, 1024)
    # 256 tokens x 2 slots = 512 pairs: decode's blocks; 257: 514 pairs, 64 an expert > 12: 64-row blocks;
    # 513: 1,026 pairs, ranked in two levels
    for n, want_rows, want_chunked in ((256, 16, False), (257, 64, False), (512, 64, False), (513, 64, True)):
        rows.clear(), chunked.clear()
        x, w, i = torch.randn(n, d, generator=g), torch.rand(n, k, generator=g), torch.randint(0, E, (n, k), generator=g)
        prog = torch.export.export(m, (x, w, i), strict=False)
        assert rows == [want_rows] and bool(chunked) == want_chunked, (n, rows, chunked)
        _close(prog.module()(x, w, i), moe_experts(x, w, i, w1, None, w2, None, w3, None, 10.0), n)


def _two_layer_fp4_model() -> Transformer:
    """2 layers (0: sliding + hash-routed, 1: CSA top-k routed) + MTP, fp32 linears, MXFP4 experts."""
    cfg = ModelConfig.preset("tiny").replace(num_hidden_layers=2, compress_ratios=[0, 4, 0], quant_sim=False,
                                             expert_dtype="fp4", quantization_config=None)
    m = init_random(Transformer(cfg, dtype=torch.float32), seed=4)
    q = Transformer(cfg, dtype=torch.float32, quantized=True)
    g = torch.Generator().manual_seed(6)
    sd = m.state_dict()
    with torch.no_grad():
        for name, p in q.named_parameters():
            if p.dtype == torch.uint8:  # packed E2M1 codes and E8M0 scales (2^-9..2^-4)
                lo, hi = (118, 124) if name.endswith("scale") else (0, 256)
                p.copy_(torch.randint(lo, hi, p.shape, generator=g, dtype=torch.uint8))
            else:
                p.copy_(sd[name])
    return q.eval()


@pytest.mark.slow
def test_compiled_llvm_cpu_matches_eager(tmp_path, monkeypatch):
    """Export (llvm-cpu) a 2-layer model with MXFP4 experts: export goes through the routed MoE in
    every program (prefill: grouped, T dynamic; decode bs1: one expert per slot; decode bs8:
    grouped, static), and the compiled module equals eager (the all-experts reference) on a
    prefill with a length-0 row, a decode batch with padding rows and a single decode. About 3-6
    minutes on the shared 2-core box (3 traced programs + llvm-cpu compile)."""
    from dsv4.export.exporter import ExportSpec, export_model
    from dsv4.runtime.module import IreeModule, ensure_runtime_flags
    from dsv4.model.kernels import moe as moe_mod

    calls: list[int] = []
    real = moe_mod.moe_experts_routed

    def counting(x, *a, **kw):
        calls.append(1)
        return real(x, *a, **kw)

    from dsv4.model.kernels import KERNELS

    monkeypatch.setitem(KERNELS["moe_experts"].alternatives, "routed", counting)  # what export traces
    model = _two_layer_fp4_model()
    cfg = model.cfg
    res = export_model(model, ExportSpec(targets=("llvm-cpu",), batch_sizes=(2,), max_chunk=32, n_slots=8, decode_batch_sizes=(1, 8), score=False), tmp_path)
    assert len(calls) == 3 * cfg.n_layers, calls  # 3 programs x the backbone's MoE layers
    ensure_runtime_flags()
    c = res.config
    mod = IreeModule(tmp_path / c["targets"]["llvm-cpu"]["vmfb"], [tmp_path / f for f in c["parameters"]])
    st = new_state(cfg, 8, torch.float32)
    dev = [mod.device_array(v.numpy()) for v in st.values()]
    rng = np.random.default_rng(0)
    worst = 0.0

    def step(fn, tokens, start, lengths, slots, rows):
        nonlocal worst
        args = [torch.as_tensor(np.asarray(a), dtype=torch.int64) for a in (tokens, start, lengths, slots)]
        logits, _ = mod(fn, *[a.numpy() for a in args], *dev)
        with torch.no_grad():
            want = model(*args, st).numpy()
        np.testing.assert_allclose(logits[rows], want[rows], atol=2e-4, rtol=2e-4, err_msg=fn)
        worst = max(worst, float(np.abs(logits[rows] - want[rows]).max()))

    step("prefill_bs2", rng.integers(0, cfg.vocab_size, (2, 23)), [0, 0], [23, 0], [1, 0], [0])
    step("prefill_bs2", rng.integers(0, cfg.vocab_size, (2, 9)), [23, 0], [9, 7], [1, 0], [0, 1])
    step("decode_bs8", rng.integers(0, cfg.vocab_size, (8, 1)), [32, 7] + [0] * 6, [1, 1, 0, 1, 1, 0, 1, 1],
         [1, 0, 2, 3, 4, 5, 6, 7], [0, 1, 3, 4, 6, 7])
    step("decode_bs1", rng.integers(0, cfg.vocab_size, (1, 1)), [33], [1], [1], [0])
    print(f"compiled vs eager: max |logit diff| {worst:.3g}")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_two_stacked_routed_layers_compiled_llvm_cpu(tmp_path, fmt):
    """Two routed MoE layers in one graph (the second routes on the first's output: docs/export.md, IREE 3.13 traps's
    failing shape), exported with a dynamic token count (grouped path) and two static ones (one
    expert per slot; grouped with a static bound), compiled for llvm-cpu: equal to eager (the
    all-experts reference) at several token counts, for MXFP4 and FP8 (+ E8M0 block scale) experts.
    About a minute each."""
    import subprocess

    import iree.runtime as rt
    from iree.compiler.tools.binaries import find_tool
    from iree.turbine import aot

    import dsv4.export  # noqa: F401  (compat shim)

    g = torch.Generator().manual_seed(9)
    E, d, inter, k = 8, 128, 128, 2
    ws = [expert_weights(fmt, E, o, i, g)[:2] for o, i in ((inter, d), (d, inter), (inter, d))]

    def two_layers(moe, x, w, i, p):
        y = moe(x, w, i, p[0], p[1], p[2], p[3], p[4], p[5], 10.0)
        i2 = (y[:, :k].abs() * 1000).to(torch.int64) % E  # data-dependent routing of layer 2
        return moe(y, w, i2, p[0], p[1], p[2], p[3], p[4], p[5], 10.0)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for n, t in zip(("w1", "s1", "w2", "s2", "w3", "s3"), [t for pair in ws for t in pair]):
                # FP8 constants cannot be inlined into the module (docs/export.md, IREE 3.13 traps): held as bytes
                self.register_buffer(n, t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)

        def forward(self, x, w, i):
            p = (self.w1, self.s1, self.w2, self.s2, self.w3, self.s3)
            if fmt == "fp8":
                p = tuple(t.view(torch.float8_e4m3fn) if n.startswith("w") else t for n, t in zip("wswsws", p))
            return two_layers(moe_experts_routed, x, w, i, p)

    m = M()
    fxb = aot.FxProgramsBuilder(m)
    N = torch.export.Dim("N", min=2, max=256)

    def ex(n):
        return torch.randn(n, d), torch.rand(n, k), torch.randint(0, E, (n, k))

    fxb.export_program(lambda mm, x, w, i: mm(x, w, i), name="dyn", args=ex(8),
                       dynamic_shapes=({0: N}, {0: N}, {0: N}), strict=False)
    for n in (2, 8):  # P = 4 <= E: one expert per slot; P = 16 > E: grouped, static bound
        fxb.export_program(lambda mm, x, w, i: mm(x, w, i), name=f"static{n}", args=ex(n), strict=False)
    mlir, vmfb = tmp_path / "moe.mlir", tmp_path / "moe.vmfb"
    aot.export(fxb, import_symbolic_shape_expressions=False).save_mlir(str(mlir))
    run = subprocess.run([find_tool("iree-compile"), str(mlir), "--iree-hal-target-device=local",
                          "--iree-hal-local-target-device-backends=llvm-cpu", "--iree-llvmcpu-target-cpu=host",
                          "-o", str(vmfb)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    ctx = rt.SystemContext(config=rt.Config("local-task"))
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb.read_bytes()))
    p = tuple(t for pair in ws for t in pair)
    for name, n in (("dyn", 2), ("dyn", 3), ("dyn", 50), ("dyn", 256), ("static2", 2), ("static8", 8)):
        x, w, i = torch.randn(n, d, generator=g), torch.rand(n, k, generator=g), torch.randint(0, E, (n, k), generator=g)
        got = torch.from_numpy(np.asarray(ctx.modules.module[name](x.numpy(), w.numpy(), i.numpy()).to_host()))
        _close(got, two_layers(moe_experts, x, w, i, p), (name, n))


@pytest.mark.slow  # compiles (tests/conftest.py)
def test_prefill_quantizes_each_token_once_compiled_llvm_cpu(tmp_path, monkeypatch):
    """A prefill (dynamic token count) with MXFP4 experts and the gathered GEMM as its MLIR kernel: the tokens
    are quantized once (the fp8_qdq kernel) and the GEMMs take them as they are (x_quantized); compiled
    for llvm-cpu, equal to eager's all-experts reference at several token counts."""
    import iree.runtime as rt
    from iree.turbine import aot

    import dsv4.export  # noqa: F401  (compat shim)
    from dsv4.export.compile import compile_mlir, resolve_target
    from dsv4.export.kernel_op import use_kernels
    from dsv4.model.kernels import moe

    hoisted = []
    real = moe.fp8_qdq
    monkeypatch.setattr(moe, "fp8_qdq", lambda *a: hoisted.append(True) or real(*a))
    g = torch.Generator().manual_seed(13)
    E, d, inter, k = 8, 128, 128, 2
    ws = [expert_weights("fp4", E, o, i, g)[:2] for o, i in ((inter, d), (d, inter), (inter, d))]
    p = tuple(t for pair in ws for t in pair)

    class M(torch.nn.Module):
        def forward(self, x, w, i):
            return moe_experts_routed(x, w, i, *p, 10.0)

    fxb = aot.FxProgramsBuilder(M())
    N = torch.export.Dim("N", min=2, max=256)
    with torch.no_grad(), use_kernels({"mxfp4_linear_gathered": "kernel"}):
        fxb.export_program(lambda mm, x, w, i: mm(x, w, i), name="dyn",
                           args=(torch.randn(8, d), torch.rand(8, k), torch.randint(0, E, (8, k))),
                           dynamic_shapes=({0: N}, {0: N}, {0: N}), strict=False)
    assert hoisted == [True]
    mlir, vmfb = tmp_path / "moe.mlir", tmp_path / "moe.vmfb"
    aot.export(fxb, import_symbolic_shape_expressions=False).save_mlir(str(mlir))
    compile_mlir(mlir, resolve_target("llvm-cpu"), vmfb)
    ctx = rt.SystemContext(config=rt.Config("local-task"))
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb.read_bytes()))
    for n in (2, 37, 256):
        x, w, i = torch.randn(n, d, generator=g), torch.rand(n, k, generator=g), torch.randint(0, E, (n, k), generator=g)
        got = torch.from_numpy(np.asarray(ctx.modules.module["dyn"](x.numpy(), w.numpy(), i.numpy()).to_host()))
        _close(got, moe_experts(x, w, i, *p, 10.0), n)


@pytest.mark.slow  # iree-compile to flow, twice (seconds)
def test_prefill_moe_never_copies_expert_weights(tmp_path):
    """The routed MoE over a dynamic token count with `mxfp4_linear_gathered=kernel` (opt-in; the
    export default gathers first, see export/compile.py), compiled for llvm-cpu down to its
    dispatches: no dispatch writes a per-block copy of an expert's weight (a result with a dynamic dim and an
    expert's inter x d elements per row). With the experts gathered before the stacked kernel
    (`mxfp4_linear_gathered=reference`), IREE fuses gather + decode into one dispatch writing a decoded
    copy per block (bf16 with the default MXFP4 kernel; f32 before: 27.6 GB for a 100-token Flash
    prefill, which llvm-cpu could not allocate). The check finds that one, so it can fail."""
    import re
    import subprocess

    from iree.compiler.tools.binaries import find_tool
    from iree.turbine import aot

    import dsv4.export  # noqa: F401  (compat shim)
    from dsv4.export.kernel_op import use_kernels

    g = torch.Generator().manual_seed(5)
    E, d, inter, k = 8, 128, 256, 2
    ws = [expert_weights("fp4", E, o, i, g)[:2] for o, i in ((inter, d), (d, inter), (inter, d))]

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for n, t in zip(("w1", "s1", "w2", "s2", "w3", "s3"), [t for pair in ws for t in pair]):
                self.register_buffer(n, t)

        def forward(self, x, w, i):
            return moe_experts_routed(x, w, i, self.w1, self.s1, self.w2, self.s2, self.w3, self.s3, 10.0)

    def copies(choices: dict) -> list[str]:
        fxb = aot.FxProgramsBuilder(M())
        N = torch.export.Dim("N", min=2, max=256)
        args = (torch.randn(8, d), torch.rand(8, k), torch.randint(0, E, (8, k)))
        with torch.no_grad(), use_kernels(choices):
            fxb.export_program(lambda mm, x, w, i: mm(x, w, i), name="dyn", args=args,
                               dynamic_shapes=({0: N}, {0: N}, {0: N}), strict=False)
        mlir, flow = tmp_path / "moe.mlir", tmp_path / "moe.flow.mlir"
        aot.export(fxb, import_symbolic_shape_expressions=False).save_mlir(str(mlir))
        run = subprocess.run([find_tool("iree-compile"), str(mlir), "--iree-hal-target-device=local",
                              "--iree-hal-local-target-device-backends=llvm-cpu", "--compile-to=flow",
                              "-o", str(flow)], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        found = []
        for line in flow.read_text().splitlines():
            if "flow.dispatch @" not in line:
                continue
            for dims in re.findall(r"-> \(?tensor<\?x([\dx]+)x(?:bf16|[if]\d+)>", line):
                if math.prod(int(v) for v in dims.split("x")) >= inter * d:
                    found.append(line.strip()[:160])
        return found

    assert copies({"mxfp4_linear_gathered": "kernel"}) == []
    assert copies({"mxfp4_linear_gathered": "reference"}), "the check no longer sees the gathered copy"


@pytest.mark.slow  # compiles (tests/conftest.py)
def test_pair_ranks_export_form_compiled_llvm_cpu(tmp_path):
    """The ranks' export form (two levels over chunks of RANK_CHUNK pairs) traced with a dynamic pair
    count and compiled for llvm-cpu: one chunk, several, and a partial last chunk, against the
    definition by loops."""
    from iree.turbine import aot

    from dsv4.export.compile import compile_mlir
    from dsv4.model.kernels.moe import RANK_CHUNK
    from dsv4.runtime.module import IreeModule

    class Ranks(torch.nn.Module):
        def forward(self, e):
            return pair_ranks(e, 9)

    P = torch.export.Dim("P", min=2, max=4096)
    fxb = aot.FxProgramsBuilder(Ranks())
    fxb.export_program(lambda m, e: m(e), name="ranks", args=(torch.zeros(40, dtype=torch.int64),),
                       dynamic_shapes={"e": {0: P}}, strict=False)
    mlir = tmp_path / "ranks.mlir"
    aot.export(fxb).save_mlir(str(mlir))
    mod = IreeModule(compile_mlir(mlir, "llvm-cpu", tmp_path / "ranks.vmfb").path)
    g = torch.Generator().manual_seed(5)
    for n in (2, 40, RANK_CHUNK, 3 * RANK_CHUNK + 17):
        e = torch.randint(0, 9, (n,), generator=g)
        want = [sum(1 for j in range(i) if e[j] == e[i]) for i in range(n)]
        assert np.asarray(mod("ranks", e.numpy())).tolist() == want, n
