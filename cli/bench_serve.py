"""`dsv4 bench serve URL`: TTFT / TPOT / ITL / latency / throughput of a running server at several
concurrencies, like `vllm bench serve`. Needs the `serve` extra (httpx); nothing here needs torch.
(`dsv4 bench OUT`, the speed of an export, parses its own arguments: dsv4.bench.speed.)"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from . import HelpFormatter, add_command

__all__ = ["add_parser", "cmd_bench_serve"]


def _fail(cmd: str, msg: str) -> int:
    print(f"dsv4 {cmd}: error: {msg}", file=sys.stderr)
    return 2


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Load a running server at several concurrencies; print a table (or JSON)."""
    from dsv4.bench.serve_load import format_table, run_bench  # a missing httpx: "needs the 'serve' extra"

    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        return _fail("bench serve", f"--concurrency expects comma-separated integers, got {args.concurrency!r}")
    if not levels or min(levels) < 1 or args.requests < 1 or args.max_tokens < 1 or args.id_limit < 4:
        return _fail("bench serve", "--concurrency levels, --requests and --max-tokens must be positive, --id-limit at least 4")
    api_key = args.api_key or os.environ.get("DSV4_API_KEY") or None
    try:
        results = run_bench(args.url, levels, args.requests, max_tokens=args.max_tokens,
                            prompt_tokens=args.prompt_tokens, id_limit=args.id_limit, api_key=api_key, model=args.model,
                            seed=args.seed, timeout=args.timeout)
    except (OSError, RuntimeError, ValueError) as e:
        return _fail("bench serve", str(e))
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=1))
    else:
        print(format_table(results))
    return 0 if all(r.failed == 0 for r in results) else 1


def add_parser(subparsers: Any, name: str = "bench") -> argparse.ArgumentParser:
    b = add_command(subparsers, name)
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    bs = bsub.add_parser("serve", help="TTFT / TPOT / ITL / latency / throughput of a running server, "
                                       "like `vllm bench serve`", formatter_class=HelpFormatter,
                        description="Send --requests completions at each --concurrency level to a running `dsv4 "
                                    "serve` (or any OpenAI-compatible server) and print TTFT, TPOT, ITL, latency "
                                    "and throughput per level.")
    bs.add_argument("url", metavar="URL", help="server base URL, e.g. http://127.0.0.1:8000")
    bs.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    bs.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    bs.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates (ignore_eos)")
    bs.add_argument("--prompt-tokens", type=int, default=32,
                    help="prompt length in tokens (random ids in [3, --id-limit), sent to /v1/completions)")
    bs.add_argument("--id-limit", type=int, default=1000, help="prompt token ids are below this (<= the vocabulary)")
    bs.add_argument("--model", help="model id (default: the server's first /v1/models entry)")
    bs.add_argument("--api-key", help="API key (default: $DSV4_API_KEY)")
    bs.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    bs.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    bs.add_argument("--json", action="store_true", help="print one JSON list instead of the table")
    bs.set_defaults(fn=cmd_bench_serve)
    return b
