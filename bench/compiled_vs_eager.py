"""Compiled export vs the eager PyTorch model on the same weights (the export's own .irpa).

    python -m dsv4.bench.compiled_vs_eager OUT [--device cuda] [--eager-device cuda] [--eager-device2 cpu]
                                      [--reference-dtype float32] [--prompt-len 100] [--steps 32]

Prefills one random prompt of --prompt-len tokens (one prefill_bs1 call per chunk of at most the
export's max_tokens), then decodes greedily --steps tokens, both sides fed the compiled side's
tokens (teacher forcing, so one early flip does not hide later agreement). Prints, per step, the
max |logit difference| relative to the logits' max |value| and whether the argmax agrees, then one
summary line: first-step (prefill) relative error, worst relative error and argmax agreement (all
steps agreeing = the eager model's own greedy run equals the compiled one). A step whose argmax
differs also shows eager's margin (its top logit minus its logit of the compiled side's token) beside
the step's max |logit difference|; a margin below it is a near tie, which the error alone explains
(counted as flips_at_near_ties).
Two scales to judge the error by: the eager model's own two-chunk sensitivity (the prompt prefilled
in two pieces) and, with --eager-device2, the difference between eager on two devices (prefill
logits): two correct implementations that round differently. In bf16 with the reference's FP8
activation quantization, one rounding difference in an activation can move an e4m3 code by a
step (1/8 relative), so implementation noise is far above bf16's own 2^-8 (docs/numerics.md).
With --reference-dtype float32 a third side, the eager model on the same weights with float32
activations, is the yardstick for both bf16 sides: per step, whether each one's argmax equals it.
The eager side maps the weights (model.checkpoint.load_irpa(mapped=True)), so it needs torch but
no copy of the weights on the CPU. Where the export traced a torch alternative of a hot spot
(config.json's targets.<target>.kernels, e.g. `--kernel '*=weight_only'`: the quantized linears
without activation quantization), eager runs the same alternative, so both sides compute one
function; `moe_experts` follows --eager-moe instead. Exit status 1 when greedy differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


class Eager:
    """The eager Transformer of an export on one torch device, with its own decode state. The weights
    are the export's .irpa files, memory-mapped (load_irpa(mapped=True)): nothing is copied on the
    CPU, and a GPU device gets one copy."""

    def __init__(self, eng, device: str, moe: str = "reference", dtype: str | None = None):
        import torch

        from dsv4.model.checkpoint import load_irpa
        from dsv4.model.config import ModelConfig
        from dsv4.model.kernels import KERNELS
        from dsv4.model.model import empty_model

        c = eng.config
        self.torch, self.device, self.n_slots = torch, device, c.n_slots
        chosen = c.raw["targets"][eng.target].get("kernels", {})
        self.alternatives = {op: KERNELS[op].alternatives[impl] for op, impl in chosen.items()
                             if op != "moe_experts" and impl in KERNELS[op].alternatives}
        if moe == "routed":
            self.alternatives["moe_experts"] = KERNELS["moe_experts"].alternatives["routed"]
        self.cfg = ModelConfig.from_dict(c.model)
        self.act = {"bfloat16": torch.bfloat16, "float32": torch.float32}[c.raw["activation_dtype"]]
        quantized = any(dt.startswith("float8") for _, _, dt in c.raw["weights"]["tensors"])
        model = empty_model(self.cfg, self.act, quantized=quantized)
        load_irpa(model, eng.parameters_paths, mapped=True)
        wide = getattr(torch, dtype) if dtype else self.act
        if wide != self.act:  # the same weights at a wider activation dtype: bf16 tensors widened
            src = model.state_dict()  # exactly, FP8 / MXFP4 codes and scales as they are
            model = empty_model(self.cfg, wide, quantized=quantized)
            for name, t in model.state_dict(keep_vars=True).items():
                t.data = src[name].to(t.dtype)
            self.act = wide
        self.model = model.to(device).eval()
        self.reset()

    def reset(self) -> None:
        from dsv4.model.state import new_state

        self.state = new_state(self.cfg, self.n_slots, self.act, device=self.device)

    def __call__(self, tokens: np.ndarray, pos: int) -> np.ndarray:
        torch = self.torch
        t = torch.from_numpy(tokens[None]).to(self.device)
        z = torch.zeros(1, dtype=torch.int64, device=self.device)
        from dsv4.model.kernels import overrides

        with torch.no_grad(), overrides(self.alternatives):
            out = self.model(t, z + pos, z + len(tokens), z, self.state)
        return out[0].float().cpu().numpy()


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| relative to max |b|."""
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4.bench.compiled_vs_eager",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="export directory")
    ap.add_argument("--device", default="local-task", help="IREE driver (local-task, cuda, hip)")
    ap.add_argument("--eager-device", default="cpu", help="torch device of the eager model")
    ap.add_argument("--eager-device2", metavar="DEV",
                    help="also prefill with a second eager model on DEV (e.g. cpu next to cuda): the "
                         "difference between two correct implementations, the scale compiled vs eager "
                         "is judged against")
    ap.add_argument("--eager-moe", choices=("reference", "routed"), default="reference",
                    help="eager MoE: the all-experts reference (default) or the routed torch code "
                         "(tests/test_moe_routed.py: equal up to fp32 summation order; 40x less work "
                         "for Flash's 256 experts, for eager on a CPU)")
    ap.add_argument("--reference-dtype", choices=("float32",),
                    help="also run the eager model at this activation dtype (same weights) as the "
                         "reference both bf16 sides are scored against: how often each one's argmax "
                         "differs from it says whether a compiled-vs-eager flip is the compiler's or bf16's")
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args(argv)

    from dsv4.runtime import Engine

    eng = Engine(args.out, device=args.device)
    cfg_json = eng.config
    vocab = cfg_json.vocab_size
    ids = np.random.default_rng(args.seed).integers(2, vocab, size=args.prompt_len).astype(np.int64)

    t0 = time.perf_counter()
    eager = Eager(eng, args.eager_device, args.eager_moe)
    cfg = eager.cfg
    print(f"eager model loaded from {len(eng.parameters_paths)} weight file(s) in {time.perf_counter() - t0:.1f} s "
          f"({cfg.n_layers} layers, hidden {cfg.hidden_size}) on {args.eager_device}", file=sys.stderr)

    seconds: dict[str, list[float]] = {"prefill_bs1": [], "decode_bs1": []}

    def compiled(fn: str, tokens: np.ndarray, pos: int) -> np.ndarray:
        t = time.perf_counter()
        lg, _ = eng.invoke(fn, tokens[None], np.array([pos]), np.array([len(tokens)]), np.array([0]))
        out = np.array(lg.to_host())[0].astype(np.float32)  # copy: to_host reuses its buffer
        seconds[fn].append(time.perf_counter() - t)
        return out

    def chunks() -> list[tuple[np.ndarray, int]]:
        """The prompt in prefill_bs1-sized pieces (the last piece's logits are the prompt's)."""
        out, pos, chunk = [], 0, cfg_json.prefill_max_tokens
        while pos < len(ids):
            piece = ids[pos:pos + chunk]
            if len(piece) < cfg_json.prefill_min_tokens:  # the exported T range starts at min_tokens
                raise SystemExit(f"prompt tail of {len(ids) - pos} tokens is below the export's min_tokens "
                                 f"{cfg_json.prefill_min_tokens}; pick another --prompt-len")
            out.append((piece, pos))
            pos += len(piece)
        return out

    ref = Eager(eng, args.eager_device, args.eager_moe, args.reference_dtype) if args.reference_dtype else None
    run_ref = ref if ref is not None else (lambda tokens, pos: None)
    rows = []
    for piece, pos in chunks():
        lc, le, lr = compiled("prefill_bs1", piece, pos), eager(piece, pos), run_ref(piece, pos)
    pos = len(ids)
    eager_prefill = le
    for step in range(args.steps + 1):
        rel = rel_err(lc, le)
        tc, te = int(lc.argmax()), int(le.argmax())
        # a flip is a near tie when eager itself prefers its token by less than the step's error
        margin = float(le.reshape(-1)[te] - le.reshape(-1)[tc])
        err = float(np.abs(lc.astype(np.float64) - le).max())
        rows.append({"step": step, "rel_err": rel, "compiled": tc, "eager": te, "agree": tc == te,
                     "eager_margin": margin, "max_abs_err": err})
        note = "ok" if tc == te else f"DIFF (eager margin {margin:.3g} {'<' if margin < err else '>='} max |diff| {err:.3g})"
        if lr is not None:
            tr = int(lr.argmax())
            rows[-1].update(reference=tr, compiled_rel_err_vs_reference=rel_err(lc, lr),
                            eager_rel_err_vs_reference=rel_err(le, lr))
            note += f"  {args.reference_dtype} {tr:6d} (compiled {'=' if tc == tr else '!='}, eager {'=' if te == tr else '!='})"
        print(f"step {step:3d}  rel err {rel:.2e}  compiled {tc:6d}  eager {te:6d}  {note}")
        if step == args.steps:
            break
        tok = np.array([tc], dtype=np.int64)
        lc, le, lr = compiled("decode_bs1", tok, pos), eager(tok, pos), run_ref(tok, pos)
        pos += 1
    # the eager model's own sensitivity: the same prompt prefilled in two chunks (the same math in
    # another order); a random-weight model at init scale can be far more sensitive than a trained one
    half = len(ids) // 2
    if half >= cfg_json.prefill_min_tokens:
        eager.reset()
        eager(ids[:half], 0)
        l2 = eager(ids[half:], half)
        eager.reset()
        floor = rel_err(l2, eager(ids, 0))
    else:
        floor = None
    other = None
    if args.eager_device2:
        eager2 = Eager(eng, args.eager_device2, args.eager_moe)
        for piece, pos in chunks():
            l2 = eager2(piece, pos)
        other = rel_err(l2, eager_prefill)
        del eager2
    agree = sum(r["agree"] for r in rows)
    summary = {"export": str(args.out), "device": args.device, "eager_device": args.eager_device,
               "eager_moe": args.eager_moe,
               "prompt_len": args.prompt_len, "steps": args.steps, "prefill_rel_err": rows[0]["rel_err"],
               "eager_two_chunks_rel_err": floor, "eager_device2": args.eager_device2,
               "eager_vs_eager_device2_prefill_rel_err": other,
               "max_rel_err": max(r["rel_err"] for r in rows), "argmax_agree": f"{agree}/{len(rows)}",
               "greedy_equal": agree == len(rows),
               # flips where eager's own preference is smaller than the step's logit error
               "flips_at_near_ties": sum(1 for r in rows if not r["agree"] and r["eager_margin"] < r["max_abs_err"]),
               **({"reference_dtype": args.reference_dtype,
                   "compiled_agrees_with_reference": f"{sum(r['compiled'] == r['reference'] for r in rows)}/{len(rows)}",
                   "eager_agrees_with_reference": f"{sum(r['eager'] == r['reference'] for r in rows)}/{len(rows)}",
                   "compiled_max_rel_err_vs_reference": max(r["compiled_rel_err_vs_reference"] for r in rows),
                   "eager_max_rel_err_vs_reference": max(r["eager_rel_err_vs_reference"] for r in rows)}
                  if ref is not None else {}),
               # wall time of the compiled calls (the first prefill includes the device's warm-up)
               "compiled_prefill_s": round(sum(seconds["prefill_bs1"]), 3),
               "compiled_decode_ms_median": round(1e3 * float(np.median(seconds["decode_bs1"])), 2)
               if seconds["decode_bs1"] else None}
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "steps": rows}, indent=1))
    return 0 if summary["greedy_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
