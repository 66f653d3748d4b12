"""The OpenAI-compatible HTTP server (`dsv4 serve`): a Starlette app on an AsyncEngine.

Routes: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events
``data: {json}`` ending with ``data: [DONE]``, or one JSON body), GET /v1/models, GET /health,
GET /metrics (Prometheus text, vLLM's metric names). With an API key, the /v1 routes want
``Authorization: Bearer KEY`` (401 otherwise); /health and /metrics stay open, as in vLLM.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for every bad
request (checked before anything is queued), 401 for a wrong key, 503 with Retry-After when the
queue is full, 500 when the engine fails a request. A client that goes away (mid-stream or while
waiting for a whole answer) cancels its request, freeing its slot before the next step.

Torch-free: starlette, prometheus_client and the runtime.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .async_engine import AsyncEngine, Chunk, Overloaded, RequestHandle, RequestRecord
from .engine import EngineError, RequestError
from .sampling import MAX_LOGPROBS, SamplingParams

__all__ = ["build_app", "ServeMetrics", "ApiError"]

log = logging.getLogger("dsv4.serve")

FINISH_REASON = {"eos": "stop", "stop_token": "stop", "stop_string": "stop", "length": "length",
                 "max_seq_len": "length"}
MAX_STOP = 4  # OpenAI's limit on stop strings


class ApiError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type_
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param)


# --------------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------------

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


class ServeMetrics:
    """The Prometheus metrics, with vLLM's names (``vllm:`` prefix, label ``model_name``) so
    dashboards made for vLLM read them."""

    def __init__(self, aeng: AsyncEngine, model_name: str):
        disable_created_metrics()  # no *_created series (vLLM omits them too)
        self.registry = r = CollectorRegistry()
        lab = ["model_name"]
        self.model = model_name
        running = Gauge("vllm:num_requests_running", "Requests in the engine (holding a slot).", lab, registry=r)
        waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a slot.", lab, registry=r)
        running.labels(model_name).set_function(lambda: aeng.num_running)
        waiting.labels(model_name).set_function(lambda: aeng.num_waiting)
        h = lambda name, doc: Histogram(name, doc, lab, buckets=_LATENCY_BUCKETS, registry=r)  # noqa: E731
        self.ttft = h("vllm:time_to_first_token_seconds", "Time to first token (arrival to first token).")
        self.itl = h("vllm:inter_token_latency_seconds", "Time between consecutive tokens of a request.")
        self.tpot = h("vllm:request_time_per_output_token_seconds",
                      "Per request: (last token - first token) / (tokens - 1).")
        self.e2e = h("vllm:e2e_request_latency_seconds", "Arrival to the end of the request.")
        self.queue = h("vllm:request_queue_time_seconds", "Arrival to admission into the engine.")
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of admitted requests.", lab, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", lab, registry=r)
        self.finished = Counter("vllm:request_success", "Requests that ended, by finish reason "
                                "(stop, length, abort = cancelled or client gone, error).",
                                lab + ["finished_reason"], registry=r)
        self.rejected = Counter("dsv4:requests_rejected", "Requests refused, by HTTP status.",
                                lab + ["status"], registry=r)

    def observe(self, rec: RequestRecord) -> None:
        m = self.model
        if rec.queue_time is not None:
            self.queue.labels(m).observe(rec.queue_time)
            self.prompt_tokens.labels(m).inc(rec.prompt_tokens)
        if rec.ttft is not None:
            self.ttft.labels(m).observe(rec.ttft)
        for d in rec.inter_token_latencies:
            self.itl.labels(m).observe(d)
        n = rec.generated_tokens
        if n > 1:
            self.tpot.labels(m).observe((rec.token_times[-1] - rec.token_times[0]) / (n - 1))
        self.generation_tokens.labels(m).inc(n)
        if rec.e2e is not None:
            self.e2e.labels(m).observe(rec.e2e)
        reason = rec.finish_reason or "stop"
        self.finished.labels(m, FINISH_REASON.get(reason, reason)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


# --------------------------------------------------------------------------------------------
# request parsing (every failure is a 400 naming the field)
# --------------------------------------------------------------------------------------------

def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v > hi or v < lo or (lo_open and v == lo):
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise _bad(f"{name} must be a number in {rng}, got {v!r}", name)
    return float(v)


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo) or (hi is not None and v > hi):
        want = "an integer" + (f" >= {lo}" if lo is not None and hi is None else "") \
            + (f" in [{lo}, {hi}]" if lo is not None and hi is not None else "")
        raise _bad(f"{name} must be {want}, got {v!r}", name)
    return v


def _unsupported(body: dict) -> None:
    """Fields this server does not implement are refused when set to anything but their default."""
    for name in ("n", "best_of"):
        if body.get(name) not in (None, 1):
            raise _bad(f"only {name} = 1 is supported, got {body[name]!r}", name)
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise _bad(f"{name} is not supported", name)
    if body.get("logit_bias"):
        raise _bad("logit_bias is not supported", "logit_bias")
    if body.get("echo"):
        raise _bad("echo is not supported", "echo")
    if body.get("suffix"):
        raise _bad("suffix is not supported", "suffix")


def _sampling(body: dict, logprobs: int | None) -> tuple[SamplingParams, int | None]:
    """SamplingParams of an OpenAI body (plus vLLM's extras top_k, ignore_eos, stop_token_ids), and
    max_tokens as given (None: the endpoint's default)."""
    _unsupported(body)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise _bad(f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP or any(not isinstance(s, str) or not s for s in stop):
        raise _bad(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them, got {body.get('stop')!r}",
                   "stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in stop_ids):
        raise _bad("stop_token_ids must be a list of integers", "stop_token_ids")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _bad("ignore_eos must be a boolean", "ignore_eos")
    top_k = _int(body, "top_k", -1)  # vLLM: -1 (or 0) disables it
    try:
        params = SamplingParams(
            max_new_tokens=max_tokens or 1, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), top_k=max(top_k or 0, 0),
            seed=_int(body, "seed", 0), stop=tuple(stop), stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos,
            logprobs=logprobs)
    except ValueError as e:  # what the checks above do not cover
        raise _bad(str(e)) from None
    return params, max_tokens


def _prompt(body: dict) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p:
            raise _bad("prompt is empty", "prompt")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        raise _bad("batched prompts are not supported; send one prompt per request", "prompt")
    raise _bad("prompt must be a non-empty string or a non-empty list of token ids", "prompt")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise _bad(f"messages[{i}] must be an object with role system, user or assistant", "messages")
        c = m.get("content")
        if isinstance(c, list):  # content parts: text only
            if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str) for p in c):
                raise _bad(f"messages[{i}].content: only text parts are supported", "messages")
            c = "".join(p["text"] for p in c)
        if not isinstance(c, str):
            raise _bad(f"messages[{i}].content must be a string", "messages")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": c})
    return out


# --------------------------------------------------------------------------------------------
# responses
# --------------------------------------------------------------------------------------------

class _Stream(Response):
    """Server-sent events from ``events``; if the client goes away first (a disconnect message or
    a failed send), ``on_close`` cancels the request at once."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        # no Response.__init__: that would declare a Content-Length
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        self.events, self.on_close = events, on_close

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for ev in self.events:
                await send({"type": "http.response.body", "body": ev.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        pump_t = asyncio.create_task(pump())
        watch_t = asyncio.create_task(_disconnected(receive))
        try:
            await asyncio.wait({pump_t, watch_t}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (pump_t, watch_t):
                t.cancel()
            self.on_close()
            res = await asyncio.gather(pump_t, watch_t, return_exceptions=True)
            await self.events.aclose()
        if isinstance(res[0], Exception) and not isinstance(res[0], OSError):  # OSError: the client left
            log.error("stream failed: %r", res[0])


async def _disconnected(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _piece(c: Chunk, i: int, as_ids: bool) -> str:
    """How token ``i`` is named in logprobs: its text, or vLLM's "token_id:N" when asked."""
    return f"token_id:{i}" if as_ids else (c.pieces or {}).get(i, "")


def _completion_logprobs(chunks: list[Chunk], offset: int, as_ids: bool) -> dict:
    """OpenAI's completions logprobs object for these tokens (text_offset from ``offset``)."""
    tokens, lps, tops, offs = [], [], [], []
    for c in chunks:
        piece = _piece(c, c.token, as_ids)
        tokens.append(piece)
        lps.append(c.logprob)
        tops.append({_piece(c, i, as_ids): lp for i, lp in c.top_logprobs or []})
        offs.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def _chat_logprobs(chunks: list[Chunk], as_ids: bool) -> dict:
    def entry(c: Chunk, i: int, lp: float) -> dict:
        t = _piece(c, i, as_ids)
        return {"token": t, "logprob": lp, "bytes": list(t.encode())}

    return {"content": [{**entry(c, c.token, c.logprob),
                         "top_logprobs": [entry(c, i, lp) for i, lp in c.top_logprobs or []]} for c in chunks]}


# --------------------------------------------------------------------------------------------
# the app
# --------------------------------------------------------------------------------------------

def build_app(aeng: AsyncEngine, model_name: str, *, api_key: str | None = None) -> Starlette:
    """The ASGI app serving ``aeng`` (its loop starts and stops with the app's lifespan)."""
    eng = aeng.engine
    max_len = eng.config.max_seq_len
    metrics = ServeMetrics(aeng, model_name)
    prev_hook = aeng.on_finish

    def on_finish(rec: RequestRecord) -> None:
        metrics.observe(rec)
        if prev_hook is not None:
            prev_hook(rec)

    aeng.on_finish = on_finish
    created = int(time.time())

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                           "invalid_api_key")

    async def read_body(request: Request) -> dict:
        check_key(request)
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object", code="invalid_json")
        model = body.get("model")
        if model is not None and model != model_name:
            raise _bad(f"the model {model!r} does not exist; this server serves {model_name!r}", "model",
                       "model_not_found")
        return body

    async def start(prompt: str | list[int], params: SamplingParams, max_tokens: int | None,
                    default_max: Callable[[int], int], add_bos: bool) -> tuple[RequestHandle, SamplingParams]:
        try:
            ids = await aeng.prepare(prompt, params, add_bos=add_bos)
        except RequestError as e:
            code = "context_length_exceeded" if "longer than max_seq_len" in str(e) else "invalid_prompt"
            raise _bad(str(e), "prompt", code) from None
        n = max_tokens if max_tokens is not None else default_max(len(ids))
        try:
            eng.check_length(len(ids), n)  # the rule `dsv4 generate` applies too
        except RequestError as e:
            raise _bad(str(e), "max_tokens" if max_tokens is not None else "prompt", "context_length_exceeded") from None
        params = replace(params, max_new_tokens=n)
        try:
            return aeng.submit(ids, params), params
        except Overloaded as e:
            metrics.rejected.labels(model_name, "503").inc()
            raise ApiError(503, str(e), "server_overloaded", type_="server_error",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except EngineError as e:
            raise ApiError(503, str(e), "engine_unavailable", type_="server_error",
                           headers={"Retry-After": "5"}) from None

    async def collect(request: Request, h: RequestHandle) -> list[Chunk]:
        """All chunks of ``h``; cancels it if the client disconnects first."""
        async def run() -> list[Chunk]:
            return [c async for c in h]

        run_t = asyncio.create_task(run())
        watch_t = asyncio.create_task(_disconnected(request.receive))
        try:
            await asyncio.wait({run_t, watch_t}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch_t.cancel()
            if not run_t.done():
                h.cancel()
                run_t.cancel()
        try:
            return run_t.result()
        except asyncio.CancelledError:
            raise ApiError(499, "client disconnected", "client_closed") from None
        except EngineError as e:
            raise ApiError(500, str(e), "engine_error", type_="server_error") from None

    def usage(h: RequestHandle, n: int) -> dict:
        return {"prompt_tokens": len(h.prompt_ids), "completion_tokens": n,
                "total_tokens": len(h.prompt_ids) + n}

    async def events(h: RequestHandle, make: Callable[[Chunk | None, bool], list[dict]],
                     include_usage: bool, rid: str, obj: str) -> AsyncIterator[str]:
        n = 0
        try:
            for first in make(None, True):
                yield _sse(first)
            async for c in h:
                n += 1
                for o in make(c, False):
                    yield _sse(o)
        except EngineError as e:
            yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": "engine_error"}})
        if include_usage:
            yield _sse({"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                        "choices": [], "usage": usage(h, n)})
        yield "data: [DONE]\n\n"

    def stream_opts(body: dict) -> bool:
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise _bad("stream_options must be an object", "stream_options")
        return bool(so.get("include_usage"))

    def want_stream(body: dict) -> bool:
        s = body.get("stream", False)
        if not isinstance(s, bool):
            raise _bad("stream must be a boolean", "stream")
        return s

    async def completions(request: Request) -> Response:
        body = await read_body(request)
        stream = want_stream(body)
        lp = _int(body, "logprobs", 0, MAX_LOGPROBS)
        params, max_tokens = _sampling(body, lp)
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        prompt = _prompt(body)
        h, params = await start(prompt, params, max_tokens, lambda n: 16, add_bos=True)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": now, "model": model_name}
        if stream:
            offset = [0]

            def make(c: Chunk | None, first: bool) -> list[dict]:
                if first or (not c.text and lp is None and not c.finished):
                    return []
                ch = {"index": 0, "text": c.text, "logprobs": None,
                      "finish_reason": FINISH_REASON.get(c.stop_reason) if c.finished else None}
                if lp is not None:
                    ch["logprobs"] = _completion_logprobs([c], offset[0], as_ids)
                    offset[0] += sum(len(t) for t in ch["logprobs"]["tokens"])
                return [{**head, "choices": [ch]}]
            return _Stream(events(h, make, stream_opts(body), rid, "text_completion"), h.cancel)
        chunks = await collect(request, h)
        text = "".join(c.text for c in chunks)
        choice = {"index": 0, "text": text, "logprobs": _completion_logprobs(chunks, 0, as_ids) if lp is not None else None,
                  "finish_reason": FINISH_REASON.get(chunks[-1].stop_reason) if chunks else None}
        return JSONResponse({**head, "choices": [choice], "usage": usage(h, len(chunks))})

    async def chat_completions(request: Request) -> Response:
        body = await read_body(request)
        stream = want_stream(body)
        if not isinstance(body.get("logprobs", False), bool):
            raise _bad("logprobs must be a boolean for chat completions", "logprobs")
        top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
        lp = (top or 0) if body.get("logprobs") else None
        if top is not None and lp is None:
            raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
        params, max_tokens = _sampling(body, lp)
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        msgs = _messages(body)
        try:
            ids = await aeng.call(eng.apply_chat_template, msgs)
        except RequestError as e:
            raise _bad(str(e), "messages", "invalid_prompt") from None
        except EngineError:
            raise
        except Exception as e:  # the template refused these messages (jinja2 raises its own errors)
            raise _bad(f"cannot render the chat template for these messages: {e}", "messages",
                       "invalid_prompt") from None
        h, params = await start(ids, params, max_tokens, lambda n: max_len - n, add_bos=False)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if stream:
            head = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name}

            def make(c: Chunk | None, first: bool) -> list[dict]:
                if first:
                    return [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]}]
                if not c.text and lp is None and not c.finished:
                    return []
                ch = {"index": 0, "delta": {"content": c.text} if c.text else {},
                      "logprobs": _chat_logprobs([c], as_ids) if lp is not None else None,
                      "finish_reason": FINISH_REASON.get(c.stop_reason) if c.finished else None}
                return [{**head, "choices": [ch]}]
            return _Stream(events(h, make, stream_opts(body), rid, "chat.completion.chunk"), h.cancel)
        chunks = await collect(request, h)
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(c.text for c in chunks)},
                  "logprobs": _chat_logprobs(chunks, as_ids) if lp is not None else None,
                  "finish_reason": FINISH_REASON.get(chunks[-1].stop_reason) if chunks else None}
        return JSONResponse({"id": rid, "object": "chat.completion", "created": now, "model": model_name,
                             "choices": [choice], "usage": usage(h, len(chunks))})

    async def models(request: Request) -> Response:
        check_key(request)
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "dsv4",
             "max_model_len": max_len}]})

    async def health(request: Request) -> Response:
        if not aeng.alive:
            return JSONResponse({"status": "engine loop not running"}, status_code=503)
        return JSONResponse({"status": "ok", "running": aeng.num_running, "waiting": aeng.num_waiting})

    async def prometheus(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def api_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, ApiError):
            return exc.response()
        if isinstance(exc, HTTPException):
            return ApiError(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else "http_error",
                            headers=exc.headers).response()
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error",
                        type_="server_error").response()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await aeng.start()
        try:
            yield
        finally:
            await aeng.stop()

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", prometheus, methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={ApiError: api_error, HTTPException: api_error, Exception: api_error})
