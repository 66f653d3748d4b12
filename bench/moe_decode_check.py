"""The routed MoE of one decode call alone, at Flash size: compiled vs torch on the same inputs, row by row.

    python bench/moe_decode_check.py build OUT [--target cuda] [--batch 8,32,64]
    python bench/moe_decode_check.py run OUT [--device cuda] [--repeats 3]      # on the GPU host

`build` traces `moe_experts_routed` (model/kernels/moe.py) as the exporter traces it (default kernels),
one entry point `moe_bs{N}` per batch: x f32 [N, 4096] (cast to bf16 inside, as the model's ffn_norm
output), weights f32 [N, 6], indices i64 [N, 6], and the MXFP4 expert stacks as arguments (no .irpa).
Decode batches whose N*6 pairs exceed the 256 experts take the grouped path (counting sort into 16-row
blocks), the others the per-pair gather. `run` makes random packed weights with numpy (E8M0 scales
near the init's), calls every function --repeats times on fresh random routing, and compares each
row with torch's eager `moe_experts_routed` on the GPU: non-finite rows, and the worst relative error.
Written for the all-NaN last row of Flash-4's decode_bs64 on cuda (docs/real-size.md, session 15).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import standalone  # bench/, beside this script

E, D, I, K_TOP, LIMIT = 256, 4096, 2048, 6, 10.0  # Flash: 256 experts, hidden 4096, inter 2048, top-6


def _shapes() -> dict[str, tuple[int, ...]]:
    return {"w1": (E, I, D // 2), "s1": (E, I, D // 32), "w2": (E, D, I // 2), "s2": (E, D, I // 32),
            "w3": (E, I, D // 2), "s3": (E, I, D // 32)}


def _moe(x, weights, indices, w1, s1, w2, s2, w3, s3):
    import torch

    from dsv4.model.kernels.moe import moe_experts_routed

    return moe_experts_routed(x.to(torch.bfloat16), weights, indices, w1, s1, w2, s2, w3, s3, LIMIT).float()


def build(out: Path, target: str, batches: list[int]) -> None:
    import torch

    w = [torch.zeros(s, dtype=torch.uint8) for s in _shapes().values()]
    standalone.build(_moe, "moe", lambda n: (torch.zeros(n, D), torch.zeros(n, K_TOP),
                                             torch.zeros(n, K_TOP, dtype=torch.int64), *w),
                     batches, out, "moe_decode", target)


def run(out: Path, device: str, repeats: int, seed: int) -> None:
    import iree.runtime as rt
    import torch

    g = np.random.default_rng(seed)
    host = {}
    for name, shape in _shapes().items():  # any byte is two valid FP4 codes; scales 2^-9..2^-5
        host[name] = (g.integers(0, 256, shape, dtype=np.uint8) if name[0] == "w"
                      else g.integers(118, 123, shape, dtype=np.uint8))
    config, fns = standalone.load(out, "moe_decode", "moe", device)
    dev_w = [rt.asdevicearray(config.device, host[n]) for n in _shapes()]
    tdev = "cuda" if torch.cuda.is_available() else "cpu"
    tw = [torch.from_numpy(host[n]).to(tdev) for n in _shapes()]
    for n, fn in fns.items():
        fname = f"moe_bs{n}"
        for r in range(repeats):
            x = (g.standard_normal((n, D)) * 0.5).astype(np.float32)
            idx = np.stack([g.choice(E, K_TOP, replace=False) for _ in range(n)]).astype(np.int64)
            wts = g.random((n, K_TOP)).astype(np.float32)
            t0 = time.perf_counter()
            got = np.array(fn(x, wts, idx, *dev_w).to_host(), copy=True)
            ms = (time.perf_counter() - t0) * 1e3
            with torch.no_grad():
                want = _moe(torch.from_numpy(x).to(tdev), torch.from_numpy(wts).to(tdev),
                            torch.from_numpy(idx).to(tdev), *tw).cpu().double().numpy()
            bad = [k for k in range(n) if not np.isfinite(got[k]).all()]
            err = np.abs(got - want).max(-1) / np.abs(want).max()
            worst = int(np.nanargmax(np.where(np.isfinite(err), err, -1)))
            print(f"{fname} call {r}: non-finite rows {bad}; worst finite row {worst} rel err {err[worst]:.2e}; "
                  f"rows with rel err > 0.1: {[k for k in range(n) if not err[k] <= 0.1]} ({ms:.1f} ms)", flush=True)


if __name__ == "__main__":
    sys.exit(standalone.cli(__doc__, build, run, "8,32,64"))
