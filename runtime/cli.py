"""The `dsv4` command. Subcommands import what they need lazily: the runtime ones (generate, score)
work where only the base install is present; eager/export/checkpoint need the `export` extra (torch),
and say so when it is missing. Errors print one line (rc 2); Ctrl-C exits with rc 130."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dsv4.export.cli import add_parser as add_export_parser

from .commands import add_parsers as add_runtime_parsers
from .serve_cli import add_parsers as add_serve_parsers


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def cmd_eager(args: argparse.Namespace) -> int:
    """Greedy continuation with the eager PyTorch model (the reference the compiled path must match):
    the embedded default checkpoint unless --checkpoint or --preset (random weights) is given."""
    import torch

    from dsv4.model.checkpoint import EMBEDDED_CHECKPOINT, EMBEDDED_PROMPT, load_checkpoint
    from dsv4.model.config import ModelConfig
    from dsv4.model.generate import greedy
    from dsv4.model.model import Transformer, init_random

    tok = None
    if args.preset and args.prompt is not None:
        raise ValueError("--prompt needs a tokenizer and --preset models have none (random weights); "
                         "pass --prompt-ids, or use --checkpoint")
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


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """`dsv4 checkpoint make ...`: write a checkpoint in the official (or transformers) layout."""
    from dsv4.model.checkpoint import checkpoint_make_main

    if args.action != "make":
        raise ValueError(f"unknown checkpoint action {args.action!r}; try: dsv4 checkpoint make --help")
    return checkpoint_make_main(args.rest)


def cmd_weights(args: argparse.Namespace) -> int:
    """`dsv4 weights random OUT`: random weights for every .irpa file OUT/config.json names (torch-free)."""
    from dsv4.contract.errors import EngineError
    from dsv4.contract.random_weights import write_random_weights

    if args.jobs < 1:
        print(f"dsv4 weights: error: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    try:
        write_random_weights(args.export_dir, args.seed, force=args.force, progress=lambda s: print(s, flush=True),
                             jobs=args.jobs)
    except EngineError as err:  # the export directory: one line, like generate/score
        print(f"dsv4 weights: error: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"] and argv[1:2] != ["serve"]:  # `bench OUT ...` parses its own arguments
        from dsv4.bench.speed import main as bench_main

        return bench_main(argv[1:])
    p = argparse.ArgumentParser(prog="dsv4", description="DeepSeek-V4 as a compiled IREE pipeline")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("eager", help="greedy continuation with the eager PyTorch model")
    src = e.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: the embedded small model)")
    src.add_argument("--preset", help="a ModelConfig preset with random weights (e.g. tiny)")
    e.add_argument("--seed", type=int, default=0, help="random-weight seed for --preset (default: 0)")
    p_src = e.add_mutually_exclusive_group()
    p_src.add_argument("--prompt", help="prompt text (checkpoints with a tokenizer; default: the fixed prompt)")
    p_src.add_argument("--prompt-ids", type=_ids, help="comma-separated token ids")
    e.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default: 32)")
    e.set_defaults(fn=cmd_eager)
    c = sub.add_parser("checkpoint", help="make a random-weight checkpoint in the official layout (checkpoint make -h)",
                       description="Checkpoint tools. `dsv4 checkpoint make --preset tiny -o DIR` writes a random-"
                                   "weight checkpoint in the official layout (FP8 + MXFP4); "
                                   "`dsv4 checkpoint make --help` lists its options.")
    c.add_argument("action", choices=["make"], help="make: write a checkpoint (see: dsv4 checkpoint make --help)")
    c.add_argument("rest", nargs=argparse.REMAINDER, metavar="...", help="the action's options")
    c.set_defaults(fn=cmd_checkpoint)
    w = sub.add_parser("weights", help="make the weights of an export (weights random OUT; torch-free)",
                       description="Weights of an export directory. `dsv4 weights random OUT` writes random weights "
                                   "(the init's scale: N(0, 0.02) floats, finite FP8/MXFP4 codes with sane E8M0 "
                                   "scales) into every .irpa file OUT/config.json names, e.g. for an export made "
                                   "with --no-weights, one tensor at a time.")
    wa = w.add_subparsers(dest="action", required=True)
    wr = wa.add_parser("random", help="write random weights for OUT/config.json's weights inventory")
    wr.add_argument("export_dir", metavar="OUT", help="export directory (config.json with a weights inventory)")
    wr.add_argument("--seed", type=int, default=0, help="random seed (default 0): the same seed gives the same "
                                                        "values on any host and in every FP8 flavour")
    wr.add_argument("--force", action="store_true", help="replace weight files that exist already")
    wr.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="write N weight files at once, one process each (default 1); the bytes are the same")
    wr.set_defaults(fn=cmd_weights)
    add_runtime_parsers(sub)  # generate, score
    add_serve_parsers(sub)  # serve, bench serve
    add_export_parser(sub)  # export (torch loads only when it runs)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        sys.stdout.flush()
        print(f"\ndsv4 {args.cmd}: interrupted", file=sys.stderr)
        return 130
    except ValueError as err:  # bad requests get one line, not a traceback
        print(f"dsv4 {args.cmd}: error: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:  # a runtime-only install (no torch / turbine / compiler)
        if (err.name or "").split(".")[0] not in ("torch", "iree", "safetensors", "ml_dtypes"):
            raise
        print(f"dsv4 {args.cmd}: error: needs the 'export' extra ({err.name} is not installed): "
              "pip install 'dsv4-iree[export]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
