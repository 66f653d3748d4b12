"""Hot-spot ops at decode's static shapes, checked on a device against numpy (the Flash-4 cuda decode
NaN of sessions 11-12, docs/real-size.md).

    python bench/decode_shapes.py prepare -o OUT [--target cuda]   # here (torch + compiler)
    python bench/decode_shapes.py run OUT [--driver cuda]          # there (iree-base-runtime + numpy)

- top-k: the MoE gate of one decode row ([1, 256] scores, k = 6) and the CSA indexer at position 128
  of a 256-position export ([1, 1, 64] entries, 32 of them -inf because not yet visible, k = 64),
  each row against numpy's stable descending sort (the contract of model/kernels/topk.py).
- sparse attention, both lowerings (torch reference and the MLIR kernel), one decode query of Flash's
  64 heads x 512 over K selected rows (bf16 q and KV): K = 130 is the HCA layer of a 256-position
  export (a 128-row window + 2 compressed entries), 192 and 256 are round counts beside it. Each K
  runs with three masks: the first 65 rows valid (position 64), the first 129 (position 127: the
  window and the first compressed entry) and all. Against a float64 numpy reference.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

GATE, INDEXER = (1, 256), (1, 1, 64)
H, D = 64, 512
ATTN_K = (130, 192, 256)
MASKS = {"first 65": 65, "first 129": 129, "all": None}


def prepare(out: Path, target: str) -> None:
    import torch
    from iree.turbine import aot

    import dsv4.export  # noqa: F401
    from dsv4.export.compile import compile_mlir
    from dsv4.export.kernel_op import use_kernels
    from dsv4.model.kernels.sparse_attention import sparse_attention
    from dsv4.model.kernels.topk import topk_indices

    fxb = aot.FxProgramsBuilder(torch.nn.Module())
    with torch.no_grad(), use_kernels({}):
        fxb.export_program(lambda m, g, s: (topk_indices(g, 6), topk_indices(s, 64)), name="topk",
                           args=(torch.zeros(GATE), torch.zeros(INDEXER)), strict=False)

    def attn(m, q, kv, idx, sink):  # f32 in and out, bf16 inside as the model runs it
        return sparse_attention(q.to(torch.bfloat16), kv.to(torch.bfloat16), idx, sink, D ** -0.5).float()

    for impl in ("reference", "kernel"):
        for k in ATTN_K:
            with torch.no_grad(), use_kernels({"sparse_attention": impl}):
                fxb.export_program(attn, name=f"attn_{impl}_k{k}", strict=False, args=(
                    torch.zeros(1, 1, H, D), torch.zeros(1, k + 2, D), torch.zeros(1, 1, k, dtype=torch.int64),
                    torch.zeros(H)))
    out.mkdir(parents=True, exist_ok=True)
    mlir = out / "decode_shapes.mlir"
    aot.export(fxb, import_symbolic_shape_expressions=False).save_mlir(str(mlir))
    print(compile_mlir(mlir, target, out / f"decode_shapes.{target.split(':')[0]}.vmfb", []).path)


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even), kept as float32."""
    from dsv4.contract.random_weights import bf16_bits

    return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


def attention_reference(q, kv, idx, sink) -> np.ndarray:
    """float64 sparse attention with a sink (model/kernels/sparse_attention.py's contract)."""
    sel = kv[0, np.clip(idx[0, 0], 0, None)].astype(np.float64)  # [K, D]
    s = np.einsum("hd,kd->hk", q[0, 0].astype(np.float64), sel) * D ** -0.5
    s = np.where(idx[0, 0] >= 0, s, -np.inf)
    m = np.maximum(s.max(-1), sink)
    p = np.exp(s - m[:, None])
    p = p / (p.sum(-1) + np.exp(sink - m))[:, None]
    return np.einsum("hk,kd->hd", p, sel)[None, None]


def run(out: Path, driver: str, reps: int) -> int:
    import iree.runtime as rt

    vmfb = next(out.glob("decode_shapes.*.vmfb"))
    cfg = rt.Config(driver)
    ctx = rt.SystemContext(config=cfg)
    ctx.add_vm_module(rt.VmModule.mmap(cfg.vm_instance, str(vmfb)))
    mod = ctx.modules.module
    rng = np.random.default_rng(0)
    wrong = {"gate": 0, "indexer": 0}
    for r in range(reps):
        gate = rng.standard_normal(GATE).astype(np.float32)
        entries = rng.standard_normal(INDEXER).astype(np.float32)
        entries[..., 32:] = -np.inf
        got = [np.asarray(x.to_host()) for x in mod["topk"](gate, entries)]
        want = [np.argsort(-gate, -1, kind="stable")[..., :6], np.argsort(-entries, -1, kind="stable")[..., :64]]
        for name, g, w in zip(wrong, got, want):
            if not np.array_equal(g, w):
                wrong[name] += 1
                if wrong[name] <= 3:
                    print(f"row {r} {name}: got {g.ravel().tolist()} want {w.ravel().tolist()}")
    print(f"top-k on {driver}: rows that break the tie rule, of {reps}: {wrong}")
    bad = int(any(wrong.values()))

    print(f"sparse attention on {driver}, max |err| / max |want| (bf16 inputs; ~1e-2 is bf16 rounding):")
    print(f"{'K':>5} {'mask':>10} {'reference':>12} {'kernel':>12}")
    for k in ATTN_K:
        q = _bf16(rng.standard_normal((1, 1, H, D)).astype(np.float32))
        kv = _bf16(rng.standard_normal((1, k + 2, D)).astype(np.float32))
        sink = rng.standard_normal(H).astype(np.float32)
        for mask, n in MASKS.items():
            idx = np.arange(k, dtype=np.int64)[None, None].copy()  # row i of kv for slot i: all distinct
            if n is not None:
                idx[..., n:] = -1
            want = attention_reference(q, kv, idx, sink)
            errs = []
            for impl in ("reference", "kernel"):
                g = np.asarray(mod[f"attn_{impl}_k{k}"](q, kv, idx, sink).to_host()).astype(np.float64)
                e = float(np.abs(g - want).max() / np.abs(want).max())
                errs.append(f"{e:12.2e}" if np.isfinite(g).all() else f"{int((~np.isfinite(g)).sum()):>7} NaN")
                bad |= not (np.isfinite(g).all() and e < 0.05)
            print(f"{k:>5} {mask:>10} {errs[0]:>12} {errs[1]:>12}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("-o", "--out", type=Path, required=True)
    p.add_argument("--target", default="cuda")
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--driver", default="cuda")
    r.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    if a.cmd == "prepare":
        prepare(a.out, a.target)
        return 0
    return run(a.out, a.driver, a.reps)


if __name__ == "__main__":
    raise SystemExit(main())
