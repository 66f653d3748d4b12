"""The OpenAI-compatible HTTP app (`dsv4 serve`): Starlette routes over an AsyncEngine.

Routes: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events
``data: {json}`` ending with ``data: [DONE]``, or one JSON body), GET /v1/models, GET /health,
GET /metrics (Prometheus text, vLLM's metric names). With an API key, the /v1 routes want
``Authorization: Bearer KEY`` (401 otherwise); /health and /metrics stay open, as in vLLM.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for every bad
request (checked before anything is queued; ``param`` names the field), 404 ``model_not_found``
for a model this server does not serve, 413 for a body over ``max_body_bytes`` (refused before it
is parsed), 401 for a wrong key, 503 with Retry-After when the queue is full, 500 when the engine
fails a request. A client that goes away (mid-stream or while waiting for a whole answer) cancels
its request, freeing its slot before the next step, and logs nothing.

Tokenizing and the chat template run on the engine thread (AsyncEngine.call), never on the event
loop, so /health and other requests stay responsive while a long prompt is encoded.

Torch-free: starlette, pydantic, prometheus_client and the runtime.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine import EngineError, RequestError
from ..sampling import SamplingParams, check_context
from .async_engine import AsyncEngine, Chunk, Overloaded, RequestHandle, RequestRecord
from .metrics import CONTENT_TYPE_LATEST, FINISH_REASON, ServeMetrics
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest, R, bad_request, parse

__all__ = ["build_app", "default_max_body_bytes", "OpenAIServer"]

log = logging.getLogger("dsv4.serve")

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def default_max_body_bytes(max_seq_len: int) -> int:
    """Room for a full-context prompt in its largest plausible JSON form (a few characters per
    token, each JSON-escaped to up to 6 bytes: 32 bytes a token) on top of 1 MiB for the other
    fields and long chats; 1 MiB + 8 KiB for a 256-token export, 33 MiB for a 1M-token one."""
    return (1 << 20) + 32 * max_seq_len


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it is known to exceed ``limit`` (from Content-Length, or while
    it streams in): an oversized body is never buffered whole nor parsed."""
    def too_large() -> ApiError:
        return ApiError(413, f"the request body exceeds this server's limit of {limit} bytes",
                        "request_too_large")

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large()
    buf = bytearray()
    async for part in request.stream():
        buf += part
        if len(buf) > limit:
            raise too_large()
    return bytes(buf)


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


def completion_logprobs(chunks: list[Chunk], offset: int, as_ids: bool) -> dict:
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


def chat_logprobs(chunks: list[Chunk], as_ids: bool) -> dict:
    def entry(c: Chunk, i: int, lp: float) -> dict:
        t = _piece(c, i, as_ids)
        return {"token": t, "logprob": lp, "bytes": list(t.encode())}

    return {"content": [{**entry(c, c.token, c.logprob),
                         "top_logprobs": [entry(c, i, lp) for i, lp in c.top_logprobs or []]} for c in chunks]}


def _finish_reason(chunks: list[Chunk]) -> str | None:
    return FINISH_REASON.get(chunks[-1].stop_reason) if chunks else None


class _CompletionChunks:
    """Streamed /v1/completions events, one per token (text and, when asked, its logprobs)."""

    def __init__(self, head: dict, lp: int | None, as_ids: bool):
        self.head, self.lp, self.as_ids, self.offset = head, lp, as_ids, 0

    def first(self) -> list[dict]:
        return []

    def __call__(self, c: Chunk) -> list[dict]:
        if not c.text and self.lp is None and not c.finished:
            return []
        ch = {"index": 0, "text": c.text, "logprobs": None,
              "finish_reason": FINISH_REASON.get(c.stop_reason) if c.finished else None}
        if self.lp is not None:
            ch["logprobs"] = completion_logprobs([c], self.offset, self.as_ids)
            self.offset += sum(len(t) for t in ch["logprobs"]["tokens"])
        return [{**self.head, "choices": [ch]}]


class _ChatChunks:
    """Streamed /v1/chat/completions events: the assistant role first, then one per token."""

    def __init__(self, head: dict, lp: int | None, as_ids: bool):
        self.head, self.lp, self.as_ids = head, lp, as_ids

    def first(self) -> list[dict]:
        return [{**self.head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]}]

    def __call__(self, c: Chunk) -> list[dict]:
        if not c.text and self.lp is None and not c.finished:
            return []
        ch = {"index": 0, "delta": {"content": c.text} if c.text else {},
              "logprobs": chat_logprobs([c], self.as_ids) if self.lp is not None else None,
              "finish_reason": FINISH_REASON.get(c.stop_reason) if c.finished else None}
        return [{**self.head, "choices": [ch]}]


# --------------------------------------------------------------------------------------------
# the server
# --------------------------------------------------------------------------------------------

class OpenAIServer:
    """The routes over one AsyncEngine serving one model; ``app()`` is the ASGI app."""

    def __init__(self, aeng: AsyncEngine, model_name: str, *, api_key: str | None = None,
                 max_body_bytes: int | None = None):
        self.aeng, self.model_name, self.api_key = aeng, model_name, api_key
        self.config = aeng.engine.config
        self.max_len = int(self.config.max_seq_len)
        self.max_body_bytes = max_body_bytes if max_body_bytes is not None else default_max_body_bytes(self.max_len)
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        self.metrics = ServeMetrics(aeng, model_name)
        self.created = int(time.time())
        self._prev_hook = aeng.on_finish
        aeng.on_finish = self._on_finish

    def _on_finish(self, rec: RequestRecord) -> None:
        self.metrics.observe(rec)
        if self._prev_hook is not None:
            self._prev_hook(rec)

    # ---- request intake --------------------------------------------------------------------
    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY)", "invalid_api_key")

    async def read(self, request: Request, model: type[R]) -> R:
        """The validated body: 401, 413, 400 (naming the field) or 404 (another model) otherwise."""
        self.check_key(request)
        req = parse(model, await read_body(request, self.max_body_bytes))
        if req.model != self.model_name:
            raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           "model_not_found", "model")
        return req

    def sampling(self, req: CompletionRequest | ChatCompletionRequest, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams, checked against this export (400 naming the field)."""
        try:
            params = req.sampling_params(logprobs)
        except RequestError as e:  # what the protocol's field checks leave to SamplingParams
            raise bad_request(str(e)) from None
        vocab = self.config.vocab_size
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"stop token id(s) {bad[:5]} out of range [0, {vocab})", "stop_token_ids")
        if params.stop and self.aeng.engine.tokenizer is None:
            raise bad_request("stop strings need a tokenizer; this export has none (use stop_token_ids)", "stop")
        return params

    async def start(self, prompt: str | list[int], params: SamplingParams, max_tokens: int | None,
                    default_max: Callable[[int], int], add_bos: bool) -> RequestHandle:
        """Tokenize (off the event loop), check the context, queue: the request's handle."""
        try:
            ids = await self.aeng.prepare(prompt, params, add_bos=add_bos)
        except RequestError as e:
            code = "context_length_exceeded" if "longer than max_seq_len" in str(e) else "invalid_prompt"
            raise bad_request(str(e), "prompt", code) from None
        n = max_tokens if max_tokens is not None else default_max(len(ids))
        try:
            check_context(len(ids), n, self.max_len)
        except RequestError as e:
            raise bad_request(str(e), "max_tokens" if max_tokens is not None else "prompt",
                              "context_length_exceeded") from None
        try:
            return self.aeng.submit(ids, replace(params, max_new_tokens=n))
        except Overloaded as e:
            raise ApiError(503, str(e), "server_overloaded", type_="server_error",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except EngineError as e:
            raise ApiError(503, str(e), "engine_unavailable", type_="server_error",
                           headers={"Retry-After": "5"}) from None

    # ---- answers ---------------------------------------------------------------------------
    async def collect(self, request: Request, h: RequestHandle) -> list[Chunk]:
        """All chunks of ``h``; if the client disconnects first, the request is cancelled and the
        answer is 499 (which nobody reads)."""
        async def run() -> list[Chunk]:
            return [c async for c in h]

        run_t = asyncio.create_task(run())
        watch_t = asyncio.create_task(_disconnected(request.receive))
        try:
            done, _ = await asyncio.wait({run_t, watch_t}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch_t.cancel()
            if not run_t.done():
                h.cancel()
                run_t.cancel()
            # wait for both to settle: a task's result() right after cancel() raises InvalidStateError
            await asyncio.gather(run_t, watch_t, return_exceptions=True)
        if run_t not in done or run_t.cancelled():
            raise ApiError(499, "client disconnected", "client_closed")
        err = run_t.exception()
        if isinstance(err, EngineError):
            raise ApiError(500, str(err), "engine_error", type_="server_error")
        if err is not None:
            raise err
        return run_t.result()

    def usage(self, h: RequestHandle, n: int) -> dict:
        return {"prompt_tokens": len(h.prompt_ids), "completion_tokens": n, "total_tokens": len(h.prompt_ids) + n}

    async def events(self, h: RequestHandle, make: _CompletionChunks | _ChatChunks, include_usage: bool,
                     head: dict) -> AsyncIterator[str]:
        n = 0
        try:
            for first in make.first():
                yield _sse(first)
            async for c in h:
                n += 1
                for o in make(c):
                    yield _sse(o)
        except EngineError as e:
            yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": "engine_error"}})
        if include_usage:
            yield _sse({**head, "created": int(time.time()), "choices": [], "usage": self.usage(h, n)})
        yield "data: [DONE]\n\n"

    # ---- routes ----------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req = await self.read(request, CompletionRequest)
        params = self.sampling(req, req.logprobs)
        h = await self.start(req.prompt, params, req.requested_max_tokens,
                             lambda n: COMPLETIONS_DEFAULT_MAX_TOKENS, add_bos=True)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        as_ids = req.return_tokens_as_token_ids
        if req.stream:
            return _Stream(self.events(h, _CompletionChunks(head, req.logprobs, as_ids), req.include_usage, head),
                           h.cancel)
        chunks = await self.collect(request, h)
        choice = {"index": 0, "text": "".join(c.text for c in chunks),
                  "logprobs": completion_logprobs(chunks, 0, as_ids) if req.logprobs is not None else None,
                  "finish_reason": _finish_reason(chunks)}
        return JSONResponse({**head, "choices": [choice], "usage": self.usage(h, len(chunks))})

    async def chat_template(self, req: ChatCompletionRequest) -> list[int]:
        """The messages rendered and tokenized on the engine thread (400 when they cannot be)."""
        msgs = [m.as_template_input() for m in req.messages]
        try:
            return await self.aeng.call(self.aeng.engine.apply_chat_template, msgs)
        except RequestError as e:
            raise bad_request(str(e), "messages", "invalid_prompt") from None
        except EngineError:
            raise
        except Exception as e:  # the template refused these messages (jinja2 raises its own errors)
            raise bad_request(f"cannot render the chat template for these messages: {e}", "messages",
                              "invalid_prompt") from None

    async def chat_completions(self, request: Request) -> Response:
        req = await self.read(request, ChatCompletionRequest)
        lp = req.n_logprobs
        params = self.sampling(req, lp)
        ids = await self.chat_template(req)
        h = await self.start(ids, params, req.requested_max_tokens, lambda n: self.max_len - n, add_bos=False)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        as_ids = req.return_tokens_as_token_ids
        if req.stream:
            head = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": self.model_name}
            return _Stream(self.events(h, _ChatChunks(head, lp, as_ids), req.include_usage, head), h.cancel)
        chunks = await self.collect(request, h)
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(c.text for c in chunks)},
                  "logprobs": chat_logprobs(chunks, as_ids) if lp is not None else None,
                  "finish_reason": _finish_reason(chunks)}
        return JSONResponse({"id": rid, "object": "chat.completion", "created": now, "model": self.model_name,
                             "choices": [choice], "usage": self.usage(h, len(chunks))})

    async def models(self, request: Request) -> Response:
        self.check_key(request)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "dsv4",
             "max_model_len": self.max_len, "vocab_size": int(self.config.vocab_size)}]})

    async def health(self, request: Request) -> Response:
        if not self.aeng.alive:
            return JSONResponse({"status": "engine loop not running"}, status_code=503)
        body = {"status": "ok", "running": self.aeng.num_running, "waiting": self.aeng.num_waiting}
        slots = getattr(self.aeng.engine, "slots", None)  # the Engine's allocator: a leaked slot shows here
        if slots is not None:
            body["slots_free"] = slots.n_free
        return JSONResponse(body)

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ---- errors and the app ----------------------------------------------------------------
    async def error(self, request: Request, exc: Exception) -> Response:
        """Every failure as OpenAI's error body; refusals of generation requests are counted."""
        if isinstance(exc, ApiError):
            err = exc
        elif isinstance(exc, HTTPException):
            err = ApiError(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else "http_error",
                           headers=exc.headers)
        else:
            log.exception("unhandled error in %s %s", request.method, request.url.path)
            err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error", type_="server_error")
        # 499 and engine_error end requests that were queued: their record counts them already
        if request.url.path in GENERATION_ROUTES and err.status != 499 and err.code != "engine_error":
            self.metrics.reject(err.status)
        return err.response()

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.aeng.start()
        try:
            yield
        finally:
            await self.aeng.stop()

    def app(self) -> Starlette:
        routes = [Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.prometheus, methods=["GET"])]
        return Starlette(routes=routes, lifespan=self.lifespan,
                         exception_handlers={ApiError: self.error, HTTPException: self.error, Exception: self.error})


def build_app(aeng: AsyncEngine, model_name: str, *, api_key: str | None = None,
              max_body_bytes: int | None = None) -> Starlette:
    """The ASGI app serving ``aeng`` (its loop starts and stops with the app's lifespan).
    max_body_bytes: the largest request body accepted (default: ``default_max_body_bytes``)."""
    return OpenAIServer(aeng, model_name, api_key=api_key, max_body_bytes=max_body_bytes).app()
