"""The `dsv4` command. Subcommands import what they need lazily: the runtime ones work where only
iree-base-runtime and numpy are installed; the eager/export ones need torch."""

from __future__ import annotations

import argparse
import sys


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def cmd_eager(args: argparse.Namespace) -> int:
    """Greedy continuation with the eager PyTorch model (the reference the compiled path must match)."""
    import torch

    from dsv4.model.config import ModelConfig
    from dsv4.model.generate import greedy
    from dsv4.model.model import Transformer, init_random

    cfg = ModelConfig.preset(args.preset)
    model = init_random(Transformer(cfg, dtype=torch.bfloat16), seed=args.seed).eval()
    out = greedy(model, args.prompt_ids, args.max_new_tokens)
    print(f"preset {args.preset} (random weights, seed {args.seed}), prompt {args.prompt_ids}")
    print("greedy continuation:", ",".join(map(str, out)))
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """`dsv4 checkpoint make ...`: write a checkpoint in the official (or transformers) layout."""
    from dsv4.model.checkpoint import checkpoint_make_main

    if args.action != "make":
        raise ValueError(f"unknown checkpoint action {args.action!r}; try: dsv4 checkpoint make --help")
    return checkpoint_make_main(args.rest)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dsv4", description="DeepSeek-V4 as a compiled IREE pipeline")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("eager", help="greedy continuation with the eager PyTorch model")
    e.add_argument("--preset", default="tiny")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--prompt-ids", type=_ids, default=[0, 17, 42, 7, 99, 3, 256, 12])
    e.add_argument("--max-new-tokens", type=int, default=16)
    e.set_defaults(fn=cmd_eager)
    c = sub.add_parser("checkpoint", help="make a random-weight checkpoint in the official layout (checkpoint make -h)")
    c.add_argument("action", choices=["make"])
    c.add_argument("rest", nargs=argparse.REMAINDER)
    c.set_defaults(fn=cmd_checkpoint)
    __import__("dsv4.runtime.commands", fromlist=["add_parsers"]).add_parsers(sub)  # generate, score
    __import__("runpy").run_path(str(__import__("pathlib").Path(__file__).resolve().parents[1] / "export" / "cli.py"))["add_parser"](sub)  # export: loaded by path so torch/turbine load only when it runs
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as err:  # bad requests get one line, not a traceback
        print(f"dsv4 {args.cmd}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
