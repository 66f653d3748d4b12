"""Where do non-finite values appear? Prefill a random prompt, then greedy decode, on an export; after
every call print how many logits are not finite and which state tensors (and which layer groups of
them) hold NaN/inf.

    python bench/nonfinite_probe.py OUT [--device cuda] [--tokens 128] [--steps 3]
    python bench/nonfinite_probe.py OUT --requests 64 [--tokens 16] [--steps 3] [--seed 0]
    python bench/nonfinite_probe.py OUT --zero-state [--positions 1,16,200]

The second form runs N requests together through the Engine (each prefilled alone, then decoded
in one decode_bs{N} call per step) and prints the first non-finite row the engine refuses (its
EngineError names the function, row, slot and position) or that every step was finite. Session
14 found with it (by hand) that Flash --layers 4 on cuda returns an all-NaN last row from
decode_bs64 for some prompts (docs/real-size.md).

The third form needs no prompt: for every exported decode batch size N and each position, a fresh
(zero) state and one decode_bs{N} call with token 5 in every row; it prints the rows whose logits are
not all finite, and the finite rows whose logits differ from the first finite row. Identical rows must
give identical logits, so any such row is a fault of the build.
Session 15: decode_bs40's last row on cuda at every position from 1, decode_bs64's at some, none on
llvm-cpu (docs/real-size.md).

Session 11 found with it (Flash --layers 4, bf16, cuda): the prefill of 128 tokens is finite, the
first decode step (position 128) returns all-NaN logits while every state tensor stays finite, so
the NaN is made after the last state write of that step. Session 12 found that it follows IREE's default
stream partitioning; GPU targets now compile with `debug` partitioning (docs/real-size.md).
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=0, help="N requests through the Engine (the second form)")
    ap.add_argument("--zero-state", action="store_true", help="decode calls from a fresh state (the third form)")
    ap.add_argument("--positions", default="1,16,200", help="with --zero-state: the positions to decode at")
    a = ap.parse_args()
    if a.requests:
        return engine_requests(a)
    if a.zero_state:
        return zero_state(a)

    from bisect_modules import host_copy  # bench/, beside this script

    from dsv4.runtime import Engine

    eng = Engine(a.out, device=a.device)

    def values(x) -> np.ndarray:
        return host_copy(x).astype(np.float32)

    def report(what: str, logits) -> np.ndarray:
        lg = values(logits)
        bad = []
        for spec, x in zip(eng.config.state, eng.state):
            if "float" not in spec.dtype:
                continue
            v = values(x)
            n = int((~np.isfinite(v)).sum())
            if n:
                groups = sorted(set(np.argwhere(~np.isfinite(v))[:, 1].tolist()))
                bad.append(f"{spec.name}{list(v.shape)}: {n} in groups {groups}")
        print(f"{what}: {int((~np.isfinite(lg)).sum())} of {lg.size} logits not finite; "
              f"state: {'; '.join(bad) if bad else 'all finite'}", flush=True)
        return lg

    T = a.tokens
    ids = np.random.default_rng(a.seed).integers(2, eng.config.vocab_size, size=T).astype(np.int64)
    lg = report(f"prefill {T}", eng.invoke("prefill_bs1", ids[None], np.array([0]), np.array([T]), np.array([0]))[0])
    for step in range(a.steps):
        finite = np.where(np.isfinite(lg.reshape(-1)), lg.reshape(-1), -np.inf)
        tok = np.array([[int(np.argmax(finite))]], dtype=np.int64)
        pos = T + step
        lg = report(f"decode at position {pos}", eng.invoke("decode_bs1", tok, np.array([pos]), np.array([1]), np.array([0]))[0])


def engine_requests(a: argparse.Namespace) -> None:
    from dsv4.runtime import Engine, EngineError, SamplingParams

    eng = Engine(a.out, device=a.device)
    g = np.random.default_rng(a.seed)
    prompts = [g.integers(3, eng.config.vocab_size, a.tokens).tolist() for _ in range(a.requests)]
    for p in prompts:
        eng.submit(p, SamplingParams(max_new_tokens=a.steps + 1, ignore_eos=True))
    try:
        step = 0
        while eng.has_work:
            eng.step()
            step += 1
        print(f"{a.requests} requests of {a.tokens} tokens, {a.steps} decode steps: every row finite")
    except EngineError as e:
        print(f"{a.requests} requests of {a.tokens} tokens, engine step {step}: {e}")


def zero_state(a: argparse.Namespace) -> None:
    from dsv4.runtime import Engine

    eng = Engine(a.out, device=a.device)
    cfg = eng.config
    for n in cfg.decode_batch_sizes:
        bad, differ = {}, {}
        for p in (int(x) for x in a.positions.split(",")):
            eng.state = [eng.module.zeros(s) for s in cfg.state]
            logits, argmax = eng.invoke(f"decode_bs{n}", np.full((n, 1), 5, np.int64), np.full(n, p, np.int64),
                                        np.ones(n, np.int64), np.arange(n, dtype=np.int64) % cfg.n_slots)
            lg = np.array(logits.to_host(), np.float32, copy=True).reshape(n, -1)
            bad[p] = [k for k in range(n) if not np.isfinite(lg[k]).all()]
            # identical rows in one call must give identical bits: a finite row that differs from
            # the first finite one is a silent fault of the same kind
            ref = next((k for k in range(n) if k not in bad[p]), None)
            if ref is not None:
                diff = {k: float(np.abs(lg[k] - lg[ref]).max()) for k in range(n) if k not in bad[p]}
                odd = {k: d for k, d in diff.items() if d > 0}
                if odd:
                    differ[p] = odd
        print(f"decode_bs{n}, zero state, token 5 in every row: non-finite rows per position {bad}; "
              f"finite rows that differ from the first finite row (max abs diff): {differ or 'none'}", flush=True)


if __name__ == "__main__":
    main()
