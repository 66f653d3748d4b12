"""The MoE of a DeepSeek-V4 block: the gate (sqrtsoftplus scores, top-k or hash routing), the routed
experts stacked in their checkpoint format (kernels.moe runs them), the shared expert."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kernels.linear import f32_linear
from .kernels.moe import moe_experts, swiglu
from .kernels.topk import topk_indices
from .layers import Linear, linear_pair
from .quant.formats import FP8_BLOCK, MXFP4_BLOCK

__all__ = ["Gate", "Expert", "Experts", "MoE"]



class Gate(nn.Module):
    """sqrtsoftplus scores; top-k of score + bias (or a fixed tid2eid table on hash layers)."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.k, self.scale = cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.hash = cfg.is_hash_layer(layer)
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype))
        if self.hash:
            self.tid2eid = nn.Parameter(torch.zeros(cfg.vocab_size, self.k, dtype=torch.int64), requires_grad=False)
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = F.softplus(f32_linear(x, self.weight)).sqrt()
        if self.hash:
            idx = self.tid2eid[ids]
        else:
            idx = topk_indices(s + self.bias, self.k)  # the bias steers selection only
        w = s.gather(-1, idx)
        return w / w.sum(-1, keepdim=True) * self.scale, idx


class Expert(nn.Module):
    """The shared expert: clamped SwiGLU (current official code clamps it, docs/model.md, Forward pass)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: str | None):
        super().__init__()
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.limit = cfg.swiglu_limit
        self.w1 = Linear(d, inter, dtype, quant)
        self.w2 = Linear(inter, d, dtype, quant)
        self.w3 = Linear(d, inter, dtype, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = linear_pair(x, self.w1, self.w3)
        return self.w2(swiglu(g, u, self.limit).to(x.dtype))


class Experts(nn.Module):
    """The routed experts, stacked [E, out, in] (packed MXFP4 [E, out, in/2] + E8M0 [E, out, in/32])."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, fmt: str | None):
        super().__init__()
        E, d, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.limit = cfg.swiglu_limit
        for name, (o, i) in {"w1": (inter, d), "w2": (d, inter), "w3": (inter, d)}.items():
            if fmt is None:
                setattr(self, name, nn.Parameter(torch.empty(E, o, i, dtype=dtype)))
                self.register_parameter(f"{name}_scale", None)
            elif fmt == "fp4":
                setattr(self, name, nn.Parameter(torch.empty(E, o, i // 2, dtype=torch.uint8), requires_grad=False))
                setattr(self, f"{name}_scale",
                        nn.Parameter(torch.empty(E, o, i // MXFP4_BLOCK, dtype=torch.uint8), requires_grad=False))
            elif fmt == "fp8":
                setattr(self, name, nn.Parameter(torch.empty(E, o, i, dtype=torch.float8_e4m3fn), requires_grad=False))
                setattr(self, f"{name}_scale", nn.Parameter(
                    torch.empty(E, math.ceil(o / FP8_BLOCK), math.ceil(i / FP8_BLOCK), dtype=torch.float32),
                    requires_grad=False))
            else:
                raise ValueError(f"unknown expert format {fmt!r}")

    def forward(self, x, weights, indices):
        return moe_experts(x, weights, indices, self.w1, self.w1_scale, self.w2, self.w2_scale,
                           self.w3, self.w3_scale, self.limit)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, quant: str | None, expert_fmt: str | None):
        super().__init__()
        self.gate = Gate(cfg, layer, dtype)
        self.experts = Experts(cfg, dtype, expert_fmt)
        self.shared_experts = Expert(cfg, dtype, quant)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        w, idx = self.gate(xf, ids.reshape(-1))
        y = self.experts(xf, w, idx) + self.shared_experts(xf).float()
        return y.to(x.dtype).view(shape)
