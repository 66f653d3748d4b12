"""`dsv4 check OUT`: verify an export's files after a copy (torch-free): config.json, every weight
shard's sha256 against the one config.json records, every vmfb's structure, the tokenizer."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import add_command

__all__ = ["add_parser", "cmd_check"]


def cmd_check(args: argparse.Namespace) -> int:
    from dsv4.contract.weights import verify_export

    problems = verify_export(args.export_dir, progress=None if args.quiet else lambda s: print(s, flush=True))
    for p in problems:
        print(f"dsv4 check: error: {p}", file=sys.stderr)
    if not problems and not args.quiet:
        print(f"{args.export_dir}: every file checked, all good")
    return 1 if problems else 0


def add_parser(subparsers: Any, name: str = "check") -> argparse.ArgumentParser:
    c = add_command(subparsers, name,
                    description="Verify an export directory, e.g. after copying it to another machine: "
                                "config.json, each .irpa weight shard (its structure and the sha256 config.json "
                                "records), each vmfb's structure, the tokenizer. Prints one error line per bad "
                                "file and exits 1; exits 0 when every file is good. A shard without a recorded "
                                "sha256 (an export made before checksums) counts as unverified.")
    c.add_argument("export_dir", metavar="OUT", help="export directory")
    c.add_argument("-q", "--quiet", action="store_true", help="print only the errors")
    c.set_defaults(fn=cmd_check)
    return c
