"""`dsv4 inspect OUT`: per entry point of an export, each dispatch's kind, shape, FLOPs and bytes from the
IR and whether its code uses the matrix instructions (dsv4.export.inspect; needs iree-base-compiler,
not torch)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from . import add_command, fail

__all__ = ["add_parser", "cmd_inspect"]


def cmd_inspect(args: argparse.Namespace) -> int:
    from dsv4.contract.errors import ArtifactError
    from dsv4.export.inspect import format_report, inspect_export

    if args.rows is not None and args.rows < 1:
        return fail("inspect", f"--rows must be >= 1, got {args.rows}")
    if args.top is not None and args.top < 0:
        return fail("inspect", f"--top must be >= 0, got {args.top}")
    entries = [e for s in args.entry for e in s.split(",") if e] or None
    progress = None if args.json else (lambda s: print(s, file=sys.stderr, flush=True))
    try:
        rep = inspect_export(args.export_dir, args.target, rows=args.rows, entries=entries, progress=progress)
    except ArtifactError as err:
        return fail("inspect", err)
    if args.json:
        json.dump(rep.to_json(), sys.stdout, indent=1)
        print()
    else:
        print(format_report(rep, top=args.top, matmul_only=args.matmul))
    return 0


def add_parser(subparsers: Any, name: str = "inspect") -> argparse.ArgumentParser:
    c = add_command(subparsers, name,
                    description="What each entry point of an export dispatches, without the GPU: per dispatch "
                                "its kind and shape (IREE's name for its root op), FLOPs and bytes (from its "
                                "linalg ops; a dynamic size is taken as --rows) and whether its kernel uses the "
                                "matrix instructions (gfx942: MFMA in the code objects, disassembled with "
                                "llvm-objdump-19 from Debian's llvm-19; cuda: mma in the PTX); per entry point "
                                "the dispatches per call, the host waits (where the host program waits for the "
                                "device mid-call), the share of matmul FLOPs on the matrix cores and "
                                "the bytes per call (a decode entry point: per decode step). It compiles the "
                                "export's model.mlir to executable sources with the flags config.json records "
                                "(a minute for Flash-4), so the export must be made with --keep-mlir. Needs "
                                "iree-base-compiler, not torch.\n\n"
                                "example:\n"
                                "  dsv4 export --preset flash --layers 4 --no-weights --keep-mlir --target gfx942 "
                                "-o out/f4\n"
                                "  dsv4 inspect out/f4 --entry prefill_bs1 --matmul")
    c.add_argument("export_dir", metavar="OUT", help="export directory made with --keep-mlir")
    c.add_argument("--target", metavar="T", help="which of the export's targets (needed when it has several)")
    c.add_argument("--entry", action="append", default=[], metavar="NAME",
                   help="only these entry points (repeatable or comma-separated; default: all)")
    c.add_argument("--rows", type=int, metavar="N",
                   help="the value of a dynamic size (the prefill's token count; default: config.json's "
                        "prefill.min_tokens)")
    c.add_argument("--top", type=int, metavar="N", help="list only the N kernels with the most FLOPs per entry")
    c.add_argument("--matmul", action="store_true", help="list only the matmul/contract kernels")
    c.add_argument("--json", action="store_true", help="one JSON object: every dispatch call in order, per entry")
    c.set_defaults(fn=cmd_inspect)
    return c
