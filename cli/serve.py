"""`dsv4 serve`: the OpenAI-compatible server. Needs the `serve` extra (starlette, uvicorn,
prometheus_client, jinja2, httpx); nothing here needs torch."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

from . import add_command, fail

__all__ = ["add_parser", "cmd_serve"]

DESCRIPTION = """\
Serve an export over HTTP with the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models;
streaming, logprobs, stop strings, seeds), plus /health and Prometheus /metrics. Requests share the
export's slots by continuous batching (as many run at once as the export has slots: config.json
n_slots); beyond that up to --max-queue wait, and further ones get 503 with Retry-After.
SIGTERM/SIGINT stop accepting requests, give in-flight ones --drain-timeout seconds, and exit 0.

example:
  dsv4 serve out/default --port 8000 &
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "default", "prompt": "The list", "max_tokens": 16}'
"""



def cmd_serve(args: argparse.Namespace) -> int:
    """Load the export, then serve it until SIGINT/SIGTERM (in-flight requests get --drain-timeout
    seconds to finish, then are cancelled; the exit status is 0)."""
    # a missing starlette/uvicorn/... is reported by dsv4.cli as "needs the 'serve' extra"
    import uvicorn

    from dsv4.runtime.serve.app import build_app
    from dsv4.runtime.serve.async_engine import AsyncEngine
    from dsv4.runtime.engine import Engine, EngineError

    if args.max_queue < 0:
        return fail("serve", f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        return fail("serve", f"--max-body-bytes must be positive, got {args.max_body_bytes}")
    api_key = args.api_key or os.environ.get("DSV4_API_KEY") or None
    try:
        eng = Engine(args.export_dir, device=args.device, device_index=args.device_index,
                     devices=args.devices, batch_invariant=not args.pack_calls)
        aeng = AsyncEngine(eng, max_queue=args.max_queue, speculative=args.speculative == "mtp")
    except EngineError as e:
        return fail("serve", str(e))
    name = args.served_model_name or Path(args.export_dir).resolve().name
    app = build_app(aeng, name, api_key=api_key, max_body_bytes=args.max_body_bytes)
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


def add_parser(subparsers: Any, name: str = "serve") -> argparse.ArgumentParser:
    s = add_command(subparsers, name, description=DESCRIPTION)
    s.add_argument("export_dir", metavar="OUT", help="export directory (config.json, the .irpa weight shards, a vmfb "
                                                     "per target)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only; "
                                                       "0.0.0.0 for every interface)")
    s.add_argument("--port", type=int, default=8000, help="TCP port")
    s.add_argument("--device", default="local-task", choices=["local-task", "local-sync", "cuda", "hip"],
                   help="IREE driver: local-task/local-sync run the llvm-cpu vmfb, cuda the cuda one, hip the "
                        "gfx942 one")
    s.add_argument("--device-index", type=int, default=0, help="which GPU")
    s.add_argument("--devices", type=int, default=None, metavar="N",
                   help="devices of a multi-device export (default: the export's count)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a slot; beyond that the answer is 503 with Retry-After")
    s.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                   help="largest request body accepted, larger ones get 413 (default: 1 MiB + 32 bytes per "
                        "context position)")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (default: $DSV4_API_KEY)")
    s.add_argument("--speculative", choices=["mtp"], default=None,
                   help="requests without logprobs decode with the export's MTP drafts: greedy ones the same "
                        "tokens, sampled ones by the speculative-sampling rule (each token distributed as plain "
                        "sampling's), fewer decode calls; needs an export made with --draft-tokens K; /metrics "
                        "counts vllm:spec_decode_num_draft_tokens and _accepted_tokens")
    s.add_argument("--pack-calls", action="store_true",
                   help="pack concurrent requests' prefills and speculative verify calls into the exported batch "
                        "sizes (fewer calls; a request's logits may then differ in the last bits with the company). "
                        "Default: one request per prefill and verify call, so a request's results do not depend "
                        "on what else runs")
    s.add_argument("--served-model-name", help="the model id clients send (default: the export directory's name)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT before they are cancelled")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    s.add_argument("--access-log", action="store_true", help="log every request")
    s.set_defaults(fn=cmd_serve)
    return s
