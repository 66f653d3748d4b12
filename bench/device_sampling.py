"""Sampling on the device vs on the host: decode ms/step of sampled requests through the Engine.

    python -m dsv4.bench.device_sampling OUT --device cuda --batch 1,8,32,64 --steps 16 [--check]

For each batch size B, B requests (16-token prompts, temperature 1.0, top_p 0.9, ignore_eos) run
`steps` decode steps, once with the export's sample_bs{N} (only ids come back) and once sampling on
the host (the decode's logits read back, runtime/sampling.py), plus greedy requests as the floor.
Printed: ms per engine step (the mean after 2 untimed steps). `--check` first runs every
sample_bs{N} on random logits and compares its ids with model.device_sampling.sample in torch
(the module's own reference): the count of rows that differ.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def check(eng, sizes: list[int], vocab: int, trials: int = 8) -> None:
    import torch

    from dsv4.model.device_sampling import sample

    g = np.random.default_rng(0)
    for n in sizes:
        fn = eng.module.function(f"sample_bs{n}")
        bad = total = 0
        for _ in range(trials):
            x = (g.standard_normal((n, vocab)) * 3).astype(np.float32)
            temp = g.choice([0.0, 0.7, 1.0, 1.3], n).astype(np.float32)
            top_k = g.choice([0, 1, 20, 500], n).astype(np.int64)
            top_p = g.choice([1.0, 0.95, 0.6], n).astype(np.float32)
            key = g.integers(0, 2**32, n, dtype=np.int64)
            got = np.asarray(fn(x, temp, top_k, top_p, key).to_host()).reshape(-1)
            ref = sample(*(torch.from_numpy(a) for a in (x, temp, top_k, top_p, key))).numpy()
            bad += int((got != ref).sum())
            total += n
        print(f"sample_bs{n}: {bad} of {total} rows differ from torch", flush=True)


def step_ms(eng, batch: int, steps: int, params) -> float:
    """Mean ms per engine step, or NaN (with the engine's message) when a step returned non-finite logits."""
    from dsv4.runtime import EngineError

    g = np.random.default_rng(batch)
    vocab = eng.config.model["vocab_size"]
    ids = [eng.submit(g.integers(3, vocab, 16).tolist(), params(k)) for k in range(batch)]
    times = []
    try:
        while eng.has_work:
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
    except EngineError as e:
        print(f"batch {batch}: {e}", flush=True)
        for i in ids:
            eng.cancel(i)
        return float("nan")
    return 1e3 * float(np.mean(times[3:3 + steps]))  # step 1 prefills; 2 untimed decode steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4.bench.device_sampling", description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", default="1,8,32,64")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)

    from dsv4.runtime import Engine, SamplingParams

    eng = Engine(args.out, device=args.device)
    sizes = [int(b) for b in args.batch.split(",")]
    if args.check:
        check(eng, sizes, eng.config.model["vocab_size"])
    n = args.steps + 3
    sampled = lambda k: SamplingParams(max_new_tokens=n, temperature=1.0, top_p=0.9, seed=k, ignore_eos=True)
    greedy = lambda k: SamplingParams(max_new_tokens=n, ignore_eos=True)
    print(f"{'batch':>5} {'greedy':>10} {'sampled, device':>16} {'sampled, host':>14}  (ms per engine step)", flush=True)
    for b in sizes:
        eng.device_sampling = True
        row = [step_ms(eng, b, args.steps, greedy), step_ms(eng, b, args.steps, sampled)]
        eng.device_sampling = False
        row.append(step_ms(eng, b, args.steps, sampled))
        print(f"{b:>5} {row[0]:>10.2f} {row[1]:>16.2f} {row[2]:>14.2f}", flush=True)
    print(f"device samples: {eng.stats['device_samples']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
