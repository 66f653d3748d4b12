"""MTP speculation against plain greedy decode through the Engine (issue 45's tokens/s figures).

    python -m dsv4.bench.speculative_speed OUT [--device cuda] [--batch 1,8] [--new-tokens 48] [--repeats 2]

OUT is an export with speculative entry points (`dsv4 export ... --draft-tokens K`). For each batch
size B, B greedy requests (bos and `--prompt-tokens` tokens of a held-out text, windows `--stride`
tokens apart; default the embedded default's eval.txt; random ids for an export without a tokenizer) run `--new-tokens` tokens with
`ignore_eos`, plain then speculative, `--repeats` times alternating. Printed per batch size and
mode: whether every row's tokens equal plain greedy's, drafts accepted / checked, decode (or verify)
calls of the slowest row, end-to-end tokens/s (all rows' new tokens over the wall time of
generate_batch) and decode tokens/s (new tokens after the first over the time after the first
token), each the median over the repeats. Torch-free.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "model" / "assets" / "small" / "eval.txt"


def held_out_prompts(eng, text: Path, batch: int, prompt_tokens: int, stride: int) -> list[list[int]]:
    """``batch`` windows of ``prompt_tokens`` tokens of ``text``, ``stride`` tokens apart, each after bos;
    an export without a tokenizer gets seeded random ids instead (acceptance then means little)."""
    if eng.text is None:
        import numpy as np

        g = np.random.default_rng(0)
        return [g.integers(3, eng.config.vocab_size, prompt_tokens + 1).tolist() for _ in range(batch)]
    ids = eng.encode(text.read_text(), add_bos=False)
    need = (batch - 1) * stride + prompt_tokens
    if len(ids) < need:
        raise SystemExit(f"{text} has {len(ids)} tokens; batch {batch} x stride {stride} needs {need}")
    bos = eng.encode("", add_bos=True)
    return [bos + ids[i * stride:i * stride + prompt_tokens] for i in range(batch)]


def run_once(eng, prompts: list[list[int]], new_tokens: int, speculative: bool) -> dict:
    from dsv4.runtime import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, speculative=speculative)
    t0 = time.perf_counter()
    res = eng.generate_batch(prompts, params, add_bos=False)
    wall = time.perf_counter() - t0
    n_new = sum(len(r.tokens) for r in res)
    first = max(r.ttft_s for r in res)
    drafted = sum(r.drafted or 0 for r in res)
    return {"tokens": [r.tokens for r in res], "wall_s": wall,
            "tokens_per_s": n_new / wall,
            "decode_tokens_per_s": (n_new - len(res)) / max(wall - first, 1e-9),
            "calls": max(r.decode_calls for r in res),
            "drafted": drafted, "accepted": sum(r.accepted or 0 for r in res)}


def measure(eng, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(repeats):
        for spec in (False, True):
            runs[spec].append(run_once(eng, prompts, new_tokens, spec))
    plain_tokens = runs[False][0]["tokens"]
    out = {}
    for spec, rs in runs.items():
        out["speculative" if spec else "plain"] = {
            "same_as_plain_greedy": all(r["tokens"] == plain_tokens for r in rs),
            "calls": rs[0]["calls"], "drafted": rs[0]["drafted"], "accepted": rs[0]["accepted"],
            "acceptance_rate": rs[0]["accepted"] / rs[0]["drafted"] if rs[0]["drafted"] else None,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in rs),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv4.bench.speculative_speed", description=__doc__.split("\n")[0])
    p.add_argument("export_dir")
    p.add_argument("--device", default="local-task", help="IREE driver: local-task, cuda, hip")
    p.add_argument("--batch", default="1,8", help="batch sizes, comma-separated (default 1,8)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--stride", type=int, default=400, help="tokens between the rows' prompt windows")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="held-out text the prompts come from")
    p.add_argument("--pack-calls", action="store_true",
                   help="Engine(batch_invariant=False): rows share verify calls (default: one request per verify call)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)

    from dsv4.runtime import Engine

    eng = Engine(a.export_dir, device=a.device, batch_invariant=not a.pack_calls)
    if eng.draft_tokens is None:
        raise SystemExit(f"{a.export_dir} has no speculative entry points: export it with --draft-tokens K")
    report = {"export": a.export_dir, "device": a.device, "draft_tokens": eng.draft_tokens,
              "pack_calls": a.pack_calls, "batches": {}}
    for b in (int(x) for x in a.batch.split(",")):
        prompts = held_out_prompts(eng, a.text, b, a.prompt_tokens, a.stride)
        run_once(eng, prompts, 4, True)  # untimed: first calls of each function
        run_once(eng, prompts, 4, False)
        report["batches"][b] = measure(eng, prompts, a.new_tokens, a.repeats)
    if a.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{a.export_dir} on {a.device}, K = {eng.draft_tokens}, {a.new_tokens} new tokens per row, "
          f"median of {a.repeats}, {'packed verify calls' if a.pack_calls else 'one request per verify call'}")
    print(f"{'batch':>5} {'mode':<12} {'same':>5} {'accepted':>12} {'calls':>6} {'tok/s':>9} {'decode tok/s':>13}")
    for b, modes in report["batches"].items():
        for mode, m in modes.items():
            acc = f"{m['accepted']}/{m['drafted']}" if m["drafted"] else "-"
            print(f"{b:>5} {mode:<12} {str(m['same_as_plain_greedy']):>5} {acc:>12} {m['calls']:>6} "
                  f"{m['tokens_per_s']:>9.1f} {m['decode_tokens_per_s']:>13.1f}")
        s, pl = modes["speculative"], modes["plain"]
        print(f"{'':>5} speed-up {s['tokens_per_s'] / pl['tokens_per_s']:.2f}x end to end, "
              f"{s['decode_tokens_per_s'] / pl['decode_tokens_per_s']:.2f}x decode")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
