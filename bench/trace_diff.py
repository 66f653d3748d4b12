"""Which dispatch first gives a request other bits in decode_bs{B} than in decode_bs{A}? (issue 13)

    python bench/trace_diff.py OUT --device cuda [--a 1] [--b 16] [--prompts 21,30,17,40] [--steps 8]

OUT's vmfb must be compiled with `--iree-flow-trace-dispatch-tensors` (recompile an export's kept
model.mlir with its config.json flags plus that one). The prompts are prefilled alone through
prefill_bs1, as bench/batchinv_functions.py does; the first prompt is row 0, the others fill the next
rows of the larger function. Both functions then decode greedily; every dispatch's inputs and outputs
reach a HAL debug sink (no text dump). Per step, each of B's dispatch arrays is matched to A's by row 0:
it has a twin when its row 0 (along an axis of size B or 16, its leading size/B elements, or the whole
array) has the same bytes as the like view of some array in A's trace. Printed: the first step whose logits differ, then per step up to it the first dispatches of B
with an unmatched output, marked INPUTS MATCH when every input had a twin (that dispatch changed the
bits, or the two functions fused the same math differently: docs/batch-invariance.md, session 9).
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np


class Recorder:
    """The HAL debug sink's callback: (dispatch, 'inputs'|'outputs', [convert(array)]) while on.
    `convert` takes each traced buffer as a device array; the default copies it to the host."""

    def __init__(self, convert=None):
        self.on, self.records, self.device = False, [], None
        self.convert = convert or (lambda arr: np.array(arr.to_host()))

    def __call__(self, key: str, views) -> None:
        if not self.on:
            return
        import iree.runtime as rt

        name, _, kind = key.rpartition(" ")
        self.records.append((name or key, kind, [self.convert(rt.DeviceArray(self.device, v, implicit_host_transfer=True))
                                                 for v in views]))

    def install(self) -> None:
        """Every HAL module created from now on (in this process) traces into this recorder."""
        import iree.runtime as rt

        plain = rt.create_hal_module
        rt.create_hal_module = lambda inst, device=None, **kw: plain(inst, device, debug_sink=rt.HalModuleDebugSink(self),
                                                                     **kw)


def _float(a: np.ndarray) -> np.ndarray:
    """float64 view of a traced array (bf16 arrives as 2-byte void: its bits are a float32's top half)."""
    if a.dtype.kind == "V" and a.dtype.itemsize == 2:
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def _row0s(a: np.ndarray, rows: int) -> list[np.ndarray]:
    """`a` as a whole, its row 0 along every axis of size `rows` (or 16: the row tile of
    --batch-invariant's padded GEMMs), and its first size/rows elements (a batch flattened into a
    larger leading dim)."""
    out = [a]
    for ax, n in enumerate(a.shape):
        if n == rows or n == 16:
            out.append(np.take(a, 0, axis=ax))
    for r in {rows, 16}:
        if a.size % r == 0 and a.size > r:
            out.append(a.reshape(-1)[:a.size // r])
    return out


def _key(x: np.ndarray) -> bytes:
    x = np.ascontiguousarray(x)
    return hashlib.sha1(x.dtype.str.encode() + x.tobytes()).digest()


def compare(rec_a: list, rec_b: list, bs_a: int, bs_b: int, limit: int = 8) -> list[str]:
    """The first `limit` B dispatches whose inputs all have a twin in A's trace and whose outputs do not."""
    seen_a: set[bytes] = set()
    by_size: dict[tuple, list[np.ndarray]] = {}
    for _, _, arrays in rec_a:
        for a in arrays:
            for r in _row0s(a, bs_a):
                seen_a.add(_key(r))
                by_size.setdefault((r.dtype.str, r.size), []).append(r)
    lines, pending = [], None
    for name, kind, arrays in rec_b:
        matched = [any(_key(r) in seen_a for r in _row0s(a, bs_b)) for a in arrays]
        if kind == "inputs":
            pending = (name, all(matched))
            continue
        if all(matched):
            continue
        inputs_ok = pending is not None and pending[0] == name and pending[1]
        diffs = []
        for a, ok in zip(arrays, matched):
            if ok:
                continue
            best = None
            for r in _row0s(a, bs_b)[1:] or [a]:
                for c in by_size.get((r.dtype.str, r.size), []):
                    d = float(np.max(np.abs(_float(r).reshape(-1) - _float(c).reshape(-1)))) if r.size else 0.0
                    best = d if best is None else min(best, d)
            diffs.append(f"{a.dtype}{list(a.shape)} nearest A diff {best if best is not None else 'no same-size array'}")
        lines.append(f"{'INPUTS MATCH ' if inputs_ok else 'inputs differ'} {name}: " + "; ".join(diffs))
        if inputs_ok and len([ln for ln in lines if ln.startswith("INPUTS MATCH")]) >= limit:
            break
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export_dir")
    ap.add_argument("--device", default="local-task")
    ap.add_argument("--a", type=int, default=1, help="reference decode batch size (default 1)")
    ap.add_argument("--b", type=int, default=16, help="decode batch size to explain (default 16)")
    ap.add_argument("--prompts", default="21,30,17,40")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--trace-step", type=int, default=None,
                    help="compare the dispatches up to this step even when the logits agree (checks the matching)")
    args = ap.parse_args(argv)

    import iree.runtime as rt

    rec = Recorder()
    rec.install()
    from batchinv_functions import prefill_alone, random_prompts  # bench/, beside this script
    from dsv4.runtime.engine import Engine

    eng = Engine(args.export_dir, device=args.device)
    rec.device = eng.module.device
    prompts = random_prompts(args.prompts, eng.config.vocab_size)

    def run(bs: int, trace_step: int | None) -> tuple[list[np.ndarray], list]:
        rows = prompts[:bs]
        toks, pos = prefill_alone(eng, rows)
        out, records = [], []
        for step in range(args.steps):
            rec.on, rec.records = step == trace_step, []
            lg, am = eng._call_rows(f"decode_bs{bs}", bs, np.arange(bs), [[t] for t in toks], pos, 1)
            rec.on = False
            if step == trace_step:
                records = rec.records
            out.append(np.array(lg.to_host()[0], copy=True))
            toks = [int(t) for t in np.asarray(am.to_host()).reshape(-1)[:len(rows)]]
            pos = [p + 1 for p in pos]
        return out, records

    la, _ = run(args.a, None)
    lb, _ = run(args.b, None)
    diffs = [float(np.abs(x - y).max()) for x, y in zip(la, lb)]
    print(f"row 0 max |logit difference| per step, decode_bs{args.b} vs decode_bs{args.a}: "
          + " ".join(f"{d:.3g}" for d in diffs))
    first = next((i for i, d in enumerate(diffs) if d > 0), args.trace_step)
    if first is None:
        print("bitwise equal at every step")
        return 0
    for step in range(first + 1):  # a state write of an earlier step may already differ
        _, ra = run(args.a, step)
        _, rb = run(args.b, step)
        lines = compare(ra, rb, args.a, args.b)
        print(f"step {step}: {len(ra)} / {len(rb)} trace records; first unmatched dispatches of decode_bs{args.b}:")
        for ln in lines[:20]:
            print("   ", ln)
    return 0


if __name__ == "__main__":
    sys.exit(main())
