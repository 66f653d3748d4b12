"""`dsv4 audit OUT`: where a compiled export leaves its eager reference, layer by layer
(dsv4.bench.audit does the work; export extra). Exit 0 consistent, 1 divergent, 2 error."""

from __future__ import annotations

import argparse
from typing import Any

from . import add_command, fail

__all__ = ["add_parser", "cmd_audit"]


def cmd_audit(args: argparse.Namespace) -> int:
    from dsv4.bench import audit

    try:
        return audit.run(args)
    except (ValueError, OSError, RuntimeError) as e:  # bad input, a missing file, a probe that fails to build
        return fail("audit", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)


def add_parser(subparsers: Any, name: str = "audit") -> argparse.ArgumentParser:
    from dsv4.bench.audit import add_arguments

    c = add_command(subparsers, name,
                    description="Audit a compiled export against its eager reference. Weights: every tensor of "
                                "the .irpa decoded (FP8 OCP or FNUZ + scales, MXFP4, bf16) and compared exactly with "
                                "the checkpoint's. Activations: a probe of the export (its graph for its target with "
                                "every layer's intermediate values as extra results) on the export's weights against "
                                "the eager model on the checkpoint's, prefill then N greedy decode steps, layer by "
                                "layer and part by part (mHC, indexer, attention, router, MoE, block output); the "
                                "yardstick is the eager model's own noise in the same run (the export's activation "
                                "dtype against a wider one). Prints a table (and with --json a last line of JSON); "
                                "exits 0 when consistent, 1 when a weight or a layer diverges, 2 on an error.")
    add_arguments(c)
    c.set_defaults(fn=cmd_audit)
    return c
