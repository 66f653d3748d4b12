"""Parity with Hugging Face transformers' `deepseek_v4` (test-only dependency, transformers >= 5.8).

A tiny transformers model with random weights (every parameter and buffer perturbed away from its
init, so norms, sinks, position biases, mHC bases/scales, routing bias and hash table all matter) is
saved with `save_pretrained` and loaded by our loader; our eager model (quantization simulations
off, float32) must give the same logits for all 40 positions of a prompt that crosses the sliding
window (8) four times, CSA entries (ratio 4) ten times with a real top-2 lightning-indexer choice, and
HCA entries (ratio 8) five times, with YaRN on the compressed layers.

Tolerance: 1e-4 absolute on logits of magnitude ~3 (fp32 on both sides; measured ~5e-6, summation
order only). Two disagreements were found on the way, neither in model/model.py:
- transformers applies YaRN's mscale (0.1 ln(factor) + 1) to cos/sin when `rope_parameters` is given
  already nested without `attention_factor` (it only defaults it to 1.0 when it builds the nesting
  from a legacy config). The reference has no mscale (docs/model.md, Forward pass), so ModelConfig refuses such a
  config with a clear error; the configs here set attention_factor 1.0 as converted checkpoints do.
- with 2 indexer heads many index scores are exactly 0 (ReLU), and top-k breaks those ties
  differently (docs/model.md, Reference numerics); 16 indexer heads make exact ties practically impossible.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from packaging.version import Version  # noqa: E402  (transformers depends on packaging)

if Version(transformers.__version__) < Version("5.8"):
    pytest.skip(f"deepseek_v4 needs transformers >= 5.8, found {transformers.__version__}", allow_module_level=True)

from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402

from safetensors import safe_open  # noqa: E402

from dsv4.model.checkpoint import load_checkpoint, open_checkpoint, write_checkpoint  # noqa: E402
from dsv4.model.config import ConfigError, ModelConfig  # noqa: E402
from dsv4.model.state import new_state  # noqa: E402

S = 40
TOL = 1e-4
OURS = dict(quant_sim=False, max_seq_len=64)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def hf_config(**kw) -> DeepseekV4Config:
    base = dict(
        vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=4,
        head_dim=32, partial_rotary_factor=8 / 32, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0},
                         "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
                                      "attention_factor": 1.0}},
        max_position_embeddings=64, sliding_window=8, hc_mult=4, hc_sinkhorn_iters=20,
        index_n_heads=16, index_head_dim=16, index_topk=2,
    )
    return DeepseekV4Config(**{**base, **kw})


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Move every tensor off its init value (init leaves norms at 1, sinks/bias/ape at 0, ...)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif n.endswith(("position_bias", "sinks")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif n.endswith((".base", ".hc_base")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif n.endswith((".scale", ".hc_scale")):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
        for n, b in model.named_buffers():
            if n.endswith("tid2eid"):
                E, k = model.config.n_routed_experts, model.config.num_experts_per_tok
                b.copy_(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(b.shape[0])]))
            elif n.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def hf_logits(model, toks) -> torch.Tensor:
    with torch.no_grad():
        return model(toks[None], use_cache=False).logits[0].double()


def our_logits(model, toks) -> torch.Tensor:
    i64 = lambda *v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    with torch.no_grad():
        st = new_state(model.cfg, 1, model.dtype)
        return model(toks[None], i64(0), i64(len(toks)), i64(0), st, all_logits=True)[0].double()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(hf_config()).eval()  # num_nextn_predict_layers defaults to 1: no MTP saved
    randomize(model, 1)
    d = tmp_path_factory.mktemp("hf") / "saved"
    model.save_pretrained(d)
    return model, d


@pytest.fixture(scope="module")
def toks():
    return torch.randint(0, 512, (S,), generator=torch.Generator().manual_seed(2))


def test_transformers_save_loads_and_matches(saved, toks):
    hf, d = saved
    conf = json.loads((d / "config.json").read_text())
    assert "layer_types" in conf and "compress_ratios" not in conf  # the transformers form
    assert open_checkpoint(d).layout == "transformers"
    with pytest.warns(UserWarning, match="no mtp"):
        ours = load_checkpoint(d, dtype=torch.float32, overrides=OURS)
    assert ours.cfg.compress_ratios == (0, 4, 8, 4) and ours.cfg.num_hash_layers == 1
    assert ours.cfg.qk_rope_head_dim == 8 and ours.cfg.rope_scaling["factor"] == 4.0
    assert ours.cfg.quantization_config is None and len(ours.mtp) == 0

    # the prompt really exercises the sparse paths: CSA picks 2 of up to 10 entries
    assert S // 4 > hf.config.index_topk and S > 2 * hf.config.sliding_window
    ref, got = hf_logits(hf, toks), our_logits(ours, toks)
    d_max = (got - ref).abs().max().item()
    print(f"\n[hf parity] transformers save_pretrained -> our loader: max |logit diff| {d_max:.3g} "
          f"(logits up to {ref.abs().max().item():.3g}, tolerance {TOL})")
    assert d_max < TOL


def test_our_transformers_layout_loads_in_transformers(saved, toks, tmp_path):
    """Our writer's transformers layout: transformers loads it with no missing/unexpected keys and
    computes what our model computes from the same file."""
    hf, d = saved
    with pytest.warns(UserWarning):
        ours = load_checkpoint(d, dtype=torch.float32, overrides=OURS)
    out = write_checkpoint(ours, ours.cfg, tmp_path / "ours_hf", layout="transformers")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(hf.state_dict())  # exactly transformers' own parameter names
    back, info = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours_again = load_checkpoint(out, dtype=torch.float32, overrides=OURS)
    ref, got = hf_logits(back.eval(), toks), our_logits(ours_again, toks)
    d_max = (got - ref).abs().max().item()
    print(f"\n[hf parity] our transformers-layout writer -> transformers: max |logit diff| {d_max:.3g}")
    assert d_max < TOL


def test_nested_yarn_without_attention_factor_is_refused(saved):
    """transformers would scale cos/sin by YaRN's mscale here; the reference never does."""
    _, d = saved
    conf = json.loads((d / "config.json").read_text())
    del conf["rope_parameters"]["compress"]["attention_factor"]
    with pytest.raises(ConfigError, match="attention_factor"):
        ModelConfig.from_dict(conf)
    hf = DeepseekV4Config(**{k: v for k, v in conf.items() if k not in ("architectures", "model_type")})
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    _, scaling = ROPE_INIT_FUNCTIONS["yarn"](hf, layer_type="compress")
    assert scaling == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)  # what it would apply
