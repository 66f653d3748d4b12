"""model/checkpoint/: write a random tiny checkpoint in the released format, load it back.

What is checked, and against what:
- the written files hold exactly the official inventory (names, dtypes, shapes), which this file
  builds on its own from the spec's table (§4.2), not from the writer's code;
- loading keeps low-bit tensors byte-exact (FP8 weights, E8M0 scales, packed MXFP4 experts stacked
  per layer), float tensors value-exact, `wo_a` dequantized exactly; writing the loaded model again
  gives the same bytes (only `wo_a`, re-quantized from its dequantized values, may pick a smaller
  scale: same values);
- the config (conftest.grid_cfg) gives the dense FP8 weights 2-D block-scale grids, and the float
  model's 128x128 blocks are scaled by random powers of two first, so the grids are random and
  asymmetric: a grid read transposed changes bytes and logits;
- the transformers layout (renamed, experts stacked as gate_up/down, transformers-form config.json)
  loads into the very same model;
- logits: a float64 reference whose weights are decoded here from the raw bytes (own E2M1 / e4m3fn /
  E8M0 tables) and whose FP8/FP4 linears quantize their input activations as the reference kernels do
  must match the loaded quantized model to 1e-4 (measured ~1e-6: fp32 vs float64 rounding). Against
  the float model the checkpoint was quantized from the tolerance is rel-RMS 0.2 (measured 0.125):
  FP8 keeps 3 mantissa bits (~3% RMS per weight) and this random model amplifies weight noise about
  4x (1e-3 relative weight noise moves its logits by 0.5-2%), so that number measures quantization,
  not the loader;
- every structural problem (missing, extra, mis-shaped, mis-typed tensors) comes in ONE error, so do
  corrupt values; truncated shards and pickle-only directories are refused;
- loading memory: peak anonymous RSS of a load in a fresh process relative to the checkpoint size.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import dsv4.model.kernels.moe as moe_kernels
import dsv4.model.layers as layers_mod
from dsv4.model.checkpoint import (
    CheckpointError,
    canonical_name,
    load_checkpoint,
    open_checkpoint,
    transformers_config_dict,
    transformers_name,
    write_checkpoint,
)
from dsv4.model.checkpoint.load import _no_param_init
from dsv4.model.config import ConfigError, ModelConfig
from dsv4.model.model import Transformer, init_random
from dsv4.model.state import new_state
from dsv4.contract.tokenizer import load_tokenizer
from dsv4.train.tokenizer import corpus_tokenizer
from dsv4.cli.checkpoint import checkpoint_make_main

from conftest import grid_cfg, scatter_block_scales

S = 40  # crosses the window (8) five times, ratio-4 entries ten times, ratio-16 entries twice
EVAL = dict(quant_sim=False, index_topk=64)  # no QAT sims, every visible CSA entry selected
REPORT: dict[str, float] = {}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def i64(*v):
    return torch.tensor(v, dtype=torch.long)


def logits(model, toks):
    with torch.no_grad():
        st = new_state(model.cfg, 1, model.dtype)
        return model(toks[None], i64(0), i64(len(toks)), i64(0), st, all_logits=True)[0].double()


def read_all(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def header(d: Path) -> dict[str, tuple[str, list[int]]]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[k] = (h.get_slice(k).get_dtype(), h.get_slice(k).get_shape())
    return out


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


# ---- independent decoders (docs/model.md, Quantization formats) --------------------------------------------------------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    dtype=torch.float64)


def _e4m3fn(c: int) -> float:
    if c & 0x7F == 0x7F:
        return math.nan
    e, m = (c >> 3) & 15, c & 7
    mag = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if c & 0x80 else mag


E4M3FN = torch.tensor([_e4m3fn(c) for c in range(256)], dtype=torch.float64)


def dec_scale(s: torch.Tensor) -> torch.Tensor:
    if s.dtype == torch.float32:
        return s.double()
    return torch.exp2(s.view(torch.uint8).double() - 127)


def dec_weight(raw: dict, base: str) -> torch.Tensor:
    w, s = raw[base + ".weight"], raw.get(base + ".scale")
    if s is None:
        return w.double()
    if w.dtype == torch.float8_e4m3fn:
        n, k = w.shape
        full = dec_scale(s).repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        return E4M3FN[w.view(torch.uint8).long()] * full
    b = w.view(torch.uint8).long()
    codes = torch.stack([b & 15, b >> 4], -1).flatten(-2)  # low nibble first
    return E2M1[codes] * dec_scale(s).repeat_interleave(32, -1)


def round_e4m3_64(v: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3fn value in float64 (ties to even, saturating): step 2^(e-3) in binade e >= -6."""
    a = v.abs().clamp(max=448.0)
    e = torch.floor(torch.log2(a.clamp_min(2.0**-6)))
    step = torch.exp2(e - 3)
    return torch.copysign(torch.round(a / step) * step, v)


def act_qdq64(x: torch.Tensor) -> torch.Tensor:
    """The reference kernels' activation quantization (docs/model.md, Reference numerics), in float64."""
    k = x.shape[-1]
    nb = math.ceil(k / 128)
    xb = F.pad(x, (0, nb * 128 - k)).unflatten(-1, (nb, 128))
    s = torch.exp2(torch.ceil(torch.log2(xb.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0)))
    return (round_e4m3_64(xb / s) * s).flatten(-2)[..., :k]


# ---- the spec's inventory ---------------------------------------------------------------------


def official_inventory(cfg: ModelConfig) -> dict[str, tuple[str, list[int]]]:
    """Name -> (safetensors dtype, shape) of a released checkpoint, from docs/model.md, Checkpoint format (FP4 experts)."""
    d, V, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    H, D, G, ol, ql = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank, cfg.q_lora_rank
    Hi, di, E, k = cfg.index_n_heads, cfg.index_head_dim, cfg.n_routed_experts, cfg.num_experts_per_tok
    inter = cfg.moe_intermediate_size
    inv: dict[str, tuple[str, list[int]]] = {}

    def fp8(name, out, inp):
        inv[name + ".weight"] = ("F8_E4M3", [out, inp])
        inv[name + ".scale"] = ("F8_E8M0", [math.ceil(out / 128), math.ceil(inp / 128)])

    def bf16(name, *shape):
        inv[name] = ("BF16", list(shape))

    def f32(name, *shape):
        inv[name] = ("F32", list(shape))

    bf16("embed.weight", V, d)
    bf16("head.weight", V, d)
    bf16("norm.weight", d)
    f32("hc_head_fn", n, n * d), f32("hc_head_base", n), f32("hc_head_scale", 1)
    blocks = [f"layers.{i}." for i in range(cfg.n_layers)] + [f"mtp.{j}." for j in range(cfg.n_mtp)]
    for i, p in enumerate(blocks):
        ratio = cfg.compress_ratios[i]
        bf16(p + "attn_norm.weight", d), bf16(p + "ffn_norm.weight", d)
        for kind in ("attn", "ffn"):
            f32(f"{p}hc_{kind}_fn", (2 + n) * n, n * d), f32(f"{p}hc_{kind}_base", (2 + n) * n)
            f32(f"{p}hc_{kind}_scale", 3)
        f32(p + "attn.attn_sink", H)
        fp8(p + "attn.wq_a", ql, d), bf16(p + "attn.q_norm.weight", ql), fp8(p + "attn.wq_b", H * D, ql)
        fp8(p + "attn.wkv", D, d), bf16(p + "attn.kv_norm.weight", D)
        fp8(p + "attn.wo_a", G * ol, H * D // G), fp8(p + "attn.wo_b", d, G * ol)
        if ratio:
            c = 2 if ratio == 4 else 1
            bf16(p + "attn.compressor.wkv.weight", c * D, d), bf16(p + "attn.compressor.wgate.weight", c * D, d)
            f32(p + "attn.compressor.ape", ratio, c * D), bf16(p + "attn.compressor.norm.weight", D)
        if ratio == 4:
            fp8(p + "attn.indexer.wq_b", Hi * di, ql), bf16(p + "attn.indexer.weights_proj.weight", Hi, d)
            bf16(p + "attn.indexer.compressor.wkv.weight", 2 * di, d)
            bf16(p + "attn.indexer.compressor.wgate.weight", 2 * di, d)
            f32(p + "attn.indexer.compressor.ape", 4, 2 * di), bf16(p + "attn.indexer.compressor.norm.weight", di)
        bf16(p + "ffn.gate.weight", E, d)
        if p.startswith("layers.") and i < cfg.num_hash_layers:
            inv[p + "ffn.gate.tid2eid"] = ("I64", [V, k])
        else:
            f32(p + "ffn.gate.bias", E)
        for e in range(E):
            for w, (o, i_) in {"w1": (inter, d), "w2": (d, inter), "w3": (inter, d)}.items():
                inv[f"{p}ffn.experts.{e}.{w}.weight"] = ("I8", [o, i_ // 2])
                inv[f"{p}ffn.experts.{e}.{w}.scale"] = ("F8_E8M0", [o, i_ // 32])
        fp8(p + "ffn.shared_experts.w1", inter, d), fp8(p + "ffn.shared_experts.w2", d, inter)
        fp8(p + "ffn.shared_experts.w3", inter, d)
        if p.startswith("mtp."):
            fp8(p + "e_proj", d, d), fp8(p + "h_proj", d, d)
            bf16(p + "enorm.weight", d), bf16(p + "hnorm.weight", d), bf16(p + "norm.weight", d)
            f32(p + "hc_head_fn", n, n * d), f32(p + "hc_head_base", n), f32(p + "hc_head_scale", 1)
    return inv


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cfg():
    return grid_cfg()


@pytest.fixture(scope="module")
def float_model(cfg):
    return scatter_block_scales(init_random(Transformer(cfg, dtype=torch.float32), seed=0, std=0.02), seed=1)


@pytest.fixture(scope="module")
def official(tmp_path_factory, float_model, cfg):
    return write_checkpoint(float_model, cfg, tmp_path_factory.mktemp("ckpt") / "official",
                            tokenizer=corpus_tokenizer(cfg.vocab_size))


@pytest.fixture(scope="module")
def loaded(official):
    return load_checkpoint(official)


@pytest.fixture(scope="module")
def toks():
    return torch.randint(0, 512, (S,), generator=torch.Generator().manual_seed(3))


# ---- layout and round trips -------------------------------------------------------------------


def test_writes_the_official_layout(official, cfg):
    assert header(official) == official_inventory(cfg)
    assert sorted(p.name for p in official.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert ModelConfig.from_json(official) == cfg
    assert load_tokenizer(official).get_vocab_size() == cfg.vocab_size
    with safe_open(str(official / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_load_keeps_low_bit_bytes(official, loaded, cfg):
    raw = read_all(official)
    assert loaded.cfg == cfg and open_checkpoint(official).layout == "official"
    st = loaded.state_dict()
    assert st["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert st["layers.0.ffn.experts.w1"].dtype == torch.uint8
    used = set()
    for name, t in st.items():
        m = re.match(r"^(.*\.ffn\.experts)\.(w[123])(_scale)?$", name)
        if m:
            leaf = "scale" if m.group(3) else "weight"
            for e in range(t.shape[0]):
                key = f"{m.group(1)}.{e}.{m.group(2)}.{leaf}"
                assert torch.equal(raw_bytes(t[e]), raw_bytes(raw[key])), key
                used.add(key)
        elif name.endswith("attn.wo_a.weight"):  # FP8 in the checkpoint, dequantized at load
            base = name[: -len(".weight")]
            assert torch.equal(t, dec_weight(raw, base).to(t.dtype)), name
            used |= {name, base + ".scale"}
        elif t.element_size() == 1:
            assert torch.equal(raw_bytes(t), raw_bytes(raw[name])), name
            used.add(name)
        else:
            assert torch.equal(t, raw[name].to(t.dtype)), name
            used.add(name)
    assert used == set(raw)


def test_rewrite_gives_the_same_bytes(official, loaded, tmp_path):
    again = write_checkpoint(loaded, loaded.cfg, tmp_path / "again", tokenizer=official)
    a, b = read_all(official), read_all(again)
    assert a.keys() == b.keys()
    for k in a:
        if ".attn.wo_a." in k:
            continue
        assert a[k].dtype == b[k].dtype and torch.equal(raw_bytes(a[k]), raw_bytes(b[k])), k
    for k in (k for k in a if k.endswith("attn.wo_a.weight")):
        assert torch.equal(dec_weight(a, k[:-7]), dec_weight(b, k[:-7])), k
    assert json.loads((official / "config.json").read_text()) == json.loads((again / "config.json").read_text())
    assert (official / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


def test_name_mappings_invert(official):
    names = list(header(official))
    for n in names:
        assert canonical_name(n) == n  # official names are canonical
        hf = transformers_name(n)
        assert canonical_name(hf) == n, (n, hf)
        assert hf == n if n.startswith("mtp.") else hf.startswith(("model.", "lm_head."))
    assert transformers_name("layers.3.attn.indexer.compressor.norm.weight") == \
        "model.layers.3.self_attn.compressor.indexer.kv_norm.weight"
    assert transformers_name("layers.0.hc_attn_scale") == "model.layers.0.attn_hc.scale"
    assert transformers_name("layers.0.attn.wq_a.scale") == "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    # what transformers' save_pretrained writes (its reverse conversion), docs/model.md, Checkpoint format
    for saved, canon in {"model.layers.0.attn.norm.weight": "layers.0.attn.kv_norm.weight",
                         "model.embed_tokens.weight": "embed.weight", "head.weight": "head.weight",
                         "model.hc_head.hc_fn": "hc_head_fn", "model.norm.weight": "norm.weight",
                         "model.layers.1.attn.indexer.compressor.norm.weight":
                             "layers.1.attn.indexer.compressor.norm.weight"}.items():
        assert canonical_name(saved) == canon


def test_transformers_layout_round_trip(float_model, loaded, cfg, tmp_path):
    d = write_checkpoint(float_model, cfg, tmp_path / "hf", layout="transformers")
    conf = json.loads((d / "config.json").read_text())
    assert "compress_ratios" not in conf and conf["compress_rates"]["heavily_compressed_attention"] == 16
    assert conf["layer_types"][:2] == ["sliding_attention", "compressed_sparse_attention"]
    assert conf["mlp_layer_types"] == ["hash_moe", "moe", "moe", "moe"]
    assert conf["quantization_config"]["expert_dtype"] == "fp4"
    h = header(d)
    assert all(k.startswith(("model.", "mtp.")) or k == "lm_head.weight" for k in h)
    E, inter, dm = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    assert h["model.layers.1.mlp.experts.gate_up_proj"] == ("I8", [E, 2 * inter, dm // 2])
    assert h["model.layers.1.mlp.experts.gate_up_proj_scale_inv"] == ("F8_E8M0", [E, 2 * inter, dm // 32])
    assert h["model.layers.1.mlp.experts.down_proj"] == ("I8", [E, dm, inter // 2])
    assert h["model.layers.1.self_attn.q_a_proj.weight_scale_inv"][0] == "F8_E8M0"
    ck = open_checkpoint(d)
    assert ck.layout == "transformers"
    m = load_checkpoint(d)
    assert m.cfg == loaded.cfg
    a, b = loaded.state_dict(), m.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(raw_bytes(a[k]), raw_bytes(b[k])), k


def test_base_style_fp8_experts_and_float32_scales(float_model, cfg, tmp_path):
    """-Base checkpoints: FP8 experts, float32 block scales (docs/model.md, Configuration) stay as stored."""
    base_cfg = cfg.replace(expert_dtype="fp8", quantization_config={**cfg.quantization_config, "scale_fmt": "fp32"})
    d = write_checkpoint(float_model, base_cfg, tmp_path / "base")
    h = header(d)
    assert h["layers.0.ffn.experts.0.w1.weight"] == ("F8_E4M3", [256, 256])  # grid_cfg: moe_inter x hidden
    assert h["layers.0.ffn.experts.0.w1.scale"] == ("F32", [2, 2])
    assert h["layers.0.attn.wq_b.scale"] == ("F32", [4, 2])  # heads x head_dim = 512 by q_lora_rank 256
    m = load_checkpoint(d)
    st = m.state_dict()
    assert st["layers.0.attn.wq_b.scale"].dtype == torch.float32  # the model.py scale_fmt knob
    assert st["layers.0.ffn.experts.w1_scale"].dtype == torch.float32
    raw = read_all(d)
    assert torch.equal(st["layers.0.attn.wq_b.scale"], raw["layers.0.attn.wq_b.scale"])
    assert torch.equal(st["layers.2.ffn.experts.w3"][5].view(torch.uint8),
                       raw["layers.2.ffn.experts.5.w3.weight"].view(torch.uint8))
    s = st["layers.0.attn.wq_b.scale"]
    assert not torch.equal(s, torch.exp2(torch.log2(s).round()))  # amax/448, not rounded to powers of two


def test_sharded_write_and_index(official, loaded, tmp_path):
    d = write_checkpoint(loaded, loaded.cfg, tmp_path / "sharded", max_shard_bytes=400_000)
    shards = sorted(d.glob("*.safetensors"))
    assert len(shards) > 4 and shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in read_all(d).values())
    m = load_checkpoint(d)
    for k, v in loaded.state_dict().items():
        assert torch.equal(raw_bytes(v), raw_bytes(m.state_dict()[k])), k


# ---- numerics ---------------------------------------------------------------------------------


def test_quantized_logits_vs_float_and_float64_reference(official, float_model, cfg, toks, monkeypatch):
    ecfg = cfg.replace(**EVAL)
    fm = Transformer(ecfg, dtype=torch.float32)
    fm.load_state_dict(float_model.state_dict())
    q = load_checkpoint(official, dtype=torch.float32, overrides=EVAL)
    deq = load_checkpoint(official, dtype=torch.float64, quantized=False, overrides=EVAL)

    # float64 reference from the raw bytes, decoded here
    raw = read_all(official)
    ref = Transformer(ecfg, dtype=torch.float64)
    sd, act_quant = {}, set()
    for name, t in ref.state_dict().items():
        m = re.match(r"^(.*\.ffn\.experts)\.(w[123])$", name)
        if m:
            sd[name] = torch.stack([dec_weight(raw, f"{m.group(1)}.{e}.{m.group(2)}") for e in range(t.shape[0])])
        elif name.endswith(".weight") and name[:-7] + ".scale" in raw:
            sd[name] = dec_weight(raw, name[:-7])
        else:
            sd[name] = raw[name].double() if raw[name].dtype.is_floating_point else raw[name]
    ref.load_state_dict(sd)
    for name, t in deq.state_dict().items():  # the loader's dequantization == the independent decode
        assert torch.equal(t, ref.state_dict()[name]), name
    for name, p in ref.named_parameters():
        is_experts = re.search(r"\.ffn\.experts\.w[123]$", name)
        if is_experts or (name.endswith(".weight") and name[:-7] + ".scale" in raw and ".attn.wo_a." not in name):
            act_quant |= {p[e].data_ptr() for e in range(p.shape[0])} if is_experts else {p.data_ptr()}

    plain = layers_mod.linear

    def linear(x, w, scale=None):  # FP8/FP4 linears quantize their input as the kernels do
        return plain(act_qdq64(x) if w.data_ptr() in act_quant else x, w, scale)

    monkeypatch.setattr(layers_mod, "linear", linear)
    plain_stacked = moe_kernels.stacked_linear

    def stacked_linear(x, w, scale=None):  # expert stacks: a slice starts at some expert's data
        return plain_stacked(act_qdq64(x) if w.data_ptr() in act_quant else x, w, scale)

    monkeypatch.setattr(moe_kernels, "stacked_linear", stacked_linear)
    r = logits(ref, toks)
    monkeypatch.undo()

    lq, lf = logits(q, toks), logits(fm, toks)
    d_ref = (lq - r).abs().max().item()
    rel = ((lq - lf).norm() / lf.norm()).item()
    REPORT.update({"quantized vs float64 reference max|d|": d_ref, "quantized vs float rel-RMS": rel,
                   "logit RMS": lf.pow(2).mean().sqrt().item()})
    print(f"\n[checkpoint] quantized vs float64 reference: max |d| {d_ref:.3g}; "
          f"vs the float model: rel-RMS {rel:.3g}, max |d| {(lq - lf).abs().max().item():.3g} "
          f"(logit RMS {REPORT['logit RMS']:.3g})")
    assert d_ref < 1e-4
    assert rel < 0.2
    # top-1 agreement, derived: were the quantization error independent noise of the measured size on
    # these very logits, agreement would be `expect` (Monte Carlo); allow 3 binomial sigmas below it
    # over the positions. (A systematic error, e.g. a mis-scaled layer, lowers it much further.)
    agree = (lq.argmax(-1) == lf.argmax(-1)).double().mean().item()
    noisy = lf[None] + (lq - lf).std() * torch.randn(400, *lf.shape, generator=torch.Generator().manual_seed(0))
    expect = (noisy.argmax(-1) == lf.argmax(-1)).double().mean().item()
    n = lf.reshape(-1, lf.shape[-1]).shape[0]
    print(f"[checkpoint] top-1 agreement quantized vs float {agree:.3f} over {n} positions "
          f"(expected for independent noise: {expect:.3f})")
    assert agree >= expect - 3 * math.sqrt(expect * (1 - expect) / n)


# ---- errors -----------------------------------------------------------------------------------


def rewrite(d: Path, edit) -> None:
    f = d / "model.safetensors"
    t = load_file(str(f))
    edit(t)
    save_file(t, str(f), metadata={"format": "pt"})


def test_structural_problems_come_in_one_error(official, tmp_path):
    d = Path(shutil.copytree(official, tmp_path / "bad"))

    def edit(t):
        del t["layers.0.attn.wq_a.scale"]
        t["layers.0.attn.bogus"] = torch.zeros(3)
        t["layers.1.attn_norm.weight"] = torch.zeros(64, dtype=torch.bfloat16)
        t["layers.2.attn.wq_b.weight"] = t["layers.2.attn.wq_b.weight"].to(torch.bfloat16)
        t["layers.3.ffn.experts.7.w2.weight"] = t["layers.3.ffn.experts.7.w2.weight"].float()
        t["layers.0.ffn.gate.tid2eid"] = t["layers.0.ffn.gate.tid2eid"].float()
        del t["mtp.0.ffn.experts.1.w3.weight"]

    rewrite(d, edit)
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(d)
    p = ei.value.problems
    msg = str(ei.value)
    print("\n" + msg)
    assert len(p) == 7 and msg.startswith(f"checkpoint {d}: 7 problem(s)")
    for kind, name in [("missing", "layers.0.attn.wq_a.scale"), ("extra", "layers.0.attn.bogus"),
                       ("shape", "layers.1.attn_norm.weight"), ("dtype", "layers.2.attn.wq_b.weight"),
                       ("dtype", "layers.3.ffn.experts.7.w2.weight"), ("dtype", "layers.0.ffn.gate.tid2eid"),
                       ("missing", "mtp.0.ffn.experts.1.w3.weight")]:
        assert any(x.startswith(f"{kind}: {name} ") for x in p), (kind, name)


def test_corrupt_values_come_in_one_error(official, tmp_path):
    d = Path(shutil.copytree(official, tmp_path / "corrupt"))

    def edit(t):
        s = t["layers.0.attn.wkv.scale"].view(torch.uint8).clone()
        s[0, 0] = 0xFF  # E8M0 NaN
        t["layers.0.attn.wkv.scale"] = s.view(torch.float8_e8m0fnu)
        w = t["layers.1.attn.wq_b.weight"].view(torch.uint8).clone()
        w[3, 5] = 0x7F  # e4m3fn NaN
        t["layers.1.attn.wq_b.weight"] = w.view(torch.float8_e4m3fn)
        t["layers.2.hc_attn_fn"][1, 2] = math.inf
        t["layers.0.ffn.gate.tid2eid"][7, 1] = 99
        e = t["layers.3.ffn.experts.0.w1.scale"].view(torch.uint8).clone()
        e[2, 1] = 0xFF
        t["layers.3.ffn.experts.0.w1.scale"] = e.view(torch.float8_e8m0fnu)

    rewrite(d, edit)
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(d)
    p = ei.value.problems
    assert len(p) == 5, p
    for name in ("layers.0.attn.wkv.scale", "layers.1.attn.wq_b.weight", "layers.2.hc_attn_fn",
                 "layers.0.ffn.gate.tid2eid", "layers.3.ffn.experts.0.w1.scale"):
        assert any(x.startswith(f"value: {name} ") for x in p), name
    load_checkpoint(d, check_values=False)  # the checks can be skipped


def test_truncated_and_missing_shards(loaded, tmp_path):
    d = write_checkpoint(loaded, loaded.cfg, tmp_path / "sh", max_shard_bytes=400_000)
    shards = sorted(d.glob("*.safetensors"))
    with open(shards[1], "r+b") as f:
        f.truncate(shards[1].stat().st_size - 1000)
    shards[3].unlink()
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(d)
    p = ei.value.problems
    assert len(p) == 2, p
    assert any(shards[1].name in x and "truncated" in x for x in p)
    assert any(shards[3].name in x and "does not exist" in x for x in p)


def test_pickles_are_never_loaded(tmp_path, official):
    marker = tmp_path / "unpickled"

    class Bomb:
        def __reduce__(self):
            return (Path.touch, (marker,))

    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(official / "config.json", d)
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(Bomb()))
    with pytest.raises(CheckpointError, match="never loaded"):
        load_checkpoint(d)
    assert not marker.exists()


# ---- config forms, CLI ------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "flash", "pro"])
def test_transformers_config_form_parses_to_the_same_config(preset):
    cfg = ModelConfig.preset(preset)
    hf = transformers_config_dict(cfg)
    assert "compress_ratios" not in hf and "num_hash_layers" not in hf
    assert ModelConfig.from_dict(hf) == cfg
    plain = cfg.replace(quantization_config=None, expert_dtype=None)
    hf = transformers_config_dict(plain)
    assert "quantization_config" not in hf and ModelConfig.from_dict(hf) == plain


def test_transformers_config_form_errors():
    hf = transformers_config_dict(ModelConfig.preset("tiny"))
    with pytest.raises(ConfigError, match="compressed_sparse_attention"):
        ModelConfig.from_dict({**hf, "compress_rates": {"compressed_sparse_attention": 8}})
    with pytest.raises(ConfigError, match="mlp_layer_types"):
        ModelConfig.from_dict({**hf, "mlp_layer_types": ["moe", "hash_moe", "moe", "moe"]})
    with pytest.raises(ConfigError, match="unknown config field"):
        ModelConfig.from_dict({**hf, "frobnicate": 1})
    bad = json.loads(json.dumps(hf))
    bad["rope_parameters"]["compress"]["attention_factor"] = 1.2
    with pytest.raises(ConfigError, match="attention_factor"):
        ModelConfig.from_dict(bad)


def test_cli_make(tmp_path, capsys):
    out = tmp_path / "cli"
    assert checkpoint_make_main(["--preset", "tiny", "--seed", "3", "-o", str(out), "--layout", "transformers",
                                 "--max-shard-size", "1MB"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (out / "model.safetensors.index.json").exists() and (out / "tokenizer.json").exists()
    m = load_checkpoint(out)
    assert m.state_dict()["layers.1.ffn.experts.w2"].dtype == torch.uint8
    with pytest.raises(FileExistsError):
        checkpoint_make_main(["-o", str(out)])
    assert checkpoint_make_main(["-o", str(out), "--force", "--unquantized"]) == 0
    m = load_checkpoint(out)
    assert m.cfg.quantization_config is None and m.state_dict()["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16


# ---- memory -----------------------------------------------------------------------------------

MEMORY_PROBE = textwrap.dedent("""
    import json, sys, threading, time
    import torch
    torch.set_num_threads(1)
    from dsv4.model.checkpoint import load_checkpoint

    def status():
        out = {}
        for line in open("/proc/self/status"):
            k, _, v = line.partition(":")
            if k in ("RssAnon", "VmRSS", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
        return out

    keep = []  # models stay alive, so no load reuses memory another one freed
    for path in sys.argv[1:]:
        peak, stop = [0], [False]
        def sample():
            while not stop[0]:
                peak[0] = max(peak[0], status()["RssAnon"])
                time.sleep(0.0002)
        base = status()
        try:
            open("/proc/self/clear_refs", "w").write("5")  # restart VmHWM from the current RSS
            hwm = True
        except OSError:
            hwm = False
        th = threading.Thread(target=sample)
        th.start()
        model = load_checkpoint(path, progress=False)
        stop[0] = True
        th.join()
        end = status()
        print(json.dumps({"base_anon": base["RssAnon"], "base_rss": base["VmRSS"], "peak_anon": peak[0],
                          "hwm": end["VmHWM"] if hwm else None,
                          "model_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values())}))
        keep.append(model)
""")


def test_load_memory_is_about_one_checkpoint(tmp_path):
    """A ~70 MB random quantized checkpoint (64 experts of 512x256 per layer), loaded in a fresh
    process from one file and from 8 MiB shards. Peak anonymous memory must stay near the loaded
    model's own size (no second copy); the RSS peak also counts the mapped file pages, which are
    clean page cache, at most a file (one shard when sharded) at a time."""
    cfg = ModelConfig.preset("tiny", hidden_size=256, n_routed_experts=64, moe_intermediate_size=512)
    with _no_param_init():
        model = Transformer(cfg, dtype=torch.bfloat16, quantized=True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.dtype == torch.uint8:  # E8M0 scales near 1, or packed FP4 (any byte is valid)
                lo, hi = (118, 124) if name.endswith("scale") else (0, 256)
                t.copy_(torch.randint(lo, hi, t.shape, generator=g, dtype=torch.uint8))
            elif t.dtype == torch.float8_e4m3fn:
                b = torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8)
                t.view(torch.uint8).copy_(torch.where((b & 0x7F) == 0x7F, 0x3F, b))
            elif name.endswith("tid2eid"):
                t.copy_(torch.randint(0, cfg.n_routed_experts, t.shape, generator=g))
            else:
                t.copy_(torch.randn(t.shape, generator=g) * 0.02)
    one = write_checkpoint(model, cfg, tmp_path / "one")
    shard = 8 << 20
    many = write_checkpoint(model, cfg, tmp_path / "many", max_shard_bytes=shard)
    del model
    ckpt_bytes = (one / "model.safetensors").stat().st_size
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(one), str(many)], capture_output=True,
                         text=True, env=env, check=True, timeout=300)
    results = [json.loads(line) for line in run.stdout.strip().splitlines()[-2:]]
    for label, r in zip(("one file", "8 MiB shards"), results):
        anon = (r["peak_anon"] - r["base_anon"]) / ckpt_bytes
        model_ratio = r["model_bytes"] / ckpt_bytes
        total = None if r["hwm"] is None else (r["hwm"] - r["base_rss"]) / ckpt_bytes
        REPORT.update({f"peak anon / checkpoint ({label})": anon, f"peak RSS / checkpoint ({label})": total or 0})
        print(f"\n[checkpoint] load of {ckpt_bytes / 2**20:.1f} MiB from {label}: peak anonymous memory "
              f"{anon:.3f}x the checkpoint (the loaded model is {model_ratio:.3f}x); peak RSS incl. mapped file "
              f"pages {'n/a' if total is None else f'{total:.3f}x'}")
        assert anon < model_ratio + 0.25  # the model plus small transients, never a second copy
        if total is not None:
            pages = 1.0 if label == "one file" else 2 * shard / ckpt_bytes
            assert total < model_ratio + pages + 0.25
