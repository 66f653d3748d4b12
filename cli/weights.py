"""`dsv4 weights random OUT`: random weights for every .irpa file OUT/config.json names (torch-free)."""

from __future__ import annotations

import argparse
from typing import Any

from . import add_command, fail

__all__ = ["add_parser", "cmd_weights"]


def cmd_weights(args: argparse.Namespace) -> int:
    from dsv4.contract.errors import EngineError
    from dsv4.contract.random_weights import write_random_weights

    if args.jobs < 1:
        return fail("weights", f"--jobs must be >= 1, got {args.jobs}")
    try:
        write_random_weights(args.export_dir, args.seed, force=args.force, progress=lambda s: print(s, flush=True),
                             jobs=args.jobs)
    except EngineError as err:  # the export directory: one line, like generate/score
        return fail("weights", err)
    return 0


def add_parser(subparsers: Any, name: str = "weights") -> argparse.ArgumentParser:
    w = add_command(subparsers, name,
                    description="Weights of an export directory. `dsv4 weights random OUT` writes random weights "
                                "(the init's scale: N(0, 0.02) floats, finite FP8/MXFP4 codes with sane E8M0 "
                                "scales) into every .irpa shard OUT/config.json names, e.g. for an export made "
                                "with --no-weights, one tensor at a time, and records each shard's sha256 in "
                                "config.json (`dsv4 check OUT` verifies them).")
    wa = w.add_subparsers(dest="action", required=True, metavar="ACTION")
    wr = wa.add_parser("random", help="write random weights for OUT/config.json's weights inventory",
                       formatter_class=w.formatter_class, description=w.description)
    wr.add_argument("export_dir", metavar="OUT", help="export directory (config.json with a weights inventory)")
    wr.add_argument("--seed", type=int, default=0, help="random seed: the same seed gives the same values on any "
                                                        "host and in every FP8 flavour")
    wr.add_argument("--force", action="store_true", help="replace weight files that exist already")
    wr.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="write N weight files at once, one process each; the bytes are the same")
    wr.set_defaults(fn=cmd_weights)
    return w
