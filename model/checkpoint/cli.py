"""`dsv4 checkpoint make`: a randomly initialized checkpoint in the released format."""

from __future__ import annotations

import argparse
import re
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from ..config import PRESETS, ModelConfig
from ..model import Transformer, init_random
from dsv4.contract.tokenizer import save_tokenizer
from .write import DEFAULT_MAX_SHARD_BYTES, write_checkpoint

__all__ = ["checkpoint_make_main"]


def _bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 500MB, 4GB)")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


def _write_corpus_tokenizer(cfg: ModelConfig, out: Path) -> None:
    """The tokenizer trained on the training corpus (what the embedded model uses), at the model's
    vocab size up to 2048: a random checkpoint then loads and runs like a released one."""
    # the one place the model package reaches into dsv4.train: a random checkpoint needs a tokenizer
    from dsv4.train.tokenizer import MIN_VOCAB_SIZE, RECOMMENDED_VOCAB_SIZE, corpus_tokenizer

    vocab = min(cfg.vocab_size, RECOMMENDED_VOCAB_SIZE)
    if vocab < MIN_VOCAB_SIZE:
        warnings.warn(f"vocab_size {cfg.vocab_size} is too small for a byte-level tokenizer; none written",
                      stacklevel=2)
        return
    save_tokenizer(corpus_tokenizer(vocab), out, model_max_length=cfg.max_seq_len)


def checkpoint_make_main(argv: Sequence[str] | None = None) -> int:
    """`dsv4 checkpoint make`: write a random checkpoint in the released format (tests, defaults)."""
    ap = argparse.ArgumentParser(prog="dsv4 checkpoint make",
                                 description="Write a randomly initialized DeepSeek-V4 checkpoint directory in the "
                                             "released format (config.json, safetensors, tokenizer).")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size (default tiny)")
    ap.add_argument("--seed", type=int, default=0, help="random init seed")
    ap.add_argument("-o", "--output", required=True, help="output directory")
    ap.add_argument("--layout", choices=("official", "transformers"), default="official")
    ap.add_argument("--expert-dtype", choices=("fp4", "fp8", "bf16"), default=None,
                    help="routed expert format (default: the preset's, fp4)")
    ap.add_argument("--scale-fmt", choices=("ue8m0", "fp32"), default="ue8m0",
                    help="FP8 block scale format (fp32 = -Base style)")
    ap.add_argument("--unquantized", action="store_true", help="bf16 linears and experts, no quantization_config")
    ap.add_argument("--std", type=float, default=0.02, help="init std of the float weights")
    ap.add_argument("--max-shard-size", type=_bytes, default=DEFAULT_MAX_SHARD_BYTES, help="e.g. 500MB, 4GB")
    ap.add_argument("--force", action="store_true", help="replace a checkpoint already in the output directory")
    args = ap.parse_args(argv)

    cfg = ModelConfig.preset(args.preset)
    if args.unquantized:
        cfg = cfg.replace(quantization_config=None, expert_dtype=None)
    else:
        qc = {**(cfg.quantization_config or {}), "scale_fmt": args.scale_fmt}
        cfg = cfg.replace(quantization_config=qc, expert_dtype=args.expert_dtype or cfg.expert_dtype)
    if cfg.expert_dtype == "bf16":
        cfg = cfg.replace(expert_dtype=None)
    model = init_random(Transformer(cfg, dtype=torch.float32), seed=args.seed, std=args.std)
    out = write_checkpoint(model, cfg, args.output, args.layout, max_shard_bytes=args.max_shard_size,
                           overwrite=args.force)
    _write_corpus_tokenizer(cfg, out)
    n = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"wrote {out} ({args.preset}, {args.layout} layout, {n / 2**20:.1f} MiB of safetensors)")
    return 0
