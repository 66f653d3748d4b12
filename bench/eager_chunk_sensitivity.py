"""How far the eager model moves from itself when only fp32 summation order changes.

    python bench/eager_chunk_sensitivity.py OUT [--device cuda] [--prompt-len 100]

Prefills one random prompt into the eager model of an export (its .irpa, memory-mapped) whole, in
two chunks and in three; the chunkings compute the same function in another summation order. Each
run is repeated for the four combinations of the FP8 activation quantization of the quantized linears
(on as released, or the `weight_only` alternative) and --quant-sim (the KV / indexer simulations).
Prints max |logit difference| relative to max |logit| per chunking and the argmax of each. With
every rounding to FP8/FP4 gone the model is continuous and the chunkings agree to ~1e-6 in fp32; with
activation quantization on, one flipped e4m3 code cascades through the next roundings (the
weight_only note in model/kernels/linear.py). Use an export with float32 activations (--dtype fp32)
to see the cascade alone; bf16 adds its own rounding.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="export directory with its .irpa weights")
    ap.add_argument("--device", default="cpu", help="torch device")
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch

    from dsv4.model.checkpoint import load_irpa
    from dsv4.model.config import ModelConfig
    from contextlib import nullcontext

    from dsv4.model.kernels.linear import weight_only_linears
    from dsv4.model.kernels.moe import routed_moe
    from dsv4.model.model import empty_model
    from dsv4.model.state import new_state

    out = Path(args.out)
    raw = json.loads((out / "config.json").read_text())
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[raw["activation_dtype"]]
    n = args.prompt_len
    ids = torch.from_numpy(np.random.default_rng(args.seed).integers(2, raw["model"]["vocab_size"], size=n))
    cuts = {"1 chunk": [0, n], "2 chunks": [0, n // 2, n], "3 chunks": [0, n // 3, (2 * n) // 3 + 1, n]}
    print(f"{out}  {raw['activation_dtype']}  prompt {n}  device {args.device}")
    for qsim in (True, False):
        cfg = ModelConfig.from_dict(raw["model"], quant_sim=qsim)
        t0 = time.perf_counter()
        model = empty_model(cfg, dtype, quantized=True)
        load_irpa(model, sorted(out.glob("*.irpa")), mapped=True)
        model = model.to(args.device).eval()
        z = torch.zeros(1, dtype=torch.long, device=args.device)
        for act_quant in (True, False):
            logits = {}
            with torch.no_grad(), routed_moe(), nullcontext() if act_quant else weight_only_linears():
                for name, c in cuts.items():
                    st = new_state(cfg, 1, dtype, device=args.device)
                    for a, b in zip(c[:-1], c[1:]):
                        lg = model(ids[None, a:b].to(args.device), z + a, z + (b - a), z, st)
                    logits[name] = lg[0].double().cpu()
            ref = logits["1 chunk"]
            rel = {k: float((v - ref).abs().max() / ref.abs().max()) for k, v in logits.items() if k != "1 chunk"}
            print(f"quant_sim {'on ' if qsim else 'off'}  activation quant {'on ' if act_quant else 'off'}:  "
                  + "  ".join(f"{k} rel {v:.2e}" for k, v in rel.items())
                  + f"  argmax {[int(v.argmax()) for v in logits.values()]}  ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
        del model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
