"""The cost of batch-invariant prefill (issue 13 item 1): Engine(batch_invariant=True) vs False.

    python bench/batchinv_cost.py OUT [--device local-task] [--requests 4] [--prompt 60] [--new 32]
                                      [--repeats 3]

Batch-invariant mode prefills every request alone through the smallest exported prefill batch size
(prefill_bs1); the other mode prefills the requests admitted together in one padded prefill_bs{N}
call. Decode is the same in both. Measured through the Engine's own step loop, greedy, fixed token
ids (no tokenizer needed), each number the best of --repeats runs after one warm-up run, the two modes interleaved:

* prefill step: the first ``step()`` after submitting R requests (prefill of all R prompts, chunked
  by the export's max tokens, and their first tokens), ms;
* decode step: the mean of the later ``step()`` calls (one decode of all R rows), ms;
* end to end: ``generate_batch`` of R requests, generated tokens per second.
Also checks that both modes give the same greedy tokens per request (they may not when the compiled
functions round differently: that is what the mode is for) and says whether they did.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, vocab, length - 5 * k)] for k in range(n)]  # unequal lengths


def _run(engine, prompts: list[list[int]], new: int) -> tuple[float, float, float, list[list[int]]]:
    """(prefill step ms, mean decode step ms, generated tokens/s, tokens per request) of one run."""
    from dsv4.runtime.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    t_start = time.perf_counter()
    ids = [engine.submit(p, params, add_bos=False) for p in prompts]
    t0 = time.perf_counter()
    engine.step()
    prefill_ms = 1e3 * (time.perf_counter() - t0)
    steps, t0 = 0, time.perf_counter()
    while engine.has_work:
        engine.step()
        steps += 1
    decode_ms = 1e3 * (time.perf_counter() - t0) / max(steps, 1)
    results = [engine.result(i) for i in ids]
    total = time.perf_counter() - t_start
    return prefill_ms, decode_ms, sum(len(r.tokens) for r in results) / total, [r.tokens for r in results]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export_dir")
    ap.add_argument("--device", default="local-task")
    ap.add_argument("--requests", type=int, default=4, help="requests submitted together (default 4)")
    ap.add_argument("--prompt", type=int, default=60, help="tokens of the longest prompt (default 60)")
    ap.add_argument("--new", type=int, default=32, help="tokens generated per request (default 32)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    from dsv4.runtime.engine import Engine

    engines = {inv: Engine(args.export_dir, device=args.device, batch_invariant=inv) for inv in (False, True)}
    eng = engines[True]
    prompts = _prompts(args.requests, args.prompt, eng.config.vocab_size)
    runs: dict[bool, list] = {False: [], True: []}
    for e in engines.values():
        _run(e, prompts, args.new)  # warm-up
    for _ in range(args.repeats):  # the modes interleaved, so load changes hit both alike
        for inv, e in engines.items():
            runs[inv].append(_run(e, prompts, args.new))
    rows, tokens = [], {}
    for inv, rs in runs.items():
        tokens[inv] = rs[0][3]
        rows.append((inv, min(r[0] for r in rs), min(r[1] for r in rs), max(r[2] for r in rs),
                     engines[inv].stats["prefill_calls"] // (args.repeats + 1)))
    cfg = eng.config
    print(f"export {args.export_dir}: prefill batch sizes {list(cfg.prefill_batch_sizes)}, decode "
          f"{list(cfg.decode_batch_sizes)}, max tokens {cfg.prefill_max_tokens}; device {args.device}")
    print(f"{args.requests} requests, prompts {[len(p) for p in prompts]} tokens, {args.new} new tokens each, "
          f"best of {args.repeats}")
    print(f"{'batch_invariant':>15} {'prefill calls':>13} {'prefill step ms':>15} {'decode step ms':>14} "
          f"{'gen tok/s':>9}")
    for inv, pf, dc, tps, calls in rows:
        print(f"{str(inv):>15} {calls:>13} {pf:>15.2f} {dc:>14.2f} {tps:>9.1f}")
    base, new = rows[0], rows[1]
    print(f"cost of batch invariance: prefill step {100 * (new[1] / base[1] - 1):+.1f} %, "
          f"decode step {100 * (new[2] / base[2] - 1):+.1f} %, end to end {100 * (base[3] / new[3] - 1):+.1f} %")
    same = sum(a == b for a, b in zip(tokens[False], tokens[True]))
    print(f"greedy tokens equal in both modes for {same}/{len(prompts)} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
