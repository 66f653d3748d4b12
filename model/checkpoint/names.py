"""Checkpoint tensor names: the official names (docs/model.md, Checkpoint format) are canonical; transformers'
`deepseek_v4` names and what its `save_pretrained` writes map onto them, and back."""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["canonical_name", "transformers_name"]

# the model's stacked routed experts: layers.{i}.ffn.experts.w1 [E, ...] (+ w1_scale), which a
# checkpoint stores per expert as layers.{i}.ffn.experts.{e}.w1.weight (+ .scale)
EXPERTS = re.compile(r"^(.*\.ffn\.experts)\.(w[123])(_scale)?$")


def _rules(pairs: Sequence[tuple[str, str]]) -> list[tuple[re.Pattern, str]]:
    return [(re.compile(p), r) for p, r in pairs]


# transformers / save_pretrained names -> official names; every rule leaves official names alone
_CANON_RULES = _rules([
    (r"^model\.", ""),
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.norm\.", ".attn.kv_norm."),  # save_pretrained's reverse of `.norm.` -> `.kv_norm.`
    (r"\.ffn\.gate\.e_score_correction_bias$", ".ffn.gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.weight_scale_inv$", ".scale"),
])
HF_STACKED = re.compile(r"^(.*\.ffn\.experts)\.(gate_up_proj|down_proj)(_scale_inv)?$")

# official names -> transformers names (backbone only: transformers has no MTP, whose tensors keep
# their official names, which transformers ignores on load)
_HF_RULES = _rules([
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^layers\.", "model.layers."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn\.attn_sink$", ".attn.sinks"),
    (r"\.attn\.indexer\.weights_proj\.", ".attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.wq_b\.", ".attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.indexer\.compressor\.", ".attn.compressor.indexer."),
    (r"\.(compressor|indexer)\.wkv\.", r".\1.kv_proj."),
    (r"\.(compressor|indexer)\.wgate\.", r".\1.gate_proj."),
    (r"\.(compressor|indexer)\.norm\.", r".\1.kv_norm."),
    (r"\.(compressor|indexer)\.ape$", r".\1.position_bias"),
    (r"\.attn\.wq_a\.", ".attn.q_a_proj."),
    (r"\.attn\.q_norm\.", ".attn.q_a_norm."),
    (r"\.attn\.wq_b\.", ".attn.q_b_proj."),
    (r"\.attn\.wkv\.", ".attn.kv_proj."),
    (r"\.attn\.wo_a\.", ".attn.o_a_proj."),
    (r"\.attn\.wo_b\.", ".attn.o_b_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.gate\.bias$", ".ffn.gate.e_score_correction_bias"),
    (r"\.ffn\.shared_experts\.w1\.", ".ffn.shared_experts.gate_proj."),
    (r"\.ffn\.shared_experts\.w2\.", ".ffn.shared_experts.down_proj."),
    (r"\.ffn\.shared_experts\.w3\.", ".ffn.shared_experts.up_proj."),
    (r"\.ffn\.", ".mlp."),
    (r"(?<!_hc)\.scale$", ".weight_scale_inv"),  # linear scales, not the mHC attn_hc/ffn_hc.scale
])


def canonical_name(key: str) -> str:
    """The official name of a checkpoint tensor given in any supported naming (see the package doc).

    Stacked transformers experts (`...experts.gate_up_proj`) have no single official name; they come
    back as `layers.{i}.ffn.experts.gate_up_proj` etc. and are split per expert by the reader."""
    for pat, rep in _CANON_RULES:
        key = pat.sub(rep, key)
    return key


def transformers_name(name: str) -> str:
    """The transformers (`deepseek_v4`) name of an official tensor name; MTP names are unchanged."""
    if name.startswith("mtp."):
        return name
    for pat, rep in _HF_RULES:
        name = pat.sub(rep, name)
    return name
