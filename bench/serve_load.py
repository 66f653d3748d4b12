"""`dsv4 bench serve`: load an OpenAI-compatible server and report what `vllm bench serve` reports.

For each concurrency level, ``requests`` streamed /v1/completions requests (random token-id
prompts of ``prompt_tokens``, greedy, ``max_tokens`` generated with ignore_eos) run with at most
that many in flight. Per request: TTFT (send to the first streamed text), ITL (the gaps between
streamed chunks), TPOT ((latency - TTFT) / (tokens - 1), tokens from the usage chunk) and E2EL
(send to [DONE]). Throughput is over the level's wall time. Needs httpx only (no torch), imported
when a run starts, so --help works without the serve extra.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field

__all__ = ["LevelResult", "run_bench", "format_table", "summarize", "build_parser", "main"]


@dataclass
class _One:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0


def summarize(xs: list[float]) -> dict[str, float]:
    """mean / p50 / p99 (linear interpolation between order statistics), in milliseconds."""
    if not xs:
        return {"mean_ms": float("nan"), "p50_ms": float("nan"), "p99_ms": float("nan")}
    s = sorted(xs)

    def pct(q: float) -> float:
        k = (len(s) - 1) * q
        lo = int(k)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"mean_ms": 1e3 * sum(s) / len(s), "p50_ms": 1e3 * pct(0.5), "p99_ms": 1e3 * pct(0.99)}


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    completed: int
    failed: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    ttft: dict
    tpot: dict
    itl: dict
    e2el: dict
    errors: list[str]

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def total_throughput(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.duration_s

    def to_json(self) -> dict:
        return {"concurrency": self.concurrency, "requests": self.requests, "completed": self.completed,
                "failed": self.failed, "duration_s": self.duration_s, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "request_throughput": self.request_throughput,
                "output_throughput": self.output_throughput, "total_token_throughput": self.total_throughput,
                "ttft": self.ttft, "tpot": self.tpot, "itl": self.itl, "e2el": self.e2el,
                "errors": self.errors[:5]}


async def _request(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> _One:
    import httpx

    r = _One()
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    r.ok = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    r.error = str(obj["error"].get("message"))
                    return r
                if obj.get("usage"):
                    r.prompt_tokens = obj["usage"]["prompt_tokens"]
                    r.output_tokens = obj["usage"]["completion_tokens"]
                if any(c.get("text") for c in obj.get("choices", [])):
                    now = time.perf_counter()
                    if last is None:
                        r.ttft = now - t0
                    else:
                        r.itl.append(now - last)
                    last = now
    except httpx.HTTPError as e:
        r.error = f"{type(e).__name__}: {e}"
        return r
    r.latency = time.perf_counter() - t0
    if r.ok and last is None:
        r.ok, r.error = False, "no text was streamed"
    return r


async def _level(base: str, model: str, concurrency: int, n: int, prompts: list[list[int]], max_tokens: int,
                 headers: dict, timeout: float) -> LevelResult:
    import httpx

    url = base + "/v1/completions"
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=concurrency + 1)

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def one(i: int) -> _One:
            body = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                    "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with sem:
                return await _request(client, url, body, headers)

        t0 = time.perf_counter()
        rs = await asyncio.gather(*(one(i) for i in range(n)))
        dur = time.perf_counter() - t0
    ok = [r for r in rs if r.ok]
    return LevelResult(
        concurrency=concurrency, requests=n, completed=len(ok), failed=n - len(ok), duration_s=dur,
        prompt_tokens=sum(r.prompt_tokens for r in ok), output_tokens=sum(r.output_tokens for r in ok),
        ttft=summarize([r.ttft for r in ok]),
        tpot=summarize([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        itl=summarize([d for r in ok for d in r.itl]), e2el=summarize([r.latency for r in ok]),
        errors=[r.error for r in rs if not r.ok])


def run_bench(url: str, concurrency: list[int], requests: int, *, max_tokens: int = 64, prompt_tokens: int = 32,
              id_limit: int | None = None,
              api_key: str | None = None, model: str | None = None, seed: int = 0,
              timeout: float = 600.0) -> list[LevelResult]:
    """One LevelResult per concurrency level (a warm-up request runs first). Prompt ids are drawn
    from [3, id_limit); id_limit None: the served model's vocabulary (``vocab_size`` in
    /v1/models, as dsv4 serve reports it), else 1000 for servers that do not report it."""
    import httpx

    base = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise OSError(f"cannot reach {base}: {e}") from None
    if r.status_code != 200:
        raise RuntimeError(f"{base}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    models = r.json()["data"]
    entry = next((m for m in models if m["id"] == model), models[0]) if model else models[0]
    model = model or entry["id"]
    if id_limit is None:
        id_limit = int(entry.get("vocab_size") or 1000)
    if id_limit < 4:
        raise ValueError(f"the prompt ids need an id limit of at least 4, got {id_limit}")
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, id_limit) for _ in range(prompt_tokens)] for _ in range(max(requests, 1))]

    async def main() -> list[LevelResult]:
        warm = await _level(base, model, 1, 1, prompts, min(max_tokens, 4), headers, timeout)
        if warm.failed:
            raise RuntimeError(f"warm-up request failed: {warm.errors[0]}")
        return [await _level(base, model, c, requests, prompts, max_tokens, headers, timeout) for c in concurrency]

    return asyncio.run(main())


def format_table(results: list[LevelResult]) -> str:
    """One column per concurrency level; rows: counts, throughput, mean/p50/p99 of each latency."""
    rows: list[tuple[str, list[str]]] = [
        ("completed / failed", [f"{r.completed} / {r.failed}" for r in results]),
        ("duration (s)", [f"{r.duration_s:.2f}" for r in results]),
        ("request throughput (req/s)", [f"{r.request_throughput:.2f}" for r in results]),
        ("output throughput (tok/s)", [f"{r.output_throughput:.1f}" for r in results]),
        ("total throughput (tok/s)", [f"{r.total_throughput:.1f}" for r in results]),
    ]
    for m, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        for s, sname in (("mean_ms", "mean"), ("p50_ms", "p50"), ("p99_ms", "p99")):
            rows.append((f"{name} {sname} (ms)", [f"{getattr(r, m)[s]:.1f}" for r in results]))
    w = max(10, *(len(c) for _, cs in rows for c in cs))
    lines = [f"{'concurrency':<28}" + "".join(f"{r.concurrency:>{w + 2}}" for r in results)]
    lines += [f"{label:<28}" + "".join(f"{c:>{w + 2}}" for c in cells) for label, cells in rows]
    for r in results:
        for e in r.errors[:3]:
            lines.append(f"concurrency {r.concurrency} error: {e}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `dsv4 bench serve` (the CLI tree adds them to its subcommand); the defaults are
    run_bench's own, so they live in one place."""
    d = {k: v.default for k, v in inspect.signature(run_bench).parameters.items()}
    p.add_argument("url", metavar="URL", help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=d["max_tokens"], help="tokens each request generates (ignore_eos)")
    p.add_argument("--prompt-tokens", type=int, default=d["prompt_tokens"],
                   help="prompt length in tokens (random ids in [3, --id-limit), sent to /v1/completions)")
    p.add_argument("--id-limit", type=int, default=d["id_limit"],
                   help="prompt token ids are below this (default: the vocabulary the server reports in /v1/models)")
    p.add_argument("--model", help="model id (default: the server's first /v1/models entry)")
    p.add_argument("--api-key", help="API key (default: $DSV4_API_KEY)")
    p.add_argument("--seed", type=int, default=d["seed"], help="seed of the random prompts")
    p.add_argument("--timeout", type=float, default=d["timeout"], help="seconds one request may take")
    p.add_argument("--json", action="store_true", help="print one JSON list instead of the table")
    p.set_defaults(fn=run_from_args)
    return p


DESCRIPTION = ("Send --requests completions at each --concurrency level to a running `dsv4 serve` (or any "
               "OpenAI-compatible server) and print TTFT, TPOT, ITL, latency and throughput per level.")


def run_from_args(args: argparse.Namespace) -> int:
    """Run the load the parsed options describe; print a table (or JSON). Exit status: 0, 1 when a
    request failed, 2 on bad options or an unreachable server."""

    def fail(msg: str) -> int:
        print(f"dsv4 bench serve: error: {msg}", file=sys.stderr)
        return 2

    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        return fail(f"--concurrency expects comma-separated integers, got {args.concurrency!r}")
    if (not levels or min(levels) < 1 or args.requests < 1 or args.max_tokens < 1
            or (args.id_limit is not None and args.id_limit < 4)):
        return fail("--concurrency levels, --requests and --max-tokens must be positive, --id-limit at least 4")
    try:
        results = run_bench(args.url, levels, args.requests, max_tokens=args.max_tokens,
                            prompt_tokens=args.prompt_tokens, id_limit=args.id_limit, model=args.model,
                            api_key=args.api_key or os.environ.get("DSV4_API_KEY") or None, seed=args.seed,
                            timeout=args.timeout)
    except ModuleNotFoundError as e:
        return fail(f"needs the 'serve' extra ({e.name} is not installed): pip install 'dsv4-iree[serve]'")
    except (OSError, RuntimeError, ValueError) as e:
        return fail(str(e))
    print(json.dumps([r.to_json() for r in results], indent=1) if args.json else format_table(results))
    return 0 if all(r.failed == 0 for r in results) else 1  # a failed request fails the run


def main(argv: list[str] | None = None) -> int:
    """`python -m dsv4.bench.serve_load URL ...`, the same as `dsv4 bench serve URL ...`."""
    p = argparse.ArgumentParser(prog="dsv4 bench serve", description=DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    args = add_arguments(p).parse_args(sys.argv[1:] if argv is None else argv)
    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
