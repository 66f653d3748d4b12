"""Multi-device layout of an export: one compiled module over N IREE HAL devices.

The model is traced once with its big weights split across logical devices ``__device_0 ..
__device_{N-1}`` (iree-turbine: each shard's parameters carry a ``DeviceTensorTrait`` and become
globals with ``stream.affinity``; activations cross devices through ``transfer_to_logical_device``,
i.e. ``flow.tensor.transfer``). IREE schedules each device's work on its own queue; the runtime
opens N devices in one context (runtime/module.py). Cross-device sums and concatenations are
transfers to device 0 followed by adds / concats there (sharktank builds its all-reduce the same
way: no collective library is involved). Layout (`LAYOUT`, recorded in config.json):

* routed experts: expert parallel, device d holds experts [d E/N, (d+1) E/N) of every layer; the
  gate runs on device 0, each device runs its own experts for every token (the other experts'
  routing weights zeroed) and device 0 sums the N partial outputs (fp32) and the shared expert;
* attention: tensor parallel over the query heads; device d holds heads [d H/N, (d+1) H/N) of
  wq_b, their attn_sink and their o_groups share of wo_a (N must divide H and o_groups), and
  computes queries, sparse attention and its wo_a groups; device 0 concatenates the groups and
  applies wo_b. The q latent (wq_a, q_norm), the single 512-d KV head, the compressors, the
  indexer, the sliding window and every state tensor stay on device 0, which sends each device
  the q latent, the gathered KV rows and their indices once per layer;
* embedding and head: split by vocabulary (device d holds rows [d V/N, (d+1) V/N)); device 0 sums
  the embedding shards (one is non-zero per token: exact) and concatenates the logit shards;
* everything else (mHC, norms, shared expert, gate, compressors, indexer) on device 0.

Parameter keys: a split tensor ``<module>.<name>`` becomes N tensors ``<module>.shards.{d}.<name>``
(attention heads: ``<attn>.head_shards.shards.{d}.<name>``), each along dim 0; that naming is part
of the export contract (contract/artifact.py: `SHARD_SPLITS`, `shard_tensors` cuts a stream of whole
tensors, a checkpoint or random weights, the same way).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.model.kernels.linear import f32_linear
from dsv4.model.layers import Linear
from dsv4.model.model import Attention, gather_rows
from dsv4.model.moe import Experts
from dsv4.model.quant.formats import FP8_BLOCK
from dsv4.contract.artifact import SHARD_SPLITS, shard_key, shard_tensors

__all__ = ["LAYOUT", "SHARD_SPLITS", "check_devices", "layout", "sharded", "shard_key", "shard_tensors",
           "to_device"]

LAYOUT = {
    "routed_experts": "split by expert (expert parallel); partial outputs summed on device 0",
    "attention_heads": "split by query head and o_group (tensor parallel); groups concatenated on device 0",
    "embedding": "split by vocabulary; summed on device 0",
    "head": "split by vocabulary; logits concatenated on device 0",
    "replicated": "none: q latent, KV head, compressors, indexer, mHC, norms, gate, shared expert on device 0",
    "state": "device 0",
}


def check_devices(cfg: Any, n: int) -> None:
    """ValueError unless `n` devices can split `cfg` (heads, o_groups, experts, vocabulary divide;
    FP8 block rows stay whole). Cheap: call it before tracing."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"--devices must be a positive integer, got {n!r}")
    if n == 1:
        return
    parts = {"attention heads (num_attention_heads)": cfg.num_attention_heads, "o_groups": cfg.o_groups,
             "routed experts (n_routed_experts)": cfg.n_routed_experts, "vocab_size": cfg.vocab_size}
    bad = [f"{n} does not divide {k} = {v}" for k, v in parts.items() if v % n]
    if cfg.quantization_config and cfg.num_attention_heads % n == 0:
        rows = cfg.num_attention_heads // n * cfg.head_dim
        if rows % FP8_BLOCK:
            bad.append(f"a device's {rows} wq_b rows are not a whole number of FP8 {FP8_BLOCK}-row blocks")
    if bad:
        raise ValueError(f"cannot split this model over {n} devices: " + "; ".join(bad)
                         + " (each device takes an equal share of heads, experts and vocabulary)")


def layout(cfg: Any, n: int) -> dict[str, Any]:
    """config.json's "devices" field of an N-device export."""
    return {"count": n, "experts_per_device": cfg.n_routed_experts // n,
            "heads_per_device": cfg.num_attention_heads // n, "vocab_per_device": cfg.vocab_size // n,
            "layout": dict(LAYOUT)}


def to_device(d: int, t: torch.Tensor) -> torch.Tensor:
    """`t` on logical device d (flow.tensor.transfer when exported; a copy when run eagerly)."""
    from iree.turbine.ops.iree import transfer_to_logical_device

    return transfer_to_logical_device(str(d), t)


# ---------------------------------------------------------------------------------------------
# shard modules (their parameters are views of the whole ones: no copy, no memory touched)


def _rows(p: torch.Tensor | None, d: int, n: int) -> nn.Parameter | None:
    """Rows [d R/N, (d+1) R/N) of p as a parameter of device d."""
    if p is None:
        return None
    from iree.turbine.aot import DeviceTensorTrait

    r = p.shape[0] // n
    out = nn.Parameter(p.data[d * r:(d + 1) * r], requires_grad=False)
    DeviceTensorTrait(d).set(out)
    return out


def _linear_rows(lin: nn.Module, d: int, n: int) -> nn.Module:
    """A model Linear holding output rows [d O/N, (d+1) O/N) (and their FP8 block scales)."""
    with torch.device("meta"):
        out = Linear(lin.in_features, lin.out_features // n, lin.weight.dtype)
    out.weight = _rows(lin.weight, d, n)
    if lin.scale is not None:
        out.scale = _rows(lin.scale, d, n)
    return out


class ExpertShard(nn.Module):
    """Device d's routed experts: the model's Experts with E/N of them."""

    forward = Experts.forward  # reads w1..w3, their scales and limit

    def __init__(self, experts: nn.Module, d: int, n: int):
        super().__init__()
        self.limit = experts.limit
        for name in ("w1", "w2", "w3"):
            setattr(self, name, _rows(getattr(experts, name), d, n))
            scale = getattr(experts, f"{name}_scale")
            if scale is None:
                self.register_parameter(f"{name}_scale", None)
            else:
                setattr(self, f"{name}_scale", _rows(scale, d, n))


class ShardedExperts(nn.Module):
    """Expert parallel routed experts: same call as Experts, fp32 [N,d] out on device 0."""

    def __init__(self, experts: nn.Module, n: int):
        super().__init__()
        self.per = experts.w1.shape[0] // n
        self.shards = nn.ModuleList(ExpertShard(experts, d, n) for d in range(n))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        y = None
        for d, shard in enumerate(self.shards):
            xd, wd, idx = to_device(d, x), to_device(d, weights), to_device(d, indices)
            mine = torch.div(idx, self.per, rounding_mode="floor") == d
            # other devices' experts: weight 0 on local expert 0 (adds exact zeros)
            part = shard(xd, torch.where(mine, wd, torch.zeros((), dtype=wd.dtype)),
                         torch.where(mine, idx - d * self.per, torch.zeros((), dtype=idx.dtype)))
            part = to_device(0, part)
            y = part if y is None else y + part
        return y


class AttentionShard(nn.Module):
    """Device d's query heads: H/N heads of wq_b with their sinks, and their o_groups/N of wo_a."""

    queries = Attention.queries  # read wq_b, attn_sink, wo_a, H, G, D, rd, eps, o_lora, scale
    attend = Attention.attend

    def __init__(self, attn: nn.Module, d: int, n: int):
        super().__init__()
        self.H, self.G = attn.H // n, attn.G // n
        self.D, self.rd, self.eps, self.o_lora, self.scale = attn.D, attn.rd, attn.eps, attn.o_lora, attn.scale
        self.wq_b = _linear_rows(attn.wq_b, d, n)
        self.attn_sink = _rows(attn.attn_sink, d, n)
        self.wo_a = _linear_rows(attn.wo_a, d, n)


class HeadShards(nn.Module):
    """Attention.head_shards: (qr, kvs, idx, cos, sin) -> [B,T,G,o_lora] on device 0."""

    def __init__(self, attn: nn.Module, n: int):
        super().__init__()
        self.shards = nn.ModuleList(AttentionShard(attn, d, n) for d in range(n))

    def forward(self, qr, kvs, idx, cos, sin) -> torch.Tensor:
        B, T, K = idx.shape
        if isinstance(T, int) and T == 1 and K < kvs.shape[1]:
            # one query per row (decode): ship each device only the K rows it reads, not the whole
            # cache (the same rows in the same order: the same attention)
            kvs = gather_rows(kvs, idx[:, 0].clamp(min=0))
            idx = torch.where(idx >= 0, torch.arange(K, device=idx.device), -1)
        outs = []
        for d, shard in enumerate(self.shards):
            cd, sd = to_device(d, cos), to_device(d, sin)
            q = shard.queries(to_device(d, qr), cd, sd)
            outs.append(to_device(0, shard.attend(q, to_device(d, kvs), to_device(d, idx), cd, sd)))
        return torch.cat(outs, 2)


class VocabShard(nn.Module):
    def __init__(self, weight: torch.Tensor, d: int, n: int):
        super().__init__()
        self.weight = _rows(weight, d, n)


class ShardedEmbedding(nn.Module):
    """nn.Embedding split by vocabulary: each device looks up its own ids, device 0 sums."""

    def __init__(self, embed: nn.Embedding, n: int):
        super().__init__()
        self.per = embed.weight.shape[0] // n
        self.shards = nn.ModuleList(VocabShard(embed.weight, d, n) for d in range(n))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        y = None
        for d, shard in enumerate(self.shards):
            t = to_device(d, tokens)
            mine = torch.div(t, self.per, rounding_mode="floor") == d
            e = F.embedding(torch.where(mine, t - d * self.per, torch.zeros((), dtype=t.dtype)), shard.weight)
            e = to_device(0, torch.where(mine[..., None], e, torch.zeros((), dtype=e.dtype)))
            y = e if y is None else y + e
        return y


class ShardedHead(nn.Module):
    """The bias-free output head split by vocabulary: logits concatenated on device 0."""

    def __init__(self, head: nn.Module, n: int):
        super().__init__()
        self.shards = nn.ModuleList(VocabShard(head.weight, d, n) for d in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([to_device(0, f32_linear(to_device(d, x), s.weight)) for d, s in enumerate(self.shards)], -1)


_HEAD_PARAMS = ("wq_b", "attn_sink", "wo_a")


@contextlib.contextmanager
def sharded(model: nn.Module, n: int) -> Iterator[nn.Module]:
    """`model` (a dsv4 Transformer) laid out over n devices while the block runs; afterwards it is
    exactly as before (same parameters, same state-dict order). n = 1 changes nothing."""
    if n == 1:
        yield model
        return
    check_devices(model.cfg, n)
    blocks = [*model.layers, *model.mtp]
    touched = [model, *(b.attn for b in blocks), *(b.ffn for b in blocks)]
    saved = [(m, dict(m._parameters), dict(m._modules), dict(m.__dict__)) for m in touched]
    try:
        model.embed = ShardedEmbedding(model.embed, n)
        model.head = ShardedHead(model.head, n)
        for block in blocks:
            block.ffn.experts = ShardedExperts(block.ffn.experts, n)
            attn = block.attn
            attn.head_shards = HeadShards(attn, n)
            for name in _HEAD_PARAMS:  # now held per device by head_shards
                delattr(attn, name)
        yield model
    finally:
        for m, params, mods, attrs in saved:
            m._parameters, m._modules = params, mods
            m.__dict__.update({k: v for k, v in attrs.items() if k not in ("_parameters", "_modules")})
