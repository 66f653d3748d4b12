"""Which dispatch first makes a NaN? Prefill a random prompt through an export, then trace every
dispatch of the next decode step (decode_bs1) and print the first dispatches whose outputs hold NaN,
with whether their inputs were NaN-free (infinities are not counted: masked scores are -inf).

    python bench/nan_dispatch.py OUT [--device cuda] [--tokens 128] [--max-mb 256]

OUT's vmfb must be compiled with `--iree-flow-trace-dispatch-tensors` (recompile the export's kept
model.mlir with its config.json flags plus that one; tracing changes the schedule, so check that the
traced build still shows the problem: the last line counts its NaN logits). Arrays over
--max-mb are not copied to the host and count as unknown (Flash's expert stacks are 1 GB inputs).
A `slow_memcpy` dispatch's traced output can hold NaN its traced inputs lack. The tiny preset on
llvm-cpu shows it (decode_bs1 at position 20). Under local-task, several such copies with [1, 1, 4, 128]
outputs show 1 to 4 NaN each (5 or 6 copies per run, changing from run to run, with either partitioning). Under local-sync
none do, and every state tensor and logit stays finite. So those lines show when the trace read the
buffer, not what the model computed.
Written for the Flash-4 cuda decode NaN of session 12 (docs/real-size.md).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-mb", type=float, default=256.0)
    ap.add_argument("--show", type=int, default=8, help="how many dispatches with NaN outputs to print")
    args = ap.parse_args(argv)

    from bisect_modules import host_copy  # bench/, beside this script
    from trace_diff import Recorder, _float

    def nan_count(arr) -> tuple[int | None, str]:
        """(NaN count, or None when over --max-mb and not copied; dtype[shape]) of a traced buffer."""
        what = f"{np.dtype(arr.dtype)}{list(arr.shape)}"
        if int(np.prod(arr.shape)) * np.dtype(arr.dtype).itemsize > args.max_mb * 2**20:
            return None, what
        a = np.array(arr.to_host())
        return (int(np.isnan(_float(a)).sum()) if a.dtype.kind in "fV" else 0), what

    rec = Recorder(nan_count)  # records: (dispatch, 'inputs'|'outputs', [nan_count of each buffer])
    rec.install()
    from dsv4.runtime.engine import Engine

    eng = Engine(args.out, device=args.device)
    rec.device = eng.module.device
    T = args.tokens
    ids = np.random.default_rng(args.seed).integers(2, eng.config.vocab_size, size=T).astype(np.int64)
    logits = eng.invoke("prefill_bs1", ids[None], np.array([0]), np.array([T]), np.array([0]))[0]
    tok = int(np.nanargmax(host_copy(logits).astype(np.float32).reshape(-1)))
    rec.on = True
    logits = eng.invoke("decode_bs1", np.array([[tok]]), np.array([T]), np.array([1]), np.array([0]))[0]
    rec.on = False
    lg = host_copy(logits).astype(np.float32)

    shown, inputs = 0, {}
    for i, (name, kind, counts) in enumerate(rec.records):
        if kind == "inputs":
            inputs[name] = counts
            continue
        if not any(c for c, _ in counts if c):
            continue
        ins = inputs.get(name, [])
        fin = "inputs NaN-free" if ins and all(c == 0 for c, _ in ins) else "inputs " + ", ".join(
            f"{w}: {c if c is not None else 'not copied'}" for c, w in ins)
        note = "  (a copy: see the docstring)" if name.endswith("slow_memcpy") else ""
        print(f"record {i}: {name}: outputs " + ", ".join(f"{w}: {c} NaN" for c, w in counts) + f"; {fin}{note}")
        shown += 1
        if shown >= args.show:
            break
    print(f"{len(rec.records)} trace records in the decode step at position {T}; "
          f"{int(np.isnan(lg).sum())} of {lg.size} logits NaN")
    return 0


if __name__ == "__main__":
    sys.exit(main())
