"""`dsv4 eager`: greedy continuation with the eager PyTorch model (the reference the compiled path
must match). Needs the `export` extra (torch)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import add_command
from .generate import token_ids

__all__ = ["add_parser", "cmd_eager"]


def cmd_eager(args: argparse.Namespace) -> int:
    """The embedded default checkpoint unless --checkpoint or --preset (random weights) is given."""
    if args.preset and args.prompt is not None:
        raise ValueError("--prompt needs a tokenizer and --preset models have none (random weights); "
                         "pass --prompt-ids, or use --checkpoint")
    import torch

    from dsv4.model.checkpoint import EMBEDDED_CHECKPOINT, EMBEDDED_PROMPT, load_checkpoint
    from dsv4.model.config import ModelConfig
    from dsv4.model.generate import greedy
    from dsv4.model.model import Transformer, init_random

    tok = None
    if args.preset:
        model = init_random(Transformer(ModelConfig.preset(args.preset), dtype=torch.bfloat16), seed=args.seed)
        what = f"preset {args.preset} (random weights, seed {args.seed})"
    else:
        ckpt = args.checkpoint or EMBEDDED_CHECKPOINT
        model = load_checkpoint(ckpt, dtype=torch.bfloat16)
        what = f"checkpoint {ckpt}"
        if (Path(ckpt) / "tokenizer.json").is_file():
            from dsv4.contract.tokenizer import decode, encode, load_tokenizer

            tok = load_tokenizer(Path(ckpt) / "tokenizer.json")
    if args.prompt_ids is not None:
        prompt = args.prompt_ids
    elif tok is not None:
        prompt = encode(tok, args.prompt if args.prompt is not None else EMBEDDED_PROMPT, bos=True)
    else:
        prompt = [0, 17, 42, 7, 99, 3, 256, 12]
    out = greedy(model.eval(), prompt, args.max_new_tokens)
    print(f"{what}, eager bf16, prompt {prompt}")
    if tok is not None:
        print(decode(tok, prompt) + decode(tok, out))
    else:
        print("greedy continuation:", ",".join(map(str, out)))
    return 0


def add_parser(subparsers: Any, name: str = "eager") -> argparse.ArgumentParser:
    e = add_command(subparsers, name)
    src = e.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: the embedded small model)")
    src.add_argument("--preset", help="a model preset with random weights (tiny, small, flash, pro)")
    e.add_argument("--seed", type=int, default=0, help="random-weight seed for --preset")
    p_src = e.add_mutually_exclusive_group()
    p_src.add_argument("--prompt", help="prompt text (checkpoints with a tokenizer; default: the fixed prompt)")
    p_src.add_argument("--prompt-ids", type=token_ids, help="comma-separated token ids")
    e.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate")
    e.set_defaults(fn=cmd_eager)
    return e
