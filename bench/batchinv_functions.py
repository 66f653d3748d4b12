"""Do an export's compiled batch-size functions agree bit for bit? (issue 13 item 1)

    python bench/batchinv_functions.py OUT [--device local-task] [--prompts 21,30,17,40] [--steps 6]

For every prompt (random ids, seed 0) and every exported prefill batch size N: the prompt alone in
row 0 of prefill_bs{N} (other rows: padding) and, when N > 1, together with the other prompts;
row 0's logits at its last token compared with prefill_bs1 (the smallest size). Then decode: the
rows prefilled alone, `--steps` greedy steps through every decode_bs{N}, row 0 compared with the
smallest decode size. Prints the largest |difference| per case (0 = bitwise equal). This is the
measurement behind docs/batch-invariance.md; the Engine's batch-invariant mode relies on the decode
rows being 0 and avoids the prefill ones.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def _prefill(eng, bs: int, prompts: list[list[int]]) -> tuple[np.ndarray, list[int]]:
    """prompts[k] into slot k through prefill_bs{bs}, chunked; row 0's last logits, every row's argmax."""
    cfg = eng.config
    eng.state = [eng.module.zeros(s) for s in cfg.state]
    step = cfg.prefill_max_tokens
    last, argmax = None, [0] * len(prompts)
    for s in range(0, max(len(p) for p in prompts), step):
        pieces = [p[s:s + step] for p in prompts]
        T = max(max(len(p) for p in pieces), cfg.prefill_min_tokens)
        lg, am = eng._call_rows(f"prefill_bs{bs}", bs, np.arange(bs), pieces, [s] * len(pieces), T)
        am = np.asarray(am.to_host()).reshape(-1)
        for k, p in enumerate(prompts):
            if s < len(p) <= s + step:
                argmax[k] = int(am[k])
                if k == 0:
                    last = np.array(lg.to_host()[0], copy=True)  # the host view is reused by the next call
    return last, argmax


def random_prompts(lengths: str, vocab: int) -> list[list[int]]:
    """Random ids (seed 0) for comma-separated prompt lengths: the prompts every batch-invariance check uses."""
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, vocab, int(n))] for n in lengths.split(",")]


def prefill_alone(eng, rows: list[list[int]]) -> tuple[list[int], list[int]]:
    """Fresh state; rows[k] prefilled alone into slot k through the smallest prefill function, chunked.
    Returns each row's greedy next token and its position (the inputs of the first decode step)."""
    from dsv4.runtime.batching import pad_rows

    cfg = eng.config
    pbs = cfg.prefill_batch_sizes[0]
    eng.state = [eng.module.zeros(s) for s in cfg.state]
    toks, pos = [], []
    for k, q in enumerate(rows):
        for s in range(0, len(q), cfg.prefill_max_tokens):
            piece = q[s:s + cfg.prefill_max_tokens]
            _, am = eng._call_rows(f"prefill_bs{pbs}", pbs, np.array(pad_rows([k], pbs, cfg.n_slots)), [piece], [s],
                                   max(len(piece), cfg.prefill_min_tokens))
        toks.append(int(np.asarray(am.to_host()).reshape(-1)[0]))
        pos.append(len(q))
    return toks, pos


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export_dir")
    ap.add_argument("--device", default="local-task")
    ap.add_argument("--prompts", default="21,30,17,40", help="prompt lengths (default 21,30,17,40)")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)

    from dsv4.runtime.engine import Engine

    eng = Engine(args.export_dir, device=args.device)
    cfg = eng.config
    prompts = random_prompts(args.prompts, cfg.vocab_size)
    pbs, dbs = cfg.prefill_batch_sizes, cfg.decode_batch_sizes
    print(f"export {args.export_dir}: prefill batch sizes {list(pbs)}, decode {list(dbs)}, "
          f"device {args.device}; max |logit difference| of the same row, 0 = bitwise")
    print("prefill (vs prefill_bs%d alone):" % pbs[0])
    for i, p in enumerate(prompts):
        others = prompts[:i] + prompts[i + 1:]
        ref, _ = _prefill(eng, pbs[0], [p])
        cells = []
        for bs in pbs[1:]:
            alone, _ = _prefill(eng, bs, [p])
            cells.append(f"bs{bs} alone {np.abs(alone - ref).max():.3g}")
            if bs > 1 and others:
                mixed, _ = _prefill(eng, bs, [p] + others[:bs - 1])
                cells.append(f"bs{bs} with {min(bs - 1, len(others))} others {np.abs(mixed - ref).max():.3g}")
        print(f"  prompt {len(p):4d} tokens: " + ", ".join(cells))
    print("decode (rows prefilled by prefill_bs%d, vs decode_bs%d):" % (pbs[0], dbs[0]))
    for i, p in enumerate(prompts):
        runs = {}
        for bs in dbs:
            rows = [p] + (prompts[:i] + prompts[i + 1:])[:bs - 1]
            toks, pos = prefill_alone(eng, rows)
            out = []
            for _ in range(args.steps):
                lg, am = eng._call_rows(f"decode_bs{bs}", bs, np.arange(bs), [[t] for t in toks], pos, 1)
                out.append(np.array(lg.to_host()[0], copy=True))
                toks = [int(t) for t in np.asarray(am.to_host()).reshape(-1)[:len(rows)]]
                pos = [q + 1 for q in pos]
            runs[bs] = (len(rows) - 1, out)
        ref = runs[dbs[0]][1]
        cells = [f"bs{bs} with {n} others {max(np.abs(a - b).max() for a, b in zip(ref, o)):.3g}"
                 for bs, (n, o) in runs.items() if bs != dbs[0]]
        print(f"  prompt {len(p):4d} tokens, {args.steps} steps: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
