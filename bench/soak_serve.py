"""Soak `dsv4 serve`: a bounded burst of mixed, misbehaving clients, then check the server is whole.

Starts `dsv4 serve EXPORT` on 127.0.0.1 (a free port; loopback only), measures a few greedy
prompts alone, then sends --requests requests (arriving at --rate a second, at most --concurrency
at once, no new ones after --max-seconds; a 503 is retried after its Retry-After, as the openai
client does) drawn at random (--seed) from: greedy prompts (streamed or not; their tokens
must equal the ones measured alone), sampled requests with stop strings, chat requests, clients
that hang up mid-request (streaming or not), and bad requests (bad JSON, missing or unknown model,
bad fields, a context overrun, a 20 MB body). With a small --max-queue bursts meet a full queue
(503). Afterwards:

* every slot is free (/health: nothing running or waiting, the Engine's allocator all free) and
  the greedy prompts run concurrently still give their solo tokens;
* the server log holds no traceback and no ERROR line;
* /metrics adds up: every generation request is counted once, in vllm:request_success (by
  reason) or dsv4:requests_rejected (by status), and the rejections by status equal what the
  clients saw;
* SIGTERM stops the server with exit status 0.

Prints the figures (requests, answers by status, hang-ups, slots free, tracebacks, client-side
TTFT p50/p99 of the streamed requests) and one JSON line; exits 1 if a check fails.

    python -m dsv4.bench.soak_serve OUT [--requests 1000] [--rate 5] [--concurrency 16] [--max-queue 2]

OUT: an export with a tokenizer (stop strings and chat need one), e.g.
`dsv4 export --target llvm-cpu --batch-sizes 1,4 --max-seq-len 256 -o OUT`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

MODEL = "soak"
GREEDY_PROMPTS = ["The list data type has some more methods.", "A function definition", "Tuples are immutable",
                  "A set is an unordered collection", "Dictionaries are indexed by keys", "Looping techniques",
                  "The del statement", "Strings can be concatenated"]
GREEDY_TOKENS = 12
MAX_ATTEMPTS = 4  # a request that meets a full queue is sent again after Retry-After, at most this often


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dsv4() -> str:
    exe = Path(sys.executable).with_name("dsv4")
    return str(exe) if exe.exists() else (shutil.which("dsv4") or "dsv4")


def _metrics(text: str) -> dict[str, float]:
    """Prometheus text as {'name{label="v",...}': value}, labels sorted, model_name dropped."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name, _, labels = series.partition("{")
            kept = sorted(lab for lab in re.findall(r'\w+="[^"]*"', labels) if not lab.startswith("model_name="))
            out[name + ("{" + ",".join(kept) + "}" if kept else "")] = float(value)
    return out


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class Soak:
    def __init__(self, base: str, args: argparse.Namespace, max_len: int):
        self.base, self.args, self.max_len = base, args, max_len
        self.rng = random.Random(args.seed)
        self.outcomes: Counter[str] = Counter()  # "200", "400", ..., "hung_up"
        self.kinds: Counter[str] = Counter()
        self.ttft: list[float] = []
        self.failures: list[str] = []
        self.reference: dict[str, list[str]] = {}
        self.retries = 0  # requests sent again after a 503
        self.health_during_huge: list[float] = []  # /health latency while a 20 MB body is sent

    # ---- one request -----------------------------------------------------------------------
    async def send(self, client: httpx.AsyncClient, path: str, body: dict | bytes, stream: bool,
                   hang_up_after: float | None = None) -> tuple[int | None, dict | list | None]:
        """(status, body or the list of streamed events); status None: we hung up first."""
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        retry_after: list[str | None] = [None]

        async def go() -> tuple[int, dict | list]:
            t0 = time.perf_counter()
            async with client.stream("POST", self.base + path, content=content,
                                     headers={"content-type": "application/json"}) as r:
                status[0] = r.status_code
                retry_after[0] = r.headers.get("retry-after")
                if r.status_code != 200 or not stream:
                    return r.status_code, json.loads(await r.aread())
                events, first = [], None
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        events.append(data)
                        break
                    ev = json.loads(data)
                    events.append(ev)
                    if first is None and ev.get("choices") and (ev["choices"][0].get("text")
                                                                or ev["choices"][0].get("delta", {}).get("content")):
                        first = time.perf_counter() - t0
                if first is not None:
                    self.ttft.append(first)
                return r.status_code, events

        for attempt in range(MAX_ATTEMPTS):
            status: list[int | None] = [None]
            try:
                if hang_up_after is None:
                    status[0], got = await go()
                else:
                    status[0], got = await asyncio.wait_for(go(), hang_up_after)
            except asyncio.TimeoutError:  # we hung up; the status if the server had answered already
                return status[0], None
            if status[0] != 503 or attempt == MAX_ATTEMPTS - 1:
                return status[0], got
            # a full queue: wait as told, then try again (what the openai client does)
            self.outcomes["503"] += 1
            self.retries += 1
            await asyncio.sleep(float(retry_after[0] or 1))
        raise AssertionError("unreachable")

    @staticmethod
    def text_of(events: list) -> str:
        out = []
        for ev in events:
            if isinstance(ev, dict):
                for c in ev.get("choices", []):
                    out.append(c.get("text") or c.get("delta", {}).get("content") or "")
        return "".join(out)

    # ---- the kinds of request ----------------------------------------------------------------
    async def greedy(self, client: httpx.AsyncClient) -> None:
        prompt = self.rng.choice(GREEDY_PROMPTS)
        stream = self.rng.random() < 0.5
        body = {"model": MODEL, "prompt": prompt, "max_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": stream, "logprobs": 0, "return_tokens_as_token_ids": True}
        status, got = await self.send(client, "/v1/completions", body, stream)
        self.outcomes[str(status)] += 1
        if status != 200:
            return
        if stream:
            toks = [t for ev in got if isinstance(ev, dict) for c in ev["choices"] for t in c["logprobs"]["tokens"]]
        else:
            toks = got["choices"][0]["logprobs"]["tokens"]
        if toks != self.reference[prompt]:
            self.failures.append(f"greedy {prompt!r} under load: {toks} != alone {self.reference[prompt]}")

    async def sampled_with_stop(self, client: httpx.AsyncClient) -> None:
        stop = self.rng.choice([["e"], [" the", "."], ["\n"]])
        stream = self.rng.random() < 0.5
        body = {"model": MODEL, "prompt": self.rng.choice(GREEDY_PROMPTS), "max_tokens": self.rng.randint(4, 24),
                "temperature": 0.8, "top_p": 0.95, "seed": self.rng.randrange(1 << 30), "stop": stop,
                "stream": stream}
        status, got = await self.send(client, "/v1/completions", body, stream)
        self.outcomes[str(status)] += 1
        if status == 200:
            text = self.text_of(got) if stream else got["choices"][0]["text"]
            if any(s in text for s in stop):
                self.failures.append(f"stop {stop} appears in the returned text {text!r}")

    async def chat(self, client: httpx.AsyncClient) -> None:
        stream = self.rng.random() < 0.5
        body = {"model": MODEL, "messages": [{"role": "user", "content": self.rng.choice(GREEDY_PROMPTS)}],
                "max_tokens": self.rng.randint(2, 16), "stream": stream,
                "stream_options": {"include_usage": True} if stream else None}
        status, got = await self.send(client, "/v1/chat/completions", body, stream)
        self.outcomes[str(status)] += 1
        if status == 200 and stream and got[-1] != "[DONE]":
            self.failures.append("a chat stream did not end with [DONE]")

    async def hang_up(self, client: httpx.AsyncClient) -> None:
        stream = self.rng.random() < 0.5
        body = {"model": MODEL, "prompt": self.rng.choice(GREEDY_PROMPTS), "max_tokens": 200, "ignore_eos": True,
                "stream": stream}
        status, _ = await self.send(client, "/v1/completions", body, stream,
                                    hang_up_after=self.rng.uniform(0.05, 0.6))
        self.outcomes["hung_up" if status in (None, 200) else str(status)] += 1

    async def bad(self, client: httpx.AsyncClient) -> None:
        c, chat = "/v1/completions", "/v1/chat/completions"
        ok = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
        cases = [(c, b"{not json", 400), (c, {"prompt": "Hello"}, 400), (c, {**ok, "model": "gpt-4"}, 404),
                 (c, {**ok, "max_tokens": 0}, 400), (c, {**ok, "temperature": -1}, 400),
                 (c, {**ok, "stop_token_ids": [-1]}, 400), (c, {**ok, "max_tokens": self.max_len}, 400),
                 (c, {**ok, "prompt": [1, 10 ** 9]}, 400), (chat, {"model": MODEL, "messages": "hi"}, 400)]
        if self.rng.random() < 0.05:
            path, body, want = c, json.dumps({**ok, "prompt": "a" * 20_000_000}).encode(), 413
        else:
            path, body, want = self.rng.choice(cases)
        if want == 413:  # the server must stay responsive while a huge body arrives
            async def health() -> float:
                await asyncio.sleep(0.02)
                t0 = time.perf_counter()
                await client.get(self.base + "/health")
                return time.perf_counter() - t0
            (status, got), waited = await asyncio.gather(self.send(client, path, body, False), health())
            self.health_during_huge.append(waited)
        else:
            status, got = await self.send(client, path, body, False)
        self.outcomes[str(status)] += 1
        if status != want or "error" not in (got or {}):
            self.failures.append(f"bad request {str(body)[:80]} got {status} (wanted {want}): {str(got)[:200]}")

    # ---- phases --------------------------------------------------------------------------------
    async def measure_alone(self, client: httpx.AsyncClient) -> None:
        for p in GREEDY_PROMPTS:
            body = {"model": MODEL, "prompt": p, "max_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True,
                    "logprobs": 0, "return_tokens_as_token_ids": True}
            r = await client.post(self.base + "/v1/completions", json=body)
            r.raise_for_status()
            self.reference[p] = r.json()["choices"][0]["logprobs"]["tokens"]

    async def load(self) -> float:
        kinds = [(self.greedy, 0.3), (self.sampled_with_stop, 0.2), (self.chat, 0.15), (self.hang_up, 0.15),
                 (self.bad, 0.2)]
        fns, weights = zip(*kinds)
        plan = self.rng.choices(fns, weights, k=self.args.requests)
        sem = asyncio.Semaphore(self.args.concurrency)
        t0 = time.perf_counter()
        limits = httpx.Limits(max_connections=self.args.concurrency + 4)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            await self.measure_alone(client)

            async def one(fn) -> None:
                async with sem:
                    self.kinds[fn.__name__] += 1
                    await fn(client)

            # arrivals at --rate a second on average (exponential gaps), at most --concurrency in flight
            tasks = []
            for fn in plan:
                if time.perf_counter() - t0 > self.args.max_seconds:
                    break
                tasks.append(asyncio.create_task(one(fn)))
                await asyncio.sleep(self.rng.expovariate(self.args.rate))
            await asyncio.gather(*tasks)
        return time.perf_counter() - t0

    async def after(self) -> dict:
        async with httpx.AsyncClient(timeout=120) as client:
            deadline = time.monotonic() + 30
            while True:
                h = (await client.get(self.base + "/health")).json()
                if (h["running"], h["waiting"]) == (0, 0) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            # all slots at once: the greedy prompts together still give their solo tokens
            async def one(p: str) -> list[str]:
                body = {"model": MODEL, "prompt": p, "max_tokens": GREEDY_TOKENS, "temperature": 0,
                        "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}
                status, got = await self.send(client, "/v1/completions", body, False)  # 503s are retried
                if status != 200:
                    self.failures.append(f"after the soak, {p!r} got {status}: {str(got)[:200]}")
                    return []
                return got["choices"][0]["logprobs"]["tokens"]
            together = await asyncio.gather(*(one(p) for p in GREEDY_PROMPTS))
            for p, toks in zip(GREEDY_PROMPTS, together):
                if toks != self.reference[p]:
                    self.failures.append(f"after the soak, {p!r} together: {toks} != alone {self.reference[p]}")
            h_end = (await client.get(self.base + "/health")).json()
            m = _metrics((await client.get(self.base + "/metrics")).text)
        return {"health": h, "health_end": h_end, "metrics": m}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export_dir", metavar="OUT", help="export directory (with a tokenizer)")
    ap.add_argument("--requests", type=int, default=1000, help="requests to send (default 1000)")
    ap.add_argument("--rate", type=float, default=5.0,
                    help="new requests a second on average (default 5: 1,000 requests take 3-4 minutes)")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight at most (default 16)")
    ap.add_argument("--max-queue", type=int, default=2, help="the server's --max-queue (default 2: bursts meet 503)")
    ap.add_argument("--max-seconds", type=float, default=600.0,
                    help="stop sending new requests after this many seconds (default 600)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the request mix (default 0)")
    ap.add_argument("--log", type=Path, help="keep the server's log here (default: a temporary file)")
    args = ap.parse_args(argv)

    cfg = json.loads((Path(args.export_dir) / "config.json").read_text())
    port = _free_port()
    log_path = args.log or Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([_dsv4(), "serve", args.export_dir, "--host", "127.0.0.1", "--port", str(port),
                                 "--served-model-name", MODEL, "--max-queue", str(args.max_queue)],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                print(log_path.read_text(), file=sys.stderr)
                print(f"soak: the server exited with {proc.returncode} before it answered", file=sys.stderr)
                return 1
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                print("soak: the server did not come up in 300 s", file=sys.stderr)
                return 1
            time.sleep(0.5)
        soak = Soak(base, args, int(cfg["max_seq_len"]))
        duration = asyncio.run(soak.load())
        end = asyncio.run(soak.after())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()

    sent = sum(soak.kinds.values())
    m = end["metrics"]
    finished = {k[k.index('"') + 1:-2]: v for k, v in m.items() if k.startswith("vllm:request_success_total")}
    rejected = {k[k.index('"') + 1:-2]: v for k, v in m.items() if k.startswith("dsv4:requests_rejected_total")}
    # the measuring requests (alone and together) are generation requests too
    counted = sum(finished.values()) + sum(rejected.values())
    expected = sent + soak.retries + 2 * len(GREEDY_PROMPTS)
    if counted != expected:
        soak.failures.append(f"/metrics counts {counted} generation requests, {expected} were sent")
    for status in ("400", "404", "413", "503"):
        if rejected.get(status, 0) != soak.outcomes.get(status, 0):
            soak.failures.append(f"/metrics rejected {status}: {rejected.get(status, 0)}, "
                                 f"the clients saw {soak.outcomes.get(status, 0)}")
    if soak.outcomes.get("500"):
        soak.failures.append(f"{soak.outcomes['500']} requests got 500")
    log_text = log_path.read_text()
    tracebacks = log_text.count("Traceback")
    errors = [ln for ln in log_text.splitlines() if "ERROR" in ln]
    if tracebacks or errors:
        soak.failures.append(f"the server log has {tracebacks} traceback(s) and {len(errors)} ERROR line(s): "
                             f"{errors[:3]}")
    h = end["health_end"]
    n_slots = int(cfg["n_slots"])
    if (h["running"], h["waiting"], h.get("slots_free")) != (0, 0, n_slots):
        soak.failures.append(f"after the soak /health says {h} ({n_slots} slots)")
    if rc != 0:
        soak.failures.append(f"the server exited with {rc} after SIGTERM")
    if soak.health_during_huge and max(soak.health_during_huge) >= 1.0:
        soak.failures.append(f"/health took {max(soak.health_during_huge):.2f} s while a 20 MB body arrived")

    summary = {"requests": sent, "planned": args.requests, "resent_after_503": soak.retries, "duration_s": round(duration, 1),
               "by_kind": dict(soak.kinds), "answers": dict(sorted(soak.outcomes.items())),
               "metrics_finished": finished, "metrics_rejected": rejected,
               "slots_free": f"{h.get('slots_free')}/{n_slots}", "tracebacks": tracebacks, "error_lines": len(errors),
               "ttft_p50_ms": round(1e3 * _pct(soak.ttft, 0.5), 1), "ttft_p99_ms": round(1e3 * _pct(soak.ttft, 0.99), 1),
               "streams_timed": len(soak.ttft),
               "health_during_20mb_max_ms": round(1e3 * max(soak.health_during_huge, default=float("nan")), 1), "exit_status": rc, "failures": soak.failures[:20],
               "log": str(log_path)}
    print(f"requests {sent} (+{soak.retries} sent again after a 503) in {duration:.1f} s (rate {args.rate}/s, "
          f"concurrency {args.concurrency}, max queue {args.max_queue}); "
          f"answers {dict(sorted(soak.outcomes.items()))}")
    print(f"slots free {summary['slots_free']}, tracebacks {tracebacks}, ERROR lines {len(errors)}, "
          f"TTFT p50 {summary['ttft_p50_ms']} ms, p99 {summary['ttft_p99_ms']} ms over {len(soak.ttft)} streams")
    print(f"/metrics: finished {finished}, rejected {rejected}")
    for f in soak.failures:
        print("FAIL:", f)
    print(json.dumps(summary))
    return 1 if soak.failures else 0


if __name__ == "__main__":
    sys.exit(main())
