"""The transformers form of a DeepSeek-V4 config.json, both directions: `from_transformers_form`
(read: into the official field names ModelConfig takes) and `transformers_config_dict` (write).

transformers' DeepseekV4Config (>= 5.8) saves the schedule as `layer_types` + `compress_rates`,
hash routing as `mlp_layer_types`, the rope split as `partial_rotary_factor` and the two rope
tables as `rope_parameters = {"main": ..., "compress": ...}` (docs/model.md, Configuration). It has no MTP entry in
`layer_types` and moves `expert_dtype` into `quantization_config`. Without a quantization_config
a transformers config describes an unquantized model.
"""

from __future__ import annotations

import math
from typing import Any

from .config import ConfigError, ModelConfig

__all__ = ["TRANSFORMERS_KEYS", "is_transformers_form", "from_transformers_form", "transformers_config_dict"]

TRANSFORMERS_KEYS = {"layer_types", "compress_rates", "mlp_layer_types", "rope_parameters",
                     "partial_rotary_factor", "compress_rate_csa", "compress_rate_hca"}
_CSA, _HCA, _SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
_HF_DEFAULT_RATES = {_CSA: 4, _HCA: 128}


def from_transformers_form(d: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a transformers-form config dict into the official field names (ConfigError on
    anything this model cannot represent; the remaining keys go through the usual checks)."""
    d = dict(d)
    n = d.get("num_hidden_layers", ModelConfig.num_hidden_layers)
    n_mtp = d.get("num_nextn_predict_layers", ModelConfig.num_nextn_predict_layers)

    rates = dict(d.pop("compress_rates", None) or _HF_DEFAULT_RATES)
    for legacy, kind in (("compress_rate_csa", _CSA), ("compress_rate_hca", _HCA)):
        if legacy in d:
            rates[kind] = d.pop(legacy)
    if set(rates) - {_CSA, _HCA}:
        raise ConfigError(f"compress_rates: unknown layer type(s) {sorted(set(rates) - {_CSA, _HCA})}")
    rates = {**_HF_DEFAULT_RATES, **rates}
    if rates[_CSA] != 4:
        raise ConfigError(f"compress_rates.{_CSA}: {rates[_CSA]} is not supported: the overlapping "
                          "compressor and the lightning indexer are tied to ratio 4 here (docs/model.md, Forward pass)")
    if not (isinstance(rates[_HCA], int) and rates[_HCA] >= 2 and rates[_HCA] != 4):
        raise ConfigError(f"compress_rates.{_HCA}: expected an int >= 2 other than 4 (4 means CSA), "
                          f"got {rates[_HCA]!r}")

    layer_types = d.pop("layer_types", None)
    if layer_types is not None:
        ratio_of = {_SWA: 0, _CSA: rates[_CSA], _HCA: rates[_HCA]}
        bad = [t for t in layer_types if t not in ratio_of]
        if bad or len(layer_types) != n:
            raise ConfigError(f"layer_types: expected {n} entries from {sorted(ratio_of)}, got {layer_types!r}")
        ratios = [ratio_of[t] for t in layer_types] + [0] * n_mtp
        if "compress_ratios" in d and [int(r) for r in d["compress_ratios"]] != ratios:
            raise ConfigError(f"compress_ratios {list(d['compress_ratios'])} disagrees with layer_types "
                              f"+ compress_rates {ratios}")
        d["compress_ratios"] = ratios

    mlp = d.pop("mlp_layer_types", None)
    if mlp is not None:
        k = next((i for i, t in enumerate(mlp) if t != "hash_moe"), len(mlp))
        if len(mlp) != n or any(t != "moe" for t in mlp[k:]):
            raise ConfigError(f"mlp_layer_types: expected {n} entries, 'hash_moe' for a leading run of "
                              f"layers and 'moe' after it, got {mlp!r}")
        if d.get("num_hash_layers", k) != k:
            raise ConfigError(f"num_hash_layers {d['num_hash_layers']} disagrees with mlp_layer_types ({k})")
        d["num_hash_layers"] = k

    head_dim = d.get("head_dim", ModelConfig.head_dim)
    prf = d.pop("partial_rotary_factor", None)
    rp = d.pop("rope_parameters", None)
    if rp is not None:
        if "rope_scaling" in d:
            raise ConfigError("rope_parameters and rope_scaling are both set; keep one")
        nested = isinstance(rp.get("main"), dict) or isinstance(rp.get("compress"), dict)
        main = rp.get("main", {}) if nested else {}
        comp = rp.get("compress", {}) if nested else rp
        if nested and set(rp) - {"main", "compress"}:
            raise ConfigError(f"rope_parameters: unknown key(s) {sorted(set(rp) - {'main', 'compress'})}")
        for label, sub in (("main", main), ("compress", comp)):
            extra = set(sub) - {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor",
                                "original_max_position_embeddings", "beta_fast", "beta_slow",
                                "attention_factor", "mscale", "mscale_all_dim", "truncate"}
            if extra:
                raise ConfigError(f"rope_parameters.{label}: unknown key(s) {sorted(extra)}")
            if "partial_rotary_factor" in sub:
                prf = sub["partial_rotary_factor"] if prf is None else prf
                if abs(sub["partial_rotary_factor"] - prf) > 1e-9:
                    raise ConfigError(f"rope_parameters.{label}.partial_rotary_factor disagrees with "
                                      f"partial_rotary_factor {prf}")
        if main.get("rope_type", main.get("type", "default")) != "default":
            raise ConfigError("rope_parameters.main: sliding-window layers use plain RoPE (rope_type "
                              f"'default'), got {main.get('rope_type', main.get('type'))!r}")
        for key, sub in (("rope_theta", main), ("compress_rope_theta", comp)):
            if "rope_theta" in sub:
                if key in d and float(d[key]) != float(sub["rope_theta"]):
                    raise ConfigError(f"{key} {d[key]} disagrees with rope_parameters ({sub['rope_theta']})")
                d[key] = sub["rope_theta"]
        ctype = comp.get("rope_type", comp.get("type", "default"))
        if ctype == "yarn":
            af = comp.get("attention_factor")
            if af is None and nested:
                # transformers fills attention_factor = 1 only when it builds the nesting itself; a
                # nested yarn dict without it gets YaRN's mscale on cos/sin (_compute_yarn_parameters)
                f, ms, msa = float(comp["factor"]), comp.get("mscale"), comp.get("mscale_all_dim")

                def mscale(m: float = 1.0) -> float:
                    return 1.0 if f <= 1 else 0.1 * m * math.log(f) + 1.0

                af = mscale(ms) / mscale(msa) if ms and msa else mscale()
            if float(1.0 if af is None else af) != 1.0:
                raise ConfigError("rope_parameters.compress.attention_factor: transformers would scale cos/sin by "
                                  f"{af:.4g} (YaRN mscale); DeepSeek-V4 applies no YaRN magnitude scaling "
                                  "(docs/model.md, Forward pass): set attention_factor to 1.0")
            if not comp.get("truncate", True):
                raise ConfigError("rope_parameters.compress.truncate: the reference truncates the YaRN "
                                  "correction range (floor/ceil)")
            d["rope_scaling"] = {"type": "yarn", "factor": comp["factor"],
                                 "original_max_position_embeddings": comp.get(
                                     "original_max_position_embeddings",
                                     d.get("max_position_embeddings", ModelConfig.max_position_embeddings)),
                                 "beta_fast": comp.get("beta_fast") or 32, "beta_slow": comp.get("beta_slow") or 1}
        elif ctype == "default":
            d["rope_scaling"] = None
        else:
            raise ConfigError(f"rope_parameters.compress: only 'yarn' or 'default' RoPE, got {ctype!r}")
    if prf is not None:
        rd = head_dim * prf
        if abs(rd - round(rd)) > 1e-6:
            raise ConfigError(f"partial_rotary_factor {prf} x head_dim {head_dim} is not an integer")
        if d.get("qk_rope_head_dim", round(rd)) != round(rd):
            raise ConfigError(f"qk_rope_head_dim {d['qk_rope_head_dim']} disagrees with partial_rotary_factor "
                              f"{prf} x head_dim {head_dim}")
        d["qk_rope_head_dim"] = round(rd)

    if d.get("mlp_bias"):
        raise ConfigError("mlp_bias: DeepSeek-V4 experts have no bias")
    qc = d.get("quantization_config")
    if isinstance(qc, dict) and "expert_dtype" in qc:
        qc = dict(qc)
        e = qc.pop("expert_dtype")
        if d.get("expert_dtype", e) != e:
            raise ConfigError(f"expert_dtype {d['expert_dtype']!r} disagrees with quantization_config ({e!r})")
        d["quantization_config"], d["expert_dtype"] = qc, e
    if "quantization_config" not in d:  # transformers: no quantization_config = full precision
        d["quantization_config"] = None
        d.setdefault("expert_dtype", None)
    return d


def is_transformers_form(d: dict[str, Any]) -> bool:
    """Whether a config dict uses any transformers-only key (then `from_transformers_form` reads it)."""
    return any(k in d for k in TRANSFORMERS_KEYS)


def transformers_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """config.json in the form transformers' DeepseekV4Config writes (layer_types, compress_rates,
    mlp_layer_types, rope_parameters; expert_dtype inside quantization_config). ModelConfig.from_dict
    reads it back to the same config."""
    n = cfg.n_layers
    ratios = cfg.compress_ratios[:n]
    hca = sorted({r for r in ratios if r not in (0, 4)})
    if len(hca) > 1:
        raise ConfigError(f"compress_ratios {list(ratios)}: transformers has one HCA rate, got {hca}")
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": hca[0] if hca else 128}
    kind = {0: "sliding_attention", 4: "compressed_sparse_attention"}
    prf = cfg.qk_rope_head_dim / cfg.head_dim
    compress: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.compress_rope_theta,
                                "partial_rotary_factor": prf}
    if cfg.rope_scaling:
        rs = cfg.rope_scaling
        compress.update(rope_type="yarn", factor=rs["factor"],
                        original_max_position_embeddings=rs["original_max_position_embeddings"],
                        beta_fast=rs.get("beta_fast", 32), beta_slow=rs.get("beta_slow", 1),
                        attention_factor=1.0)  # the reference applies no YaRN mscale (docs/model.md, Forward pass)
    d = cfg.to_dict()
    for k in ("compress_ratios", "num_hash_layers", "rope_scaling", "expert_dtype", "quantization_config"):
        d.pop(k)
    d.update(
        layer_types=[kind.get(r, "heavily_compressed_attention") for r in ratios],
        compress_rates=rates,
        mlp_layer_types=["hash_moe" if cfg.is_hash_layer(i) else "moe" for i in range(n)],
        partial_rotary_factor=prf,
        rope_parameters={"main": {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": prf},
                         "compress": compress},
    )
    if cfg.quantization_config:
        d["quantization_config"] = {**cfg.quantization_config, "expert_dtype": cfg.expert_dtype}
    elif cfg.expert_dtype in ("fp4", "fp8"):
        d["expert_dtype"] = cfg.expert_dtype
    return d
