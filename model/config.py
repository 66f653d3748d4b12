"""ModelConfig: the DeepSeek-V4 hyper-parameters, parsed from a Hugging Face `config.json`.

Field names are the HF `deepseek_v4` names (docs/model.md, Configuration). Two fields are ours, not HF's:
`max_seq_len` (sizes the decode state and the RoPE tables; the reference's `ModelArgs.max_seq_len`)
and `quant_sim` (the reference's FP8/FP4 quantization simulations; on as in the released model,
off as transformers runs it).

A checkpoint's config.json is read by `from_checkpoint` / `from_json`, which first require the fields
that shape the model (REQUIRED_FIELDS: a missing one would silently take Flash's value); presets go
through `from_dict`, which fills the rest with defaults. The transformers form of config.json is
translated, both ways, by `transformers_config.py`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ModelConfig", "ConfigError", "PRESETS", "REQUIRED_FIELDS"]


class ConfigError(ValueError):
    """A config.json field is unknown, missing or inconsistent; the message names the field."""


_YARN_DEFAULT = {
    "type": "yarn",
    "factor": 16,
    "original_max_position_embeddings": 65536,
    "beta_fast": 32,
    "beta_slow": 1,
}
_FP8_QUANT = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_lora_rank: int = 1024
    o_groups: int = 8
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = ()
    compress_rope_theta: float = 160000.0
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default_factory=lambda: dict(_YARN_DEFAULT))
    max_position_embeddings: int = 1048576
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    num_hash_layers: int = 3
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hidden_act: str = "silu"
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 1
    quantization_config: dict | None = field(default_factory=lambda: dict(_FP8_QUANT))
    expert_dtype: str | None = "fp4"
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_id: int | list[int] = 1
    # ours (not HF): state size and the reference's QAT simulations
    max_seq_len: int = 4096
    quant_sim: bool = True

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], **overrides: Any) -> "ModelConfig":
        """Build from a HF `deepseek_v4` config dict (official or transformers form); fields it leaves
        out take the defaults (Flash's), as presets want; unknown keys raise ConfigError naming them.
        A checkpoint's config.json goes through `from_checkpoint` instead."""
        # imported here: transformers_config imports ModelConfig from this module
        from .transformers_config import from_transformers_form, is_transformers_form

        d = {**d, **overrides}
        if d.get("model_type", "deepseek_v4") != "deepseek_v4":
            raise ConfigError(f"model_type: expected 'deepseek_v4', got {d.get('model_type')!r}")
        if is_transformers_form(d):
            d = from_transformers_form(d)
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        unknown = []
        for k, v in d.items():
            if k in known:
                kwargs[k] = v
            elif k in _IGNORED_KEYS:
                _check_ignored(k, v)
            else:
                unknown.append(k)
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(sorted(unknown))}")
        if "compress_ratios" in kwargs:
            kwargs["compress_ratios"] = tuple(int(r) for r in kwargs["compress_ratios"])
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    @classmethod
    def from_checkpoint(cls, d: dict[str, Any], **overrides: Any) -> "ModelConfig":
        """Build from a checkpoint's config.json dict: `from_dict`, after checking that it states
        model_type and every REQUIRED_FIELDS entry (one ConfigError names all that are missing,
        before anything is built from the rest). `overrides` count as stated."""
        given = {**d, **overrides}
        missing = [f if not alt else f"{f} (or {' / '.join(alt)})"
                   for f, alt in REQUIRED_FIELDS.items() if not any(_states(given, k) for k in (f, *alt))]
        if missing:
            raise ConfigError(f"config.json is missing required field(s): {', '.join(missing)} (a checkpoint's "
                              "config must state every field that shapes the model; the defaults are "
                              "DeepSeek-V4-Flash's and would be a silent guess)")
        return cls.from_dict(d, **overrides)

    @classmethod
    def from_json(cls, path: str | Path, **overrides: Any) -> "ModelConfig":
        """A checkpoint's (or master's) config.json, a file or the directory holding it (`from_checkpoint`)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_checkpoint(d, **overrides)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls.from_dict(PRESETS[name], **overrides)

    def replace(self, **changes: Any) -> "ModelConfig":
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg

    def first_layers(self, n: int) -> "ModelConfig":
        """The first `n` backbone layers (with their compression ratios and hash routing) and the
        MTP blocks: real dimensions at a fraction of the size, for benchmarks and tests."""
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= self.num_hidden_layers:
            raise ConfigError(f"layers: expected 1..{self.num_hidden_layers} (num_hidden_layers), got {n!r}")
        ratios = self.compress_ratios[:n] + self.compress_ratios[self.num_hidden_layers:]
        return self.replace(num_hidden_layers=n, compress_ratios=ratios,
                            num_hash_layers=min(self.num_hash_layers, n))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        return {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", **d}

    # ---- derived ------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def n_mtp(self) -> int:
        return self.num_nextn_predict_layers

    def ratio(self, layer: int) -> int:
        """Compression ratio of backbone layer `layer` (MTP blocks follow at n_layers + k)."""
        return self.compress_ratios[layer]

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def eos_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        return tuple(e) if isinstance(e, (list, tuple)) else (int(e),)

    @property
    def yarn(self) -> dict:
        rs = self.rope_scaling or {}
        return {
            "factor": float(rs.get("factor", 1.0)),
            "original_seq_len": int(rs.get("original_max_position_embeddings", 0)),
            "beta_fast": float(rs.get("beta_fast", 32)),
            "beta_slow": float(rs.get("beta_slow", 1)),
        }

    # ---- validation ---------------------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, fld: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{fld}: {msg}")

        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                  "q_lora_rank", "o_lora_rank", "o_groups", "sliding_window", "index_n_heads",
                  "index_head_dim", "n_routed_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters", "max_seq_len"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f,
                 f"must be a positive integer, got {v!r}")
        need(self.num_key_value_heads == 1, "num_key_value_heads",
             f"DeepSeek-V4 has one shared K=V head, got {self.num_key_value_heads}")
        need(self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
             f"must be positive and even, got {self.qk_rope_head_dim}")
        need(self.head_dim > self.qk_rope_head_dim, "head_dim",
             f"{self.head_dim} must exceed qk_rope_head_dim {self.qk_rope_head_dim}")
        need(self.index_head_dim > self.qk_rope_head_dim, "index_head_dim",
             f"{self.index_head_dim} must exceed qk_rope_head_dim {self.qk_rope_head_dim} "
             "(the indexer ropes its trailing qk_rope_head_dim dims)")
        need(self.num_attention_heads % self.o_groups == 0, "o_groups",
             f"num_attention_heads {self.num_attention_heads} is not divisible by o_groups {self.o_groups}")
        need(self.n_shared_experts == 1, "n_shared_experts",
             f"DeepSeek-V4 has exactly one shared expert, got {self.n_shared_experts}")
        need(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
             f"{self.num_experts_per_tok} > n_routed_experts {self.n_routed_experts}")
        need(0 <= self.num_hash_layers <= self.num_hidden_layers, "num_hash_layers",
             f"{self.num_hash_layers} not in [0, num_hidden_layers={self.num_hidden_layers}]")
        need(self.scoring_func == "sqrtsoftplus", "scoring_func",
             f"only 'sqrtsoftplus' is DeepSeek-V4, got {self.scoring_func!r}")
        need(self.topk_method == "noaux_tc", "topk_method",
             f"only 'noaux_tc' is DeepSeek-V4, got {self.topk_method!r}")
        need(self.hidden_act == "silu", "hidden_act", f"only 'silu' is supported, got {self.hidden_act!r}")
        need(self.norm_topk_prob is True, "norm_topk_prob", "DeepSeek-V4 renormalizes top-k weights (true)")
        need(self.num_nextn_predict_layers >= 0, "num_nextn_predict_layers", "must be >= 0")
        n_ratios = self.num_hidden_layers + self.num_nextn_predict_layers
        need(len(self.compress_ratios) == n_ratios, "compress_ratios",
             f"has {len(self.compress_ratios)} entries, expected num_hidden_layers + "
             f"num_nextn_predict_layers = {n_ratios}")
        for i, r in enumerate(self.compress_ratios):
            need(isinstance(r, int) and r >= 0, "compress_ratios", f"entry {i} is {r!r}, expected an int >= 0")
            need(r == 0 or r >= 2, "compress_ratios", f"entry {i} is {r}: ratio 1 is not DeepSeek-V4")
            need(r == 0 or self.max_seq_len % r == 0, "compress_ratios",
                 f"max_seq_len {self.max_seq_len} is not a multiple of ratio {r} (entry {i})")
        for i in range(self.num_hidden_layers, n_ratios):
            need(self.compress_ratios[i] == 0, "compress_ratios",
                 f"entry {i} (an MTP block) must be 0: MTP blocks use sliding-window attention")
        if self.rope_scaling is not None:
            rtype = self.rope_scaling.get("type", self.rope_scaling.get("rope_type"))
            need(rtype == "yarn", "rope_scaling", f"only yarn scaling is DeepSeek-V4, got {rtype!r}")
            extra = set(self.rope_scaling) - {"type", "rope_type", "factor", "original_max_position_embeddings",
                                              "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}
            need(not extra, "rope_scaling", f"unknown key(s) {sorted(extra)}")
        if self.quantization_config is not None:
            q = self.quantization_config
            need(q.get("quant_method") == "fp8", "quantization_config.quant_method",
                 f"expected 'fp8', got {q.get('quant_method')!r}")
            need(list(q.get("weight_block_size", [128, 128])) == [128, 128],
                 "quantization_config.weight_block_size", f"expected [128, 128], got {q.get('weight_block_size')}")
            need(q.get("scale_fmt", "ue8m0") in ("ue8m0", None, "fp32"), "quantization_config.scale_fmt",
                 f"unsupported {q.get('scale_fmt')!r}")
        need(self.expert_dtype in (None, "fp4", "fp8", "bf16"), "expert_dtype",
             f"expected fp4, fp8, bf16 or null, got {self.expert_dtype!r}")
        need(not self.tie_word_embeddings, "tie_word_embeddings", "DeepSeek-V4 has separate embed and head")
        if self.quant_sim:
            need(self.nope_head_dim % 64 == 0, "head_dim",
                 f"quant_sim needs (head_dim - qk_rope_head_dim) % 64 == 0 (FP8 block 64), got {self.nope_head_dim}")
            ihd = self.index_head_dim
            need(ihd % 32 == 0 and (ihd & (ihd - 1)) == 0, "index_head_dim",
                 f"quant_sim needs a power of two multiple of 32 (Hadamard + FP4 block 32), got {ihd}")


def _check_ignored(key: str, value: Any) -> None:
    if key == "num_key_value_heads" and value != 1:
        raise ConfigError(f"{key}: DeepSeek-V4 has one shared K=V head, got {value}")


# What a checkpoint's config.json must state (ModelConfig.from_checkpoint): the model type and every
# field that sets a tensor or state shape or differs between the released Flash and Pro configs
# (docs/model.md, Configuration). Each maps to the transformers-form keys that state it instead. Fields left out are
# the single values DeepSeek-V4 allows (validate() checks them) or numerics both releases share.
REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "model_type": (),
    "vocab_size": (), "hidden_size": (), "num_hidden_layers": (), "num_attention_heads": (), "head_dim": (),
    "qk_rope_head_dim": ("partial_rotary_factor",), "q_lora_rank": (), "o_lora_rank": (), "o_groups": (),
    "sliding_window": (), "compress_ratios": ("layer_types",), "index_n_heads": (), "index_head_dim": (),
    "index_topk": (), "n_routed_experts": (), "num_experts_per_tok": (), "moe_intermediate_size": (),
    "num_hash_layers": ("mlp_layer_types",), "routed_scaling_factor": (), "hc_mult": (),
    "num_nextn_predict_layers": (),
}


def _states(d: dict[str, Any], key: str) -> bool:
    """Whether config dict d states `key` (partial_rotary_factor may sit inside rope_parameters)."""
    if d.get(key) is not None:
        return True
    rp = d.get("rope_parameters")
    return key == "partial_rotary_factor" and isinstance(rp, dict) and any(
        isinstance(v, dict) and v.get(key) is not None for v in (rp, *rp.values()))


# Keys that may appear in a released config.json and carry nothing the model needs.
_IGNORED_KEYS = {
    "architectures", "model_type", "attention_bias", "attention_dropout", "initializer_range",
    "torch_dtype", "dtype", "use_cache", "transformers_version", "pad_token_id", "auto_map",
    # written by transformers' DeepseekV4Config (training-only knobs)
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "mlp_bias",
}


PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeek-V4-Flash as released (docs/model.md, Configuration); layers 0,1 sliding, then CSA/HCA alternating.
    "flash": dict(
        vocab_size=129280, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
        head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_lora_rank=1024, o_groups=8,
        sliding_window=128,
        compress_ratios=[0, 0] + [4, 128] * 20 + [4] + [0],
        index_n_heads=64, index_head_dim=128, index_topk=512, n_routed_experts=256,
        num_experts_per_tok=6, moe_intermediate_size=2048, num_hash_layers=3,
        routed_scaling_factor=1.5, max_seq_len=4096,
    ),
    # DeepSeek-V4-Pro as released; layers 0,1 HCA.
    "pro": dict(
        vocab_size=129280, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
        head_dim=512, qk_rope_head_dim=64, q_lora_rank=1536, o_lora_rank=1024, o_groups=16,
        sliding_window=128,
        compress_ratios=[128, 128] + [4, 128] * 29 + [4] + [0],
        index_n_heads=64, index_head_dim=128, index_topk=1024, n_routed_experts=384,
        num_experts_per_tok=6, moe_intermediate_size=3072, num_hash_layers=3,
        routed_scaling_factor=2.5, max_seq_len=4096,
    ),
    # A few layers covering every kind: 0 = sliding + hash-routed, 1 and 3 = CSA (ratio 4, indexer),
    # 2 = HCA (ratio 16 stands in for 128 so short sequences cross many boundaries), MTP = sliding.
    # Linear dims are multiples of 128 so FP8 128x128 blocks and MXFP4 32-blocks apply unchanged.
    "tiny": dict(
        vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        head_dim=128, qk_rope_head_dim=64, q_lora_rank=128, o_lora_rank=64, o_groups=2,
        sliding_window=8, compress_ratios=[0, 4, 16, 4, 0],
        compress_rope_theta=160000.0, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 64,
                      "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=256,
        index_n_heads=4, index_head_dim=128, index_topk=4, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=128, num_hash_layers=1,
        routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20,
        max_seq_len=256,
    ),
    # The embedded default model, trained by dsv4.train (train/) on the CPython-docs corpus with
    # the corpus BPE tokenizer (vocab 2048); weights in model/assets/small. Every layer kind of V4:
    # 0 = sliding only + hash-routed MoE, 1 and 3 = CSA (ratio 4, lightning indexer, top-16),
    # 2 = HCA with ratio 16 (128 would compress nothing within the 256-token training sequences),
    # MTP = sliding; mHC with 4 streams, 8 routed experts (top 2) + 1 shared per layer. Linear dims
    # are multiples of 128 and expert K multiples of 32, so the official FP8 128x128 / MXFP4
    # checkpoint format applies unchanged. YaRN (factor 4 over 256) is part of the trained tables.
    "small": dict(
        vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        head_dim=128, qk_rope_head_dim=64, q_lora_rank=128, o_lora_rank=64, o_groups=2,
        sliding_window=32, compress_ratios=[0, 4, 16, 4, 0],
        compress_rope_theta=160000.0, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 256,
                      "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=1024,
        index_n_heads=4, index_head_dim=128, index_topk=16, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=128, num_hash_layers=1,
        routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20,
        max_seq_len=1024,
    ),
}
