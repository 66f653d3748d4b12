"""AsyncEngine: the Engine for services that run their own asyncio event loop.

One engine-loop task owns the Engine. Each turn of the loop runs one *tick* in a single worker
thread (so the event loop stays responsive while the device computes): apply the cancellations
asked for since the last tick, submit waiting requests while slots are free, run ``Engine.step()``,
and take the results of the requests that finished. The loop then hands each request its chunks
through its own asyncio queue. Requests therefore join and leave between steps (continuous
batching), and every Engine call happens on that one thread (the Engine is not thread-safe).

Admission is bounded: at most ``n_slots`` requests are in the Engine, at most ``max_queue`` more
wait here; past that ``submit`` raises ``Overloaded`` at once (a server answers 503). A request
that fails (a bad prompt, or an Engine step that raises) fails alone: its consumer gets the
EngineError, the requests in that step are cancelled in the Engine (their slots freed), and the
loop goes on.

Torch-free: only the Engine's public API (submit / step / cancel / result / has_work / encode /
decode / apply_chat_template / check_ids / config) is used.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from ..engine import Engine, EngineError, RequestError, StreamChunk
from ..sampling import SamplingParams

__all__ = ["AsyncEngine", "Chunk", "Overloaded", "RequestHandle", "RequestRecord"]

log = logging.getLogger("dsv4.serve")


class Overloaded(EngineError):
    """Every slot is busy and the waiting queue is full; retry after ``retry_after`` seconds."""

    def __init__(self, msg: str, retry_after: int = 1):
        super().__init__(msg)
        self.retry_after = retry_after


@dataclass
class Chunk:
    """One generated token: the Engine's StreamChunk fields, and (when the request asked for
    logprobs) ``pieces``, the text of the token and of each top alternative, by id."""

    token: int
    text: str
    finished: bool
    stop_reason: str | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    pieces: dict[int, str] | None = None


@dataclass
class RequestRecord:
    """Timings (``time.perf_counter`` seconds) and counts of one request, for metrics.

    finish_reason: the Engine's stop reason, "abort" (cancelled) or "error"."""

    prompt_tokens: int
    t_arrival: float
    t_admitted: float | None = None
    token_times: list[float] = field(default_factory=list)
    t_finished: float | None = None
    finish_reason: str | None = None
    verify_calls: int = 0  # speculative requests that finished: their verify calls, drafts and accepted ones
    drafted: int = 0
    accepted: int = 0

    @property
    def generated_tokens(self) -> int:
        return len(self.token_times)

    @property
    def queue_time(self) -> float | None:
        return None if self.t_admitted is None else self.t_admitted - self.t_arrival

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.t_arrival if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.t_finished is None else self.t_finished - self.t_arrival

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


_END = object()  # queue sentinel: the request finished (or was cancelled)


class RequestHandle:
    """A submitted request: an async iterator of its Chunks. ``cancel()`` drops it (its slot is
    freed before the next Engine step); leaving the iteration early does the same."""

    def __init__(self, owner: "AsyncEngine", ids: list[int], params: SamplingParams):
        self._owner = owner
        self.prompt_ids = ids
        self.params = params
        self.record = RequestRecord(prompt_tokens=len(ids), t_arrival=time.perf_counter())
        self.engine_id: int | None = None  # set by the tick that submits it to the Engine
        self.done = False
        self._queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self) -> "RequestHandle":
        return self

    async def __anext__(self) -> Chunk:
        if self.done and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        """Drop the request if it has not finished; a no-op afterwards."""
        self._owner._cancel(self)

    def _finish(self, reason: str, t: float, error: BaseException | None = None) -> None:
        if self.done:
            return
        self.done = True
        self.record.finish_reason = reason
        self.record.t_finished = t
        self._queue.put_nowait(error if error is not None else _END)
        self._owner._finished(self)


class AsyncEngine:
    """Drives an Engine from asyncio; see the module docstring.

    Use ``async with AsyncEngine(engine) as aeng:`` (or ``await start()`` / ``await stop()``), then
    ``async for chunk in aeng.generate(prompt, params): ...``. ``on_finish(record)`` is called on
    the event loop for every request that ends (finished, cancelled or failed).
    """

    def __init__(self, engine: Engine, *, max_queue: int = 64,
                 on_finish: Callable[[RequestRecord], None] | None = None, speculative: bool = False):
        """``speculative``: every request without logprobs, greedy or sampled, decodes with the export's
        MTP drafts (SamplingParams.speculative); requests with logprobs decode as before. EngineError when the export has
        no speculative entry points."""
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if speculative and getattr(engine, "draft_tokens", None) is None:
            raise EngineError("this export has no speculative entry points (mtp_prefill, verify): "
                              "export it with `dsv4 export --draft-tokens K` to serve with speculation")
        self.speculative = speculative
        self._spec_counts: dict[int, tuple[int, int, int]] = {}  # engine id -> (verify calls, drafted, accepted)
        self.engine = engine
        self.n_slots = int(engine.config.n_slots)
        self.max_queue = max_queue
        self.on_finish = on_finish
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv4-engine")
        self._waiting: deque[RequestHandle] = deque()
        self._running: dict[int, RequestHandle] = {}  # engine request id -> handle
        self._admitting: list[RequestHandle] = []  # taken from _waiting by the tick in flight
        self._cancels: list[int] = []  # engine ids to cancel at the next tick
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closing = False
        self.failed_steps = 0

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._loop(), name="dsv4-engine-loop")

    async def stop(self) -> None:
        """Cancel whatever is still waiting or running, end the loop and its thread."""
        self._closing = True
        for h in list(self._waiting) + self._admitting + list(self._running.values()):
            h.cancel()
        if self._task is not None:
            self._wake.set()
            await self._task
            self._task = None
        self._pool.shutdown(wait=True)

    async def __aenter__(self) -> "AsyncEngine":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def num_running(self) -> int:
        # the requests of the admission tick in flight count too (cancelled ones leave at the next tick)
        return len(self._running) + sum(not h.done for h in self._admitting)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ---- engine calls on the engine thread ---------------------------------------------------
    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the engine thread (between steps): tokenizer and Engine calls."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def prepare(self, prompt: str | Sequence[int], params: SamplingParams, *,
                      add_bos: bool = True) -> list[int]:
        """Validated prompt ids (RequestError names what is wrong: empty or too long prompt, ids
        outside the vocabulary, stop strings without a tokenizer)."""
        def check() -> list[int]:
            eng = self.engine
            ids = eng.encode(prompt, add_bos=add_bos) if isinstance(prompt, str) else list(prompt)
            eng.check_ids(ids)
            if params.stop and eng.tokenizer is None:
                raise RequestError("stop strings need a tokenizer; this export has none")
            bad = [t for t in params.stop_token_ids if not 0 <= t < eng.config.vocab_size]
            if bad:
                raise RequestError(f"stop token id(s) {bad} out of range [0, {eng.config.vocab_size})")
            return ids
        if isinstance(prompt, str) and not prompt:
            raise RequestError("prompt is empty")
        return await self.call(check)

    # ---- requests --------------------------------------------------------------------------
    def submit(self, ids: list[int], params: SamplingParams) -> RequestHandle:
        """Queue validated prompt ids; Overloaded when the queue is full, EngineError when stopping."""
        if self._closing or not self.alive:
            raise EngineError("the engine is not running (shutting down?)")
        if self.num_running + len(self._waiting) >= self.n_slots + self.max_queue:
            raise Overloaded(f"server at capacity: {self.num_running} requests running, "
                             f"{len(self._waiting)} waiting (max_queue {self.max_queue})")
        if self.speculative and params.logprobs is None:
            params = replace(params, speculative=True)
        h = RequestHandle(self, list(ids), params)
        self._waiting.append(h)
        self._wake.set()
        return h

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       add_bos: bool = True) -> AsyncIterator[Chunk]:
        """The chunks of one request; leaving the loop early cancels it."""
        params = params or SamplingParams()
        h = self.submit(await self.prepare(prompt, params, add_bos=add_bos), params)
        try:
            async for ch in h:
                yield ch
        finally:
            h.cancel()

    def _cancel(self, h: RequestHandle) -> None:
        if h.done:
            return
        if h in self._waiting:
            self._waiting.remove(h)
        elif h.engine_id is not None:
            self._running.pop(h.engine_id, None)
            self._cancels.append(h.engine_id)  # the slot is freed at the start of the next tick
            self._wake.set()
        h._finish("abort", time.perf_counter())

    def _finished(self, h: RequestHandle) -> None:
        if self.on_finish is not None:
            try:
                self.on_finish(h.record)
            except Exception:  # a metrics hook must not take the loop down
                log.exception("on_finish hook failed")

    # ---- the loop --------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            if not (self._waiting or self._running or self._cancels):
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._turn()
            except Exception:  # a bug here must not end the loop: fail what is in flight
                log.exception("engine loop error; failing the requests in flight")
                for h in list(self._running.values()):
                    h.cancel()

    async def _turn(self) -> None:
        """One tick: cancellations, admissions and a step on the engine thread, then delivery."""
        cancels, self._cancels = self._cancels, []
        admit = self._admitting  # counted as running while their tick is in flight
        while self._waiting and len(self._running) + len(admit) < self.n_slots:
            admit.append(self._waiting.popleft())
        try:
            events, t, failures = await self.call(self._tick, cancels, admit, list(self._running))
        except Exception as e:  # the step itself failed: fail its requests (the tick cancelled them)
            self._admitting = []
            self.failed_steps += 1
            log.exception("engine step failed; failing the requests in it")
            err = EngineError(f"engine step failed: {e}")
            now = time.perf_counter()
            for h in list(self._running.values()) + admit:
                h._finish("error", now, err)
            self._running.clear()
            return
        self._admitting = []
        for h, err in failures:
            h._finish("error", t, err)
        for h in admit:
            if h.engine_id is None:
                continue
            if h.done:  # cancelled while its tick ran: the Engine has it, drop it there
                self._cancels.append(h.engine_id)
            else:
                self._running[h.engine_id] = h
        for ch, pieces in events:
            h = self._running.get(ch.request_id)
            if h is None:  # cancelled while the step ran
                continue
            h.record.token_times.append(t)
            h._queue.put_nowait(Chunk(ch.token, ch.text, ch.finished, ch.stop_reason,
                                      ch.logprob, ch.top_logprobs, pieces))
            if ch.finished:
                del self._running[ch.request_id]
                counts = self._spec_counts.pop(ch.request_id, None)
                if counts is not None:
                    h.record.verify_calls, h.record.drafted, h.record.accepted = counts
                h._finish(ch.stop_reason or "stop", t)

    def _tick(self, cancels: list[int], admit: list[RequestHandle], running: list[int]
              ) -> tuple[list[tuple[StreamChunk, dict[int, str] | None]], float, list[tuple[RequestHandle, EngineError]]]:
        """On the engine thread: cancel, submit, one step. Returns the step's chunks (with token
        texts for logprobs requests), the time they were produced, and the submissions that failed."""
        eng = self.engine
        for rid in cancels:
            eng.cancel(rid)
            eng.result(rid)  # a request that finished in the step it was cancelled in leaves a result
        failures = []
        now = time.perf_counter()
        for h in admit:
            try:
                h.engine_id = eng.submit(h.prompt_ids, h.params, add_bos=False)
                h.record.t_admitted = now
            except EngineError as e:
                failures.append((h, e))
        try:
            chunks = eng.step() if eng.has_work else []
        except Exception:  # free the slots of every request in the failed step; the loop fails them
            for rid in running + [h.engine_id for h in admit if h.engine_id is not None]:
                try:
                    eng.cancel(rid)
                    eng.result(rid)
                except Exception:
                    log.exception("cancelling request %d after a failed step", rid)
            raise
        t = time.perf_counter()
        out = []
        for ch in chunks:
            if ch.finished:
                res = eng.result(ch.request_id)  # the Engine keeps results until taken
                if getattr(res, "drafted", None) is not None:
                    self._spec_counts[ch.request_id] = (res.decode_calls, res.drafted, res.accepted)
            pieces = None
            if ch.top_logprobs is not None and eng.tokenizer is not None:
                ids = {ch.token, *(i for i, _ in ch.top_logprobs)}
                pieces = {i: eng.decode([i]) for i in ids}
            out.append((ch, pieces))
        return out, t, failures
