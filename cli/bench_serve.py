"""`dsv4 bench serve URL`: TTFT / TPOT / ITL / latency / throughput of a running server at several
concurrencies, like `vllm bench serve`. The options and the run are dsv4.bench.serve_load's (needs
httpx, imported when a run starts; nothing here needs torch). `dsv4 bench OUT`, the speed of an
export, parses its own arguments: dsv4.bench.speed."""

from __future__ import annotations

import argparse
from typing import Any

from . import HelpFormatter, add_command

__all__ = ["add_parser"]


def add_parser(subparsers: Any, name: str = "bench") -> argparse.ArgumentParser:
    from dsv4.bench.serve_load import DESCRIPTION, add_arguments

    b = add_command(subparsers, name)
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    bs = bsub.add_parser("serve", help="TTFT / TPOT / ITL / latency / throughput of a running server, "
                                       "like `vllm bench serve`", formatter_class=HelpFormatter,
                         description=DESCRIPTION)
    add_arguments(bs)
    return b
