"""Does an N-device export compute what the one-device export computes? (docs/scale.md)

    python -m dsv4.bench.multidevice_parity ONE_DEVICE_EXPORT N_DEVICE_EXPORT [--device local-task]
        [--prompt-ids 3,17,100,...] [--steps 32] [--json]

Both exports must hold the same weights (same checkpoint, or the same --preset/--seed: the N-device
export cuts the same whole tensors). Per prompt: the prefill logits' max abs difference and the
largest |logit|, equal argmax, and whether greedy decoding gives the same tokens for --steps steps.
Torch-free: runs on a host with only the runtime (the GPU pair: `--device cuda`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from dsv4.runtime.engine import Engine

DEFAULT_PROMPTS = ([3, 17, 100, 250, 511, 7, 42, 300, 5, 64, 128, 256, 1, 2], list(range(5, 45, 2)))


def prefill_logits(eng: Engine, prompt: list[int]) -> np.ndarray:
    i64 = np.int64
    state = [eng.module.zeros(s) for s in eng.config.state]
    n = len(prompt)
    logits, _ = eng.module("prefill_bs1", np.array([prompt], i64), np.zeros(1, i64), np.array([n], i64),
                           np.zeros(1, i64), *state)
    return logits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv4.bench.multidevice_parity",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("one", type=Path, help="the one-device export")
    p.add_argument("many", type=Path, help="the N-device export of the same weights")
    p.add_argument("--device", default="local-task")
    p.add_argument("--prompt-ids", action="append", default=None,
                   help="comma-separated token ids (repeatable; default: two fixed prompts)")
    p.add_argument("--steps", type=int, default=16, help="greedy tokens compared (default 16)")
    p.add_argument("--stage-devices", default=None,
                   help="a pipeline export's device index per stage, e.g. 0,0 (both stages on one GPU)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    prompts = [[int(t) for t in s.split(",")] for s in args.prompt_ids] if args.prompt_ids else DEFAULT_PROMPTS
    stages = None if args.stage_devices is None else [int(i) for i in args.stage_devices.split(",")]
    many = Engine(args.many, device=args.device, stage_devices=stages)  # first: a multi-GPU engine sets up the cuda driver (module.py)
    one = Engine(args.one, device=args.device)
    rows = []
    for prompt in prompts:
        a, b = prefill_logits(one, prompt), prefill_logits(many, prompt)
        ga = list(one.generate(prompt, max_new_tokens=args.steps).tokens)
        gb = list(many.generate(prompt, max_new_tokens=args.steps).tokens)
        rows.append({"prompt_tokens": len(prompt), "max_abs_diff": float(np.abs(a - b).max()),
                     "max_abs_logit": float(np.abs(a).max()), "argmax_equal": bool(a.argmax() == b.argmax()),
                     "greedy_steps": args.steps, "greedy_equal": ga == gb,
                     "first_greedy_difference": next((i for i, (x, y) in enumerate(zip(ga, gb)) if x != y), None)})
    report = {"one": str(args.one), "many": str(args.many), "devices": many.config.n_devices,
              "device": args.device, "prompts": rows}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{args.one} (1 device) vs {args.many} ({many.config.n_devices} devices) on {args.device}")
        print(f"{'prompt':>6} {'max|diff|':>10} {'max|logit|':>10} {'argmax':>6} {'greedy':>10}")
        for r in rows:
            print(f"{r['prompt_tokens']:>6} {r['max_abs_diff']:>10.3g} {r['max_abs_logit']:>10.4g} "
                  f"{'equal' if r['argmax_equal'] else 'DIFF':>6} "
                  f"{('equal' if r['greedy_equal'] else 'from ' + str(r['first_greedy_difference'])):>10}")
    return 0 if all(r["argmax_equal"] and r["greedy_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
