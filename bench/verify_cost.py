"""What one MTP verify call costs against one plain decode call of the same export (issue 45's
speed-up estimate). At small batch a decode step reads every weight once; a verify call scores
1 + K tokens per row for about the same bytes, so with an acceptance rate a per draft a step
emits 1 + a*K tokens (K = 1; longer chains accept less) and the speed-up is
(1 + a*K) * decode_ms / verify_ms.

    python -m dsv4.bench.verify_cost OUT [--device cuda] [--batch 1,8] [--context 128] [--steps 32]

--profile adds the top dispatches of one call of each (dsv4 bench's per-dispatch profile).
OUT: an export made with `dsv4 export --draft-tokens K` (its decode_bs{N} and verify_bs{N}_k{K});
random weights are fine (`dsv4 weights random OUT`): the cost of a call does not depend on them.
Each row decodes at positions context, context + 1, ... (every call writes the next positions:
the same work as a real step); a table of median ms per call, and the speed-up at a few acceptance
rates, is printed (and one JSON line with --json)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Sequence

import numpy as np

from dsv4.bench.speed import PROFILE_CALLS, dispatch_profile, profile_lines
from dsv4.contract.artifact import verify_name


def open_export(export_dir: str, device: str) -> Any:
    """The Engine of an export with verify entry points (SystemExit naming the flag otherwise)."""
    from dsv4.runtime.engine import Engine

    eng = Engine(export_dir, device=device)
    if eng.config.speculative is None:
        raise SystemExit(f"{export_dir} has no verify entry points: export it with --draft-tokens K")
    return eng


def measure(eng: Any, batch_sizes: Sequence[int], context: int, steps: int,
            warmup: int = 3, seed: int = 0) -> list[dict[str, Any]]:
    """Median ms per decode_bs{N} and per verify_bs{N}_k{K} call of `eng` (open_export) for each N in
    `batch_sizes`."""
    k = int(eng.config.speculative["draft_tokens"])
    rng = np.random.default_rng(seed)
    vocab = eng.config.vocab_size
    rows = []
    for n in batch_sizes:
        slots = np.arange(n, dtype=np.int64)
        times: dict[str, float] = {}
        for name, width in ((f"decode_bs{n}", 1), (verify_name(n, k), 1 + k)):
            lengths = np.full(n, width, np.int64)
            samples = []
            for i in range(warmup + steps):
                tokens = rng.integers(2, vocab, size=(n, width), dtype=np.int64)
                start = np.full(n, context + i * width, np.int64)
                t0 = time.perf_counter()
                if name.startswith("verify"):  # greedy rows: temperature 0, top_k 0, top_p 1, key 0
                    greedy = (np.zeros(n, np.float32), np.zeros(n, np.int64), np.ones(n, np.float32),
                              np.zeros(n, np.int64))
                    out = eng.module.function(name)(tokens, start, lengths, slots, *greedy, *eng.state)
                else:
                    out = eng.invoke(name, tokens, start, lengths, slots)
                np.asarray(out[1].to_host())  # the chosen / argmax tokens: the step's end
                if i >= warmup:
                    samples.append(time.perf_counter() - t0)
            times[name] = 1e3 * statistics.median(samples)
        dec, ver = times[f"decode_bs{n}"], times[verify_name(n, k)]
        rows.append({"batch": n, "draft_tokens": k, "decode_ms": dec, "verify_ms": ver, "ratio": ver / dec,
                     "speedup": {str(a): (1 + a * k) * dec / ver for a in (0.5, 0.7, 0.9)}})
    return rows


def profile(eng: Any, batch_sizes: Sequence[int], context: int) -> list[tuple[str, dict[str, Any]]]:
    """[(kind, dispatch_profile)] of decode_bs{N} and verify_bs{N}_k{K} of `eng` (open_export) for each N,
    zero state at `context`."""
    import tempfile
    from pathlib import Path

    k = int(eng.config.speculative["draft_tokens"])
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in batch_sizes:
            for kind, width in (("decode", 1), ("verify", 1 + k)):
                out.append((kind, dispatch_profile(eng, eng.device_name, kind, n, width, context, PROFILE_CALLS,
                                                   Path(tmp) / f"{kind}{n}")))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv4.bench.verify_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("export_dir")
    p.add_argument("--device", default="local-task", help="IREE driver: local-task, cuda, hip")
    p.add_argument("--batch", default="1", help="batch sizes, comma-separated (each exported for decode and verify)")
    p.add_argument("--context", type=int, default=128, help="the first decode position of every row")
    p.add_argument("--steps", type=int, default=32, help="timed calls per function (after 3 warm-up calls)")
    p.add_argument("--profile", action="store_true",
                   help="also the top dispatches of one decode and one verify call per batch size (as dsv4 bench's "
                        "per-dispatch profile: IREE's HAL profiling, Nsight Compute on cuda)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batch.split(",")]
    eng = open_export(a.export_dir, a.device)
    rows = measure(eng, batches, a.context, a.steps)
    print(f"{'batch':>5} {'K':>2} {'decode ms':>10} {'verify ms':>10} {'ratio':>6}   speed-up at acceptance 0.5 / 0.7 / 0.9")
    for r in rows:
        s = r["speedup"]
        print(f"{r['batch']:>5} {r['draft_tokens']:>2} {r['decode_ms']:>10.3f} {r['verify_ms']:>10.3f} "
              f"{r['ratio']:>6.2f}   {s['0.5']:.2f} / {s['0.7']:.2f} / {s['0.9']:.2f}")
    profiles = profile(eng, batches, a.context) if a.profile else []
    for kind, prof in profiles:
        print()
        print("\n".join(profile_lines(kind, prof)))
    if a.json:
        print(json.dumps({"export": a.export_dir, "device": a.device, "rows": rows,
                          "profiles": [prof for _, prof in profiles]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
