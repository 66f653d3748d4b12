"""`dsv4 serve` (the OpenAI-compatible server) and `dsv4 bench serve` (its load generator).

Wired into the `dsv4` command by ``add_parsers(subparsers)`` (runtime/cli.py). The server needs
the `serve` extra (starlette, uvicorn, prometheus_client, jinja2, httpx); nothing here needs torch.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parsers", "cmd_serve", "cmd_bench_serve"]


def _fail(cmd: str, msg: str) -> int:
    print(f"dsv4 {cmd}: error: {msg}", file=sys.stderr)
    return 2


def _need_extra(cmd: str, err: ModuleNotFoundError) -> int:
    return _fail(cmd, f"needs the 'serve' extra ({err.name} is not installed): pip install 'dsv4-iree[serve]'")


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the export, then serve it until SIGINT/SIGTERM (in-flight requests get --drain-timeout
    seconds to finish, then are cancelled; the exit status is 0)."""
    try:
        import uvicorn

        from .serve import AsyncEngine, build_app
    except ModuleNotFoundError as e:
        return _need_extra("serve", e)
    from .engine import Engine, EngineError

    if args.max_queue < 0:
        return _fail("serve", f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        return _fail("serve", f"--max-body-bytes must be positive, got {args.max_body_bytes}")
    api_key = args.api_key or os.environ.get("DSV4_API_KEY") or None
    try:
        eng = Engine(args.export_dir, device=args.device, device_index=args.device_index,
                     devices=args.devices)
    except EngineError as e:
        return _fail("serve", str(e))
    name = args.served_model_name or Path(args.export_dir).resolve().name
    app = build_app(AsyncEngine(eng, max_queue=args.max_queue), name, api_key=api_key,
                    max_body_bytes=args.max_body_bytes)
    print(f"dsv4 serve: {name} ({eng.config.n_slots} slots, context {eng.config.max_seq_len}, "
          f"{eng.target} on {args.device}) at http://{args.host}:{args.port}/v1"
          + (" (API key required)" if api_key else ""), file=sys.stderr, flush=True)
    # uvicorn handles SIGTERM/SIGINT while it runs (drain, then shut down) and afterwards re-raises
    # the signal to the handler that was there before it; make that one a no-op so a drained
    # shutdown exits 0 instead of dying of the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                  timeout_graceful_shutdown=args.drain_timeout, access_log=args.access_log)).run()
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Load a running server at several concurrencies; print a table (or JSON)."""
    try:
        from .bench_serve import format_table, run_bench
    except ModuleNotFoundError as e:
        return _need_extra("bench serve", e)
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        return _fail("bench serve", f"--concurrency expects comma-separated integers, got {args.concurrency!r}")
    if not levels or min(levels) < 1 or args.requests < 1 or args.max_tokens < 1 or (args.id_limit is not None and args.id_limit < 4):
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


def add_parsers(subparsers: Any) -> None:
    """Register `serve` and `bench serve` on the `dsv4` command's subparsers."""
    s = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server for an export (needs the serve extra)")
    s.add_argument("export_dir", metavar="OUT", help="export directory (config.json, model.irpa, vmfb)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--device", default="local-task", choices=["local-task", "local-sync", "cuda", "hip"])
    s.add_argument("--device-index", type=int, default=0)
    s.add_argument("--devices", type=int, default=None, metavar="N",
                   help="devices of a multi-device export (default: the export's count)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a slot; beyond that the answer is 503 with Retry-After")
    s.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                   help="largest request body accepted, larger ones get 413 (default: 1 MiB + 32 bytes per "
                        "context position)")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (default: $DSV4_API_KEY)")
    s.add_argument("--served-model-name", help="the model id clients send (default: the export directory's name)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT before they are cancelled")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--access-log", action="store_true", help="log every request")
    s.set_defaults(fn=cmd_serve)

    b = subparsers.add_parser("bench", help="speed of an export vs torch (dsv4 bench OUT -h) or of a running "
                                             "server (dsv4 bench serve -h)")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    bs = bsub.add_parser("serve", help="TTFT / TPOT / ITL / latency / throughput of a running server, "
                                       "like `vllm bench serve`")
    bs.add_argument("url", metavar="URL", help="server base URL, e.g. http://127.0.0.1:8000")
    bs.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels (1,8,32)")
    bs.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    bs.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates (ignore_eos)")
    bs.add_argument("--prompt-tokens", type=int, default=32,
                    help="prompt length in tokens (random ids in [3, --id-limit), sent to /v1/completions)")
    bs.add_argument("--id-limit", type=int, default=None,
                    help="prompt token ids are below this (default: the vocabulary the server reports in /v1/models)")
    bs.add_argument("--model", help="model id (default: the server's first /v1/models entry)")
    bs.add_argument("--api-key", help="API key (default: $DSV4_API_KEY)")
    bs.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    bs.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    bs.add_argument("--json", action="store_true", help="print one JSON list instead of the table")
    bs.set_defaults(fn=cmd_bench_serve)
