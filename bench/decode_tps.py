"""Decode throughput: the compiled module (dsv4.runtime.Engine) vs the eager PyTorch model.

Why: the compiled path has to be worth it; this puts tokens/s of both decode loops side by side
for the same config, prompt and batch sizes. A benchmark, not a test: numbers depend on the host.

    python bench/decode_tps.py --export-dir OUT            # an existing export
    python bench/decode_tps.py --preset tiny               # export the preset first (~15 min on 2 cores)
    python bench/decode_tps.py --export-dir out/default --checkpoint model/assets/small   # make run's export

Both sides: prefill a P-token prompt per sequence (not timed), then time N greedy decode steps
over a batch of B sequences. tokens/s = B * N / seconds. The eager model gets random weights of
the same config, seed 0, the weights --preset exports (values matter only through MoE routing); torch
uses as many threads as --threads (default: all cores, like IREE's local-task).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def bench_compiled(export_dir: Path, prompt: list[int], batch: int, steps: int, device: str) -> dict:
    """Decode tokens/s of the compiled module through the Engine (host argmax, padded batches)."""
    from dsv4.runtime import Engine, SamplingParams

    eng = Engine(export_dir, device=device)
    sp = SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)
    out = {}
    for rep in range(2):  # first pass warms up (first-call dispatch setup)
        ids = [eng.submit(prompt, sp) for _ in range(batch)]
        t0 = time.perf_counter()
        eng.step()  # admits all: prefill + first token each
        t1 = time.perf_counter()
        n_steps = 0
        while eng.has_work:
            eng.step()
            n_steps += 1
        t2 = time.perf_counter()
        toks = [eng.result(i).tokens for i in ids]
        out = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "steps": n_steps,
               "tps": batch * n_steps / (t2 - t1), "tokens": toks[0]}
    return out


def bench_eager(cfg_dict: dict, dtype_name: str, prompt: list[int], batch: int, steps: int,
                checkpoint: Path | None = None, device: str = "cpu") -> dict:
    """Decode tokens/s of the eager model: one batched forward per step over B slots. The weights:
    `checkpoint` (as exported from it, low-bit kept low-bit) or random ones of the export's config."""
    import torch

    from dsv4.model.config import ModelConfig
    from dsv4.model.model import Transformer, init_random
    from dsv4.model.state import new_state

    cfg = ModelConfig.from_dict(cfg_dict)
    dtype = getattr(torch, dtype_name.removeprefix("torch."))
    if checkpoint is not None:
        from dsv4.model.checkpoint import load_checkpoint

        model = load_checkpoint(checkpoint, dtype=dtype, overrides={"max_seq_len": cfg.max_seq_len})
    else:
        model = init_random(Transformer(cfg, dtype=dtype), seed=0)
    model = model.eval().to(device)
    i64 = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    out = {}
    with torch.no_grad():
        for rep in range(2):
            state = new_state(cfg, batch, dtype, device=device)
            t0 = time.perf_counter()
            nxt = []
            for b in range(batch):
                lg = model(i64([prompt]), i64([0]), i64([len(prompt)]), i64([b]), state)
                nxt.append(int(lg[0].argmax()))
            t1 = time.perf_counter()
            tok = i64(nxt).view(batch, 1)
            slots, ones = torch.arange(batch, device=device), torch.ones(batch, dtype=torch.long, device=device)
            for s in range(steps):
                pos = torch.full((batch,), len(prompt) + s, dtype=torch.long, device=device)
                lg = model(tok, pos, ones, slots, state)
                tok = lg.argmax(-1).view(batch, 1)
            tok.cpu()  # waits for the device
            t2 = time.perf_counter()
            out = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "steps": steps, "tps": batch * steps / (t2 - t1)}
    return out


def export_preset(preset: str, out: Path, dtype_name: str, n_slots: int) -> Path:
    """Export ``preset`` (random weights, seed 0: the eager side rebuilds the same ones) for llvm-cpu."""
    import torch

    from dsv4.export.exporter import export_model
    from dsv4.model.config import ModelConfig
    from dsv4.model.model import Transformer, init_random

    cfg = ModelConfig.preset(preset)
    model = init_random(Transformer(cfg, dtype=getattr(torch, dtype_name)), seed=0).eval()
    export_model(model, cfg, out, targets=["llvm-cpu"], batch_sizes=(1,), decode_batch_sizes=(1, 4),
                 n_slots=n_slots, progress=lambda s: print("  export:", s, flush=True))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--export-dir", type=Path)
    src.add_argument("--preset")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--device", default="local-task")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--no-eager", action="store_true")
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="eager weights: the checkpoint the export was made from (default: random, seed 0)")
    ap.add_argument("--eager-device", default="cpu", help="torch device of the eager model (cpu, cuda)")
    ap.add_argument("--dtype", default="float32", help="activation dtype when exporting --preset")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    export_dir = args.export_dir or export_preset(args.preset, Path(tempfile.mkdtemp(prefix="dsv4_bench_")),
                                                  args.dtype, max(args.batch))
    from dsv4.runtime import ExportConfig

    cfg = ExportConfig.load(export_dir).raw
    vocab = cfg["model"]["vocab_size"]
    prompt = [cfg.get("bos_token_id") or 0] + [(7 * i + 3) % vocab for i in range(args.prompt_len - 1)]
    for b in args.batch:
        if b > cfg["n_slots"]:
            sys.exit(f"decode_tps: batch {b} exceeds the export's n_slots {cfg['n_slots']}")
    rows = []
    for b in args.batch:
        c = bench_compiled(export_dir, prompt, b, args.steps, args.device)
        rows.append(("iree " + args.device, b, c))
        if not args.no_eager:
            import torch

            torch.set_num_threads(args.threads)
            e = bench_eager(cfg["model"], cfg.get("activation_dtype", "bfloat16"), prompt, b, args.steps,
                            args.checkpoint, args.eager_device)
            where = f"{args.threads} thr" if args.eager_device == "cpu" else args.eager_device
            rows.append((f"eager torch ({where})", b, e))
    if args.json:
        print(json.dumps([{"backend": n, "batch": b, **{k: v for k, v in r.items() if k != "tokens"}}
                          for n, b, r in rows]))
        return 0
    print(f"export {export_dir}  prompt {len(prompt)} tokens, {args.steps} decode steps, "
          f"layers {cfg['model'].get('num_hidden_layers')}, hidden {cfg['model'].get('hidden_size')}")
    print(f"{'backend':<26} {'batch':>5} {'tok/s':>9} {'ms/step':>9} {'prefill ms':>11}")
    for n, b, r in rows:
        print(f"{n:<26} {b:>5} {r['tps']:>9.1f} {1e3 * r['decode_s'] / r['steps']:>9.2f} "
              f"{1e3 * r['prefill_s']:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
