"""Time of one compiled decode call per exported batch size, without the Engine's request handling.

Why: bench/decode_tps.py times the whole decode loop; this separates the module's own time (the
invocation returns once its results exist) from the host's (reading the argmax back), and tries the
CUDA HAL's stream and graph modes. A benchmark, not a test.

    python bench/decode_call.py OUT [--device cuda] [--cuda-graphs] [--calls 100]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export_dir")
    ap.add_argument("--device", default="local-task")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--cuda-graphs", action="store_true", help="--cuda_use_streams=false (CUDA graphs)")
    args = ap.parse_args(argv)
    if args.cuda_graphs:
        import iree.runtime as rt

        rt.flags.parse_flags("--cuda_use_streams=false")
    from dsv4.runtime import Engine

    eng = Engine(args.export_dir, device=args.device)
    print(f"{'function':<12} {'ms/call':>8} {'in call':>8}")
    for bs in eng.config.decode_batch_sizes:
        tokens = np.full((bs, 1), 5, np.int64)
        start = np.arange(bs, dtype=np.int64) + 20
        lengths = np.ones(bs, np.int64)
        slots = np.arange(bs, dtype=np.int64)
        for _ in range(2):  # the first pass warms up
            in_call = 0.0
            t0 = time.perf_counter()
            for _ in range(args.calls):
                a = time.perf_counter()
                _, argmax = eng.invoke(f"decode_bs{bs}", tokens, start, lengths, slots)
                in_call += time.perf_counter() - a
                np.asarray(argmax.to_host())
            total = time.perf_counter() - t0
        print(f"decode_bs{bs:<3} {1e3 * total / args.calls:>8.2f} {1e3 * in_call / args.calls:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
