"""`dsv4 checkpoint make`: a randomly initialized checkpoint in the released format, with the
tokenizer trained on the training corpus. Needs the `export` extra (torch, safetensors)."""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import HelpFormatter, add_command

__all__ = ["add_parser", "checkpoint_make_main"]

PRESETS = ("tiny", "small", "flash", "pro")  # dsv4.model.config.PRESETS (checked when the command runs)
MAKE_DESCRIPTION = ("Write a randomly initialized DeepSeek-V4 checkpoint directory in the released format "
                    "(config.json, safetensors, tokenizer.json).")


def _bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 500MB, 4GB)")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


def _make_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", default="tiny", choices=PRESETS, help="model size")
    ap.add_argument("--seed", type=int, default=0, help="random init seed")
    ap.add_argument("-o", "--output", required=True, metavar="DIR", help="output directory")
    ap.add_argument("--layout", choices=("official", "transformers"), default="official",
                    help="tensor names and layout: official (DeepSeek's release: per-expert w1/w2/w3) or "
                         "transformers (deepseek_v4: stacked gate_up_proj, *_scale_inv)")
    ap.add_argument("--expert-dtype", choices=("fp4", "fp8", "bf16"), default=None,
                    help="routed expert format (default: the preset's, fp4)")
    ap.add_argument("--scale-fmt", choices=("ue8m0", "fp32"), default="ue8m0",
                    help="FP8 block scale format (fp32 = -Base style)")
    ap.add_argument("--unquantized", action="store_true", help="bf16 linears and experts, no quantization_config")
    ap.add_argument("--std", type=float, default=0.02, help="init std of the float weights")
    ap.add_argument("--max-shard-size", type=_bytes, default="4GB", help="largest safetensors file, e.g. 500MB, 4GB")
    ap.add_argument("--force", action="store_true", help="replace a checkpoint already in the output directory")


def _write_corpus_tokenizer(cfg: Any, out: Path) -> None:
    """The tokenizer trained on the training corpus (what the embedded model uses), at the model's
    vocab size up to 2048: a random checkpoint then loads and runs like a released one."""
    from dsv4.contract.tokenizer import save_tokenizer
    from dsv4.train.tokenizer import MIN_VOCAB_SIZE, RECOMMENDED_VOCAB_SIZE, corpus_tokenizer

    vocab = min(cfg.vocab_size, RECOMMENDED_VOCAB_SIZE)
    if vocab < MIN_VOCAB_SIZE:
        warnings.warn(f"vocab_size {cfg.vocab_size} is too small for a byte-level tokenizer; none written",
                      stacklevel=2)
        return
    save_tokenizer(corpus_tokenizer(vocab), out, model_max_length=cfg.max_seq_len)


def cmd_make(args: argparse.Namespace) -> int:
    from dsv4.model.checkpoint.make import make_random_checkpoint

    out, cfg = make_random_checkpoint(args.preset, args.output, seed=args.seed, layout=args.layout,
                                      expert_dtype=args.expert_dtype, scale_fmt=args.scale_fmt,
                                      unquantized=args.unquantized, std=args.std,
                                      max_shard_bytes=args.max_shard_size, force=args.force)
    _write_corpus_tokenizer(cfg, out)
    n = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"wrote {out} ({args.preset}, {args.layout} layout, {n / 2**20:.1f} MiB of safetensors)")
    return 0


def checkpoint_make_main(argv: Sequence[str] | None = None) -> int:
    """`dsv4 checkpoint make ARGS` as a function (raises what the command would report)."""
    ap = argparse.ArgumentParser(prog="dsv4 checkpoint make", description=MAKE_DESCRIPTION,
                                 formatter_class=HelpFormatter)
    _make_options(ap)
    return cmd_make(ap.parse_args(sys.argv[1:] if argv is None else list(argv)))


def add_parser(subparsers: Any, name: str = "checkpoint") -> argparse.ArgumentParser:
    c = add_command(subparsers, name,
                    description="Checkpoint tools. `dsv4 checkpoint make --preset tiny -o DIR` writes a random-"
                                "weight checkpoint in the released layout (FP8 + MXFP4); "
                                "`dsv4 checkpoint make --help` lists its options.")
    ca = c.add_subparsers(dest="action", required=True, metavar="ACTION")
    m = ca.add_parser("make", help="write a random-weight checkpoint (see: dsv4 checkpoint make --help)",
                      description=MAKE_DESCRIPTION, formatter_class=HelpFormatter)
    _make_options(m)
    m.set_defaults(fn=cmd_make)
    return c
