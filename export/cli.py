"""`dsv4 export`: build a compiled artifact directory (config.json, model.irpa, model.<target>.vmfb).

Wired into the `dsv4` command by `add_parser(subparsers)` (runtime/cli.py); torch and turbine are
imported only when the command runs, so `dsv4 --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

__all__ = ["add_parser", "cmd_export"]


def _batch_sizes(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes like 1,4, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("no batch size given")
    return out


class _KernelHelp(str):
    """--kernel's help, derived from the kernel registry when argparse formats it (help % params),
    so torch loads for `dsv4 export -h` only, never for `dsv4 --help`."""

    def __mod__(self, params: object) -> str:
        from dsv4.export.model_kernels import kernel_help

        return kernel_help().replace("%", "%%") % params


def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="export + compile the model to IREE (vmfb per target, .irpa, config.json)",
                              description=__doc__)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", metavar="DIR",
                     help="checkpoint directory (config.json + safetensors); default: the embedded small model")
    src.add_argument("--preset", help="a ModelConfig preset with random weights (e.g. tiny)")
    p.add_argument("--target", action="append", dest="targets", metavar="T",
                   help="gfx942 (default), llvm-cpu, cuda, optionally NAME:ARCH (e.g. cuda:sm_80); repeatable")
    p.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 4], help="prefill/decode batch sizes (1,4)")
    p.add_argument("--decode-batch-sizes", type=_batch_sizes, default=None, help="decode batch sizes (default: same)")
    p.add_argument("--max-seq-len", type=int, default=None, help="override the state size (positions per slot)")
    p.add_argument("--max-chunk", type=int, default=None, help="largest prefill chunk T (default min(max_seq_len, 512))")
    p.add_argument("--n-slots", type=int, default=None, help="state slots (default: largest batch size)")
    p.add_argument("--quant-sim", choices=("on", "off"), default=None,
                   help="the reference's FP8/FP4 QAT simulations (default: the config's)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="activation/state dtype")
    p.add_argument("--seed", type=int, default=0, help="random-weight seed (--preset)")
    p.add_argument("--kernel", action="append", default=[], metavar="OP=IMPL", help=_KernelHelp("OP=IMPL"))
    p.add_argument("--no-score", action="store_true", help="skip the score_bs1 entry point")
    p.add_argument("--keep-mlir", action="store_true", help="keep model.mlir in the output directory")
    p.add_argument("-o", "--out", required=True, metavar="OUT", help="output directory")
    p.set_defaults(fn=cmd_export)
    return p


def cmd_export(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)

    from dsv4.export.exporter import ExportError, export_model

    stage = "load"
    try:
        import torch

        from dsv4.export.compile import resolve_target
        from dsv4.model.config import ModelConfig
        from dsv4.model.model import Transformer, init_random

        targets = args.targets or ["gfx942"]
        for t in targets:  # fail on a typo before spending minutes on loading
            resolve_target(t)
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        overrides = {}
        if args.max_seq_len is not None:
            overrides["max_seq_len"] = args.max_seq_len
        if args.quant_sim is not None:
            overrides["quant_sim"] = args.quant_sim == "on"
        tokenizer = None
        if not args.preset:
            from dsv4.model.checkpoint import EMBEDDED_CHECKPOINT, load_checkpoint

            ckpt = Path(args.checkpoint) if args.checkpoint else EMBEDDED_CHECKPOINT
            log(f"loading checkpoint {ckpt}" + ("" if args.checkpoint else " (the embedded default)"))
            model = load_checkpoint(ckpt, dtype=dtype, overrides=overrides)
            tok = ckpt / "tokenizer.json"
            tokenizer = tok if tok.is_file() else None
        else:
            cfg = ModelConfig.preset(args.preset, **overrides)
            log(f"preset {args.preset}: random weights (seed {args.seed})")
            model = init_random(Transformer(cfg, dtype=dtype), seed=args.seed)
        cfg = model.cfg
        log(f"model: {cfg.n_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
            f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, {args.dtype}")
        kernels = {}
        for item in args.kernel:
            op, sep, impl = item.partition("=")
            if not sep:
                raise ValueError(f"--kernel expects OP=IMPL, got {item!r}")
            kernels[op.strip()] = impl.strip()
        stage = "export"
        res = export_model(model, cfg, args.out, targets=targets, batch_sizes=args.batch_sizes,
                           decode_batch_sizes=args.decode_batch_sizes, max_chunk=args.max_chunk,
                           n_slots=args.n_slots, keep_mlir=args.keep_mlir, score=not args.no_score,
                           tokenizer=tokenizer, progress=log, kernels=kernels)
    except ExportError as e:  # already names the stage and the op
        print(f"dsv4 export: error: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:  # ConfigError/CheckpointError are ValueErrors
        print(f"dsv4 export: error in stage '{stage}': {e}", file=sys.stderr)
        return 2
    print("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in res.timings.items()))
    for name, info in res.config["targets"].items():
        size = (res.out_dir / info["vmfb"]).stat().st_size
        print(f"  {name}: {info['vmfb']} ({size / 1e6:.2f} MB, compiled in {info['compile_s']:.1f} s)")
    irpa = res.out_dir / res.config["parameters"]
    print(f"  parameters: {irpa.name} ({irpa.stat().st_size / 1e6:.1f} MB); config: {res.config_path}")
    return 0
