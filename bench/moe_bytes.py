"""Bytes of routed-expert weights one decode step reads, from the exported graph's shapes.

Traces the routed MoE (model/kernels/moe.py `moe_experts_routed`, what export installs) on meta
tensors of the preset's real sizes and sums the bytes of every expert-weight gather it issues (the
packed weights and their scales: exactly what the kernel dequantizes). Next to it: the routed ideal
(the distinct experts the step's tokens select: expected value under uniform routing, and the worst
case min(E, B*k)) and the all-experts reference (every expert of every layer, today's form). Also
the prefill FLOP ratio (rows the grouped path multiplies / routed rows) per chunk length.
A benchmark, not a test; needs no weights.

    python -m dsv4.bench.moe_bytes [--preset flash] [--batch 1 16 64] [--block 16]
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.bench.traffic import expected_distinct
from dsv4.model.config import ModelConfig
from dsv4.model.kernels.moe import GROUP_BLOCK, moe_experts_routed


class _GatherBytes(TorchDispatchMode):
    """Sums the output bytes of index_select over a stacked [E, ...] expert tensor; counts matmul rows."""

    def __init__(self, n_experts: int):
        super().__init__()
        self.E, self.bytes, self.rows = n_experts, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.index_select.default and args[0].dim() == 3 and args[0].shape[0] == self.E:
            self.bytes += out.numel() * out.element_size()
        if func in (torch.ops.aten.bmm.default,) and self.rows == 0:
            self.rows = out.shape[0] * out.shape[1]  # first GEMM (w1): [groups, rows per group, I]
        return out


def _expert_tensors(cfg: ModelConfig, device: str = "meta") -> tuple:
    E, d, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    ts = []
    for o, i in ((inter, d), (d, inter), (inter, d)):
        if cfg.expert_dtype == "fp4":
            ts += [torch.empty(E, o, i // 2, dtype=torch.uint8, device=device),
                   torch.empty(E, o, i // 32, dtype=torch.uint8, device=device)]
        elif cfg.expert_dtype == "fp8":
            ts += [torch.empty(E, o, i, dtype=torch.float8_e4m3fn, device=device),
                   torch.empty(E, -(-o // 128), -(-i // 128), dtype=torch.uint8, device=device)]
        else:
            ts += [torch.empty(E, o, i, dtype=torch.bfloat16, device=device), None]
    return tuple(ts)


def routed_trace(cfg: ModelConfig, tokens: int, block: int = GROUP_BLOCK) -> tuple[int, int]:
    """(expert-weight bytes gathered, GEMM rows) of one MoE layer for `tokens` flattened tokens."""
    w1, s1, w2, s2, w3, s3 = _expert_tensors(cfg)
    k = cfg.num_experts_per_tok
    x = torch.empty(tokens, cfg.hidden_size, dtype=torch.bfloat16, device="meta")
    w = torch.empty(tokens, k, dtype=torch.float32, device="meta")
    i = torch.empty(tokens, k, dtype=torch.int64, device="meta")
    with _GatherBytes(cfg.n_routed_experts) as m:
        moe_experts_routed(x, w, i, w1, s1, w2, s2, w3, s3, cfg.swiglu_limit, block=block)
    return m.bytes, m.rows


def expert_bytes(cfg: ModelConfig) -> int:
    """Bytes of one expert's w1, w2, w3 with their scales."""
    return sum(t[0].numel() * t.element_size() for t in _expert_tensors(cfg) if t is not None)


def decode_table(cfg: ModelConfig, batches: list[int], block: int) -> list[dict]:
    E, k, L = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_layers
    per = expert_bytes(cfg)
    rows = []
    for b in batches:
        got, _ = routed_trace(cfg, b, block)
        expect = expected_distinct(E, k, b)
        rows.append(dict(batch=b, graph=got * L, graph_experts=got / per, ideal=expect * per * L, ideal_experts=expect,
                         worst=min(E, b * k) * per * L, all=E * per * L))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4.bench.moe_bytes", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--block", type=int, default=None, help=f"rows per block (default: the kernel's, {GROUP_BLOCK})")
    ap.add_argument("--chunks", type=int, nargs="+", default=[128, 512, 2048, 4096])
    a = ap.parse_args(argv)
    cfg = ModelConfig.preset(a.preset)
    E, k, L = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_layers
    gb = 1e9
    blk = a.block or GROUP_BLOCK
    print(f"{a.preset}: {L} MoE layers per decode step (the MTP block's MoE is not in decode_bs*), E={E}, "
          f"top-{k}, dim {cfg.hidden_size}, moe_inter {cfg.moe_intermediate_size}, experts {cfg.expert_dtype}; "
          f"{expert_bytes(cfg):,} B per expert (w1+w2+w3 + scales)")
    print(f"\ndecode step (T=1, static batch; grouped blocks of {blk} when batch*k > E): expert-weight bytes")
    print(f"{'batch':>5} | {'graph reads GB':>14} | {'experts/layer':>13} | {'ideal GB (E[distinct])':>22} | "
          f"{'worst distinct GB':>17} | {'all experts GB':>14} | graph/ideal")
    for r in decode_table(cfg, a.batch, blk):
        print(f"{r['batch']:>5} | {r['graph'] / gb:>14.2f} | {r['graph_experts']:>13.1f} | "
              f"{r['ideal'] / gb:>14.2f} ({r['ideal_experts']:5.1f}) | {r['worst'] / gb:>17.2f} | "
              f"{r['all'] / gb:>14.2f} | {r['graph'] / r['ideal']:.2f}")
    print(f"\nprefill bs1, one layer, blocks of {blk}: GEMM rows vs routed rows T*k (all experts: T*E = "
          f"{E / k:.1f}x routed). static T: the tight block bound; exported (T dynamic): E + T*k // {blk} blocks")
    print(f"{'T':>5} | {'routed':>7} | {'static rows':>11} | {'ratio':>5} | {'reads':>5} | "
          f"{'exported rows':>13} | {'ratio':>5} | {'reads':>5}")
    for t in a.chunks:
        got, r = routed_trace(cfg, t, blk)
        g_dyn = E + t * k // blk
        print(f"{t:>5} | {t * k:>7} | {r:>11} | {r / (t * k):>5.2f} | {got / expert_bytes(cfg):>5.0f} | "
              f"{g_dyn * blk:>13} | {g_dyn * blk / (t * k):>5.2f} | {g_dyn:>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
