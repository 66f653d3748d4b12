"""The decode step's tail alone at Flash size (hc_head -> norm -> head -> argmax), compiled vs torch, row by row.

    python bench/head_check.py build OUT [--target cuda] [--batch 40,48,56,64]
    python bench/head_check.py run OUT [--device cuda] [--repeats 3]      # on the GPU host

`build` traces, per batch N, `tail_bs{N}(h f32 [N,1,4,4096], fn, base, scale, norm_w, head_w bf16 [129280, 4096])`
-> (logits f32 [N, V], argmax i64 [N]) as the exporter's decode step ends (model.final_logits, then
first_argmax with -1 for a non-finite row), kernels as export picks them; the weights are
arguments (no .irpa). `run` feeds random streams and init-scale weights and prints, per call, the
rows with non-finite logits or argmax -1 and the worst relative error against torch on the GPU.
Written for the all-NaN last row of Flash-4's decode_bs40 / decode_bs64 on cuda (docs/real-size.md,
session 15).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import standalone  # bench/, beside this script

N_HC, D, V = 4, 4096, 129280


def _tail(h, fn, base, scale, norm_w, head_w):
    import torch

    from dsv4.model.config import ModelConfig
    from dsv4.model.device_sampling import all_finite
    from dsv4.model.kernels.linear import f32_linear
    from dsv4.model.kernels.topk import first_argmax
    from dsv4.model.model import hc_head

    cfg = ModelConfig.preset("flash")
    x = hc_head(h.to(torch.bfloat16), fn, scale, base, cfg.hc_eps, cfg.rms_norm_eps)
    xf = x.float()
    x = (norm_w * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + cfg.rms_norm_eps))).to(x.dtype)
    logits = f32_linear(x.flatten(0, -2), head_w)
    return logits, torch.where(all_finite(logits), first_argmax(logits)[:, 0], -1)


def _weights(g: np.random.Generator) -> list[np.ndarray]:
    import ml_dtypes

    return [(g.standard_normal((N_HC, N_HC * D)) * 0.01).astype(np.float32), np.zeros(N_HC, np.float32),
            np.ones(1, np.float32), np.ones(D, np.float32),
            (g.standard_normal((V, D)) * 0.02).astype(ml_dtypes.bfloat16)]


def build(out: Path, target: str, batches: list[int]) -> None:
    import torch

    w = (torch.zeros(N_HC, N_HC * D), torch.zeros(N_HC), torch.ones(1), torch.ones(D), torch.zeros(V, D, dtype=torch.bfloat16))
    standalone.build(_tail, "tail", lambda n: (torch.zeros(n, 1, N_HC, D), *w), batches, out, "head_check", target)


def run(out: Path, device: str, repeats: int, seed: int) -> None:
    import iree.runtime as rt
    import torch

    g = np.random.default_rng(seed)
    host = _weights(g)
    config, fns = standalone.load(out, "head_check", "tail", device)
    dev_w = [rt.asdevicearray(config.device, a) for a in host[:4]]
    # bf16 has no numpy dtype the runtime knows: upload the bits, typed as bf16
    bits = np.ascontiguousarray(host[4]).view(np.uint16)
    bv = config.device.allocator.allocate_buffer_copy(
        memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=rt.BufferUsage.DEFAULT, device=config.device,
        buffer=bits, element_type=rt.HalElementType.BFLOAT_16)
    dev_w.append(rt.DeviceArray(config.device, bv, override_dtype=np.uint16))
    tdev = "cuda" if torch.cuda.is_available() else "cpu"
    tw = [torch.from_numpy(a).to(tdev) for a in host[:4]] + [torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(tdev)]
    for n, fn in fns.items():
        fname = f"tail_bs{n}"
        for r in range(repeats):
            h = g.standard_normal((n, 1, N_HC, D)).astype(np.float32)
            res = fn(h, *dev_w)
            got = np.array(res[0].to_host(), copy=True)
            am = np.asarray(res[1].to_host()).reshape(-1)
            with torch.no_grad():
                want = _tail(torch.from_numpy(h).to(tdev), *tw)[0].double().cpu().numpy()
            bad = [k for k in range(n) if not np.isfinite(got[k]).all()]
            err = np.abs(np.nan_to_num(got, nan=1e30) - want).max(-1) / np.abs(want).max()
            print(f"{fname} call {r}: non-finite rows {bad}; argmax -1 rows {np.flatnonzero(am < 0).tolist()}; "
                  f"max rel err {err.max():.2e} (row {int(err.argmax())})", flush=True)


if __name__ == "__main__":
    sys.exit(standalone.cli(__doc__, build, run, "40,48,56,64"))
