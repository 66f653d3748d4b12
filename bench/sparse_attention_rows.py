"""Does the compiled sparse-attention kernel give every row of a batch its own right answer? A minimal
repro of the decode_bs32 last-row NaN of sessions 15-22 (docs/performance.md, session 22): the
`sparse_attention` hot spot exported alone at Flash's decode shapes (64 heads x 512, one KV head, idx of
K entries: the 128-row window plus the compressed entries) and checked against a float64 numpy
reference, with every row holding the same inputs. K = 130 is Flash's first HCA layer at
max_seq_len 256 (128 + 256/128); K = 128 and 192 are the other layers'. Measured on the H200 (session
22): every K that is not a multiple of 16 (8, 12, 129, 130, 136) returns the last row of batches 8, 32
and 64 non-finite; multiples of 16 (48, 96, 128, 144, 192) and batch 1 are right; llvm-cpu is right.

    python bench/sparse_attention_rows.py build DIR [--target cuda] [--target llvm-cpu]   # here
    python bench/sparse_attention_rows.py check DIR --device cuda                        # on the device

`*_pad` functions pad idx with -1 to a multiple of 16 first (model.pad_selection, the fix); `*_reference`
functions lower the op as its torch reference (`--kernel sparse_attention=reference`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

H, D, SCALE = 64, 512, 512 ** -0.5
CASES = [(32, 130), (8, 130), (1, 130), (64, 130), (32, 8), (32, 12), (32, 129), (32, 136),  # (batch, K)
         (32, 48), (32, 96), (32, 128), (32, 144), (32, 192)]
PATTERNS = {"pos1": 2, "pos16": 17, "full": None}  # valid entries at the front of idx (None: all)


def _fn(b: int, k: int, variant: str) -> str:
    return f"bs{b}_k{k}{'_' + variant if variant != 'kernel' else ''}"


def build(out: Path, targets: list[str], cases: list[tuple[int, int]]) -> None:
    import torch
    import iree.turbine.aot as aot

    import dsv4.model.model as mm
    from dsv4.export.compile import compile_mlir
    from dsv4.export.kernel_op import use_kernels
    from dsv4.model.model import pad_selection

    out.mkdir(parents=True, exist_ok=True)
    done = []
    for b, k in cases:
        for variant in ("kernel", "pad", "reference") if k % 16 else ("kernel",):
            pad = variant == "pad"

            class F(torch.nn.Module):
                def forward(self, q, kv, idx, sink):
                    return mm.sparse_attention(q, kv, pad_selection(idx) if pad else idx, sink, SCALE)

            args = (torch.zeros(b, 1, H, D, dtype=torch.bfloat16), torch.zeros(b, k + 2, D, dtype=torch.bfloat16),
                    torch.zeros(b, 1, k, dtype=torch.int64), torch.zeros(H, dtype=torch.float32))
            with torch.no_grad(), use_kernels({"sparse_attention": "reference"} if variant == "reference" else None):
                e = aot.export(F(), args=args)
            for t in targets:
                compile_mlir(e, t, out / f"{_fn(b, k, variant)}.{t}.vmfb")
            done.append([b, k, variant])
    (out / "index.json").write_text(json.dumps({"cases": done, "targets": targets}))
    print(f"built {len(done)} functions x {len(targets)} targets in {out}")


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> their float32 values, exactly."""
    return (np.asarray(bits).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _bf16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 -> bf16 bits (round to nearest even) as uint16, and the rounded values as float64."""
    from dsv4.contract.random_weights import bf16_bits

    bits = bf16_bits(x.astype(np.float32))
    return bits, _bf16_values(bits).astype(np.float64)


def reference(q: np.ndarray, kv: np.ndarray, idx: np.ndarray, sink: np.ndarray) -> np.ndarray:
    """float64 sparse attention of one row (q [H,D], kv [N,D], idx [K]); p rounded to bf16 as the kernel."""
    valid = idx >= 0
    sel = np.where(valid[:, None], kv[np.maximum(idx, 0)], 0.0)
    s = np.where(valid[None, :], q @ sel.T * SCALE, -np.inf)
    m = np.maximum(s.max(-1), sink)
    p = np.exp(s - m[:, None])
    p = p / (p.sum(-1) + np.exp(sink - m))[:, None]
    return _bf16(p)[1] @ sel


def _bf16_device(ctx, bits: np.ndarray):
    """A device array of bf16 element type from its uint16 bits (asdevicearray has no bf16)."""
    import iree.runtime as rt

    dev = ctx.config.device
    bv = dev.allocator.allocate_buffer_copy(memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=rt.BufferUsage.DEFAULT,
                                            device=dev, buffer=bits, element_type=rt.HalElementType.BFLOAT_16)
    return rt.DeviceArray(dev, bv)


def check(out: Path, device: str) -> int:
    import iree.runtime as rt

    index = json.loads((out / "index.json").read_text())
    target = "cuda" if device == "cuda" else "llvm-cpu"
    rng = np.random.default_rng(0)
    cfg = rt.Config(device)
    bad_total = 0
    for b, k, variant in index["cases"]:
        vm = rt.VmModule.mmap(cfg.vm_instance, str(out / f"{_fn(b, k, variant)}.{target}.vmfb"))
        ctx = rt.SystemContext(vm_modules=[vm], config=cfg)
        f = ctx.modules.module["main"]
        qb, qv = _bf16(rng.standard_normal((H, D)))
        kb, kvv = _bf16(rng.standard_normal((k + 2, D)))
        sink = rng.standard_normal(H).astype(np.float32)
        for pat, n_valid in PATTERNS.items():
            idx = np.arange(k, dtype=np.int64) % (k + 2)
            if n_valid is not None:
                idx[n_valid:] = -1
            want = reference(qv, kvv, idx, sink.astype(np.float64))
            q_d, kv_d = (_bf16_device(ctx, np.broadcast_to(x, (b, *x.shape)).copy()) for x in (qb[None], kb))
            idx_d = np.broadcast_to(idx[None], (b, 1, k)).copy()
            res = f(q_d, kv_d, idx_d, sink)
            a = res if isinstance(res, np.ndarray) else res.to_host()
            got = _bf16_values(a).reshape(b, H, D)
            err = np.abs(got - want[None]).max(axis=(1, 2)) / np.abs(want).max()
            nonfinite = [r for r in range(b) if not np.isfinite(got[r]).all()]
            wrong = [r for r in range(b) if not (err[r] < 1e-2)]
            bad_total += len(wrong)
            cols = sorted({int(c) % D for r in nonfinite for c in np.nonzero(~np.isfinite(got[r]).reshape(-1))[0]})
            print(f"{_fn(b, k, variant):18s} {pat:6s} rows wrong {wrong or 'none'} (non-finite {nonfinite or 'none'}"
                  f"{', at d ' + str(cols[:8]) if cols else ''}); max rel err of the right rows "
                  f"{max([float(err[r]) for r in range(b) if r not in wrong] or [0]):.1e}", flush=True)
    print(f"{bad_total} wrong rows in all")
    return 1 if bad_total else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("dir", type=Path)
    b.add_argument("--target", action="append", dest="targets")
    b.add_argument("--cases", type=lambda t: [tuple(int(v) for v in c.split(":")) for c in t.split(",")],
                   default=CASES, help="BATCH:K,... (default: %(default)s)")
    c = sub.add_parser("check")
    c.add_argument("dir", type=Path)
    c.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        build(a.dir, a.targets or ["cuda", "llvm-cpu"], a.cases)
        return 0
    return check(a.dir, a.device)


if __name__ == "__main__":
    sys.exit(main())
