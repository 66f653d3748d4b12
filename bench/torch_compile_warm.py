"""Fill torch.compile's on-disk caches for the graphs `dsv4 bench --compare torch-compile` will compile.

    TORCHINDUCTOR_CACHE_DIR=DIR python -m dsv4.bench.torch_compile_warm OUT --device cuda --prefill 128 \
        prefill:1 decode:1          # one process per group of shapes, several at once

At Flash dimensions torch.compile takes 110-130 s per static shape and a bench has six (prefill at
batch 1 and 8, decode at 1/8/32/64): longer than one 10-minute device call. Inductor keys its
caches (FX graph, AOTAutograd, Triton kernels, all under TORCHINDUCTOR_CACHE_DIR) by the graph and
its input shapes, not by the process, so several processes, each compiling some shapes, fill one
directory that a later `dsv4 bench` reads: it then pays only Dynamo's tracing per shape. The calls
here are the bench's own (dsv4.bench.torch_backends.TorchBackend, the plan of dsv4.bench.speed) with the
same token/position/slot shapes and state, so the graphs are the bench's.

Prints, per shape, the seconds the first call took and, at the end, Inductor's cache hit/miss
counters (a second run on a warm directory shows hits and seconds instead of minutes).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4.bench.torch_compile_warm", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="export directory")
    ap.add_argument("shapes", nargs="+", help="prefill:B (B rows of the bench's prefill chunk) or decode:B")
    ap.add_argument("--device", default="cuda", help="IREE driver name the bench gets (its torch device is used)")
    ap.add_argument("--prefill", type=int, default=2048, help="the bench's --prefill (fixes the chunk T)")
    args = ap.parse_args(argv)

    from torch._dynamo.utils import counters

    from dsv4.bench.torch_backends import TorchBackend
    from dsv4.contract.artifact import ExportConfig
    from dsv4.bench.speed import build_parser, make_plan

    cfg = ExportConfig.load(args.out)
    plan = make_plan(build_parser().parse_args([args.out, "--prefill", str(args.prefill), "--context",
                                                str(cfg.max_seq_len)]), cfg)
    todo = []
    for s in args.shapes:
        kind, _, b = s.partition(":")
        if kind not in ("prefill", "decode") or not b.isdigit():
            ap.error(f"bad shape {s!r}: expected prefill:B or decode:B")
        todo.append((kind, int(b)))
    t0 = time.perf_counter()
    be = TorchBackend(args.out, "torch-compile", args.device, cfg.n_slots)
    print(f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    for kind, b in todo:
        slots = np.arange(b, dtype=np.int64)
        start = np.zeros(b, np.int64)
        t0 = time.perf_counter()
        if kind == "prefill":
            be.prefill(np.zeros((b, plan.chunk), np.int64), start, np.full(b, plan.chunk, np.int64), slots)
        else:
            be.decode(np.zeros((b, 1), np.int64), start, slots)
        print(f"{kind}:{b} (T={plan.chunk if kind == 'prefill' else 1}) first call {time.perf_counter() - t0:.1f} s",
              flush=True)
    hits = {k: v for k, v in counters["inductor"].items() if "cache" in k}
    hits.update({f"aot_{k}": v for k, v in counters["aot_autograd"].items() if "cache" in k})
    print(f"cache counters: {hits}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
