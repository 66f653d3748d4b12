"""The server's routes on the real app and the real AsyncEngine, over a scripted fake Engine
(no compiled export: the whole file runs in seconds).

The fake implements the Engine surface the server uses (config, tokenizer, encode, decode,
apply_chat_template, check_ids, submit, step, cancel, result, has_work). Its text is predictable:
request r's k-th token is id k with text "t<k> ", so every expected body below is written out
independently of the server's code.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("pydantic")

from dsv4.contract.errors import EngineError, RequestError  # noqa: E402
from dsv4.runtime.engine import StreamChunk  # noqa: E402
from dsv4.runtime.sampling import SamplingParams, check_context  # noqa: E402
from dsv4.runtime.serve import AsyncEngine, build_app, default_max_body_bytes  # noqa: E402

MODEL = "fake-model"
SLOW_PROMPT = "tokenize me slowly"  # the fake's encode blocks its thread for ENCODE_DELAY on this text
ENCODE_DELAY = 1.5


class _Config:
    n_slots, vocab_size, max_seq_len = 2, 100, 64


class FakeEngine:
    """Engine's public surface, scripted. Text -> one id per character (3 + ord % 90, bos 0);
    each step emits the next token k (id k, text "t<k> ") of every running request, finishing it
    with "length" at its max_new_tokens. ``step_delay`` slows steps (seconds, on the engine thread)."""

    config = _Config()
    tokenizer = object()  # present: stop strings are allowed

    def __init__(self, step_delay: float = 0.0) -> None:
        self.step_delay = step_delay
        self.running: dict[int, list] = {}  # id -> [prompt, params, emitted]
        self.submitted: list[tuple[list[int], SamplingParams]] = []
        self.cancelled: list[int] = []
        self.next_id = 0
        self.encode_threads: list[str] = []

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        self.encode_threads.append(threading.current_thread().name)
        if text == SLOW_PROMPT:
            time.sleep(ENCODE_DELAY)
        return ([0] if add_bos else []) + [3 + ord(c) % 90 for c in text]

    def decode(self, ids) -> str:
        return "".join(f"t{i} " for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages))

    def check_ids(self, ids) -> None:
        if not ids:
            raise RequestError("prompt is empty")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.config.vocab_size for t in ids):
            raise RequestError(f"invalid token id(s): ids must be integers in [0, {self.config.vocab_size})")
        if len(ids) > self.config.max_seq_len:
            raise RequestError(f"prompt has {len(ids)} tokens, longer than max_seq_len {self.config.max_seq_len}")

    def submit(self, prompt, params, add_bos: bool = True) -> int:
        rid = self.next_id
        self.next_id += 1
        self.running[rid] = [list(prompt), params, 0]
        self.submitted.append((list(prompt), params))
        return rid

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    def step(self) -> list[StreamChunk]:
        if self.step_delay:
            time.sleep(self.step_delay)
        out = []
        for rid, r in list(self.running.items()):
            r[2] += 1
            k = r[2]
            done = k >= r[1].max_new_tokens
            lp = (-0.5, [(k, -0.5)]) if r[1].logprobs is not None else (None, None)
            out.append(StreamChunk(rid, k, f"t{k} ", done, "length" if done else None, *lp))
            if done:
                del self.running[rid]
        return out

    def cancel(self, rid: int) -> None:
        if self.running.pop(rid, None) is not None:
            self.cancelled.append(rid)

    def result(self, rid: int):
        return None


def serve(test, *, step_delay: float = 0.0, max_queue: int = 8, **app_kw):
    """Run ``await test(client, fake, aeng)`` against the app on a fresh fake engine."""
    async def main():
        fake = FakeEngine(step_delay)
        aeng = AsyncEngine(fake, max_queue=max_queue)
        app = build_app(aeng, MODEL, **app_kw)
        async with aeng:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
                return await test(client, fake, aeng)
    return asyncio.run(main())


def expected_text(n: int) -> str:
    return "".join(f"t{k} " for k in range(1, n + 1))


def sse(text: str) -> list:
    """The events of a server-sent-events body, in order; "[DONE]" stays a string."""
    assert text.endswith("\n\n")
    events = []
    for block in text.strip("\n").split("\n\n"):
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def post(client, path: str, body, **kw):
    return client.post(path, content=body if isinstance(body, bytes) else json.dumps(body), **kw)


# ------------------------------------------------------------------------------------------------
# bodies
# ------------------------------------------------------------------------------------------------

def test_completion_body_and_max_tokens_reach_the_engine() -> None:
    async def t(client, fake, aeng):
        r = await post(client, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "seed": 3,
                                                   "temperature": 0.5, "top_p": 0.9, "top_k": 7})
        assert r.status_code == 200, r.text
        b = r.json()
        assert b["object"] == "text_completion" and b["model"] == MODEL and b["id"].startswith("cmpl-")
        assert b["choices"] == [{"index": 0, "text": expected_text(5), "logprobs": None, "finish_reason": "length"}]
        assert b["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}  # bos + "Hi"
        prompt, params = fake.submitted[-1]
        assert prompt == [0, 3 + ord("H") % 90, 3 + ord("i") % 90]
        assert (params.max_new_tokens, params.seed, params.temperature, params.top_p, params.top_k) == (5, 3, 0.5, 0.9, 7)
        # max_completion_tokens is the newer name; without either, OpenAI's default of 16
        await post(client, "/v1/completions", {"model": MODEL, "prompt": [5, 6], "max_completion_tokens": 3})
        assert fake.submitted[-1][0] == [5, 6] and fake.submitted[-1][1].max_new_tokens == 3
        r = await post(client, "/v1/completions", {"model": MODEL, "prompt": "x"})
        assert fake.submitted[-1][1].max_new_tokens == 16 and r.json()["usage"]["completion_tokens"] == 16
    serve(t)


def test_chat_body() -> None:
    async def t(client, fake, aeng):
        msgs = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
        r = await post(client, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 4,
                                                        "logprobs": True, "top_logprobs": 1})
        assert r.status_code == 200, r.text
        b = r.json()
        assert b["object"] == "chat.completion" and b["id"].startswith("chatcmpl-")
        ch = b["choices"][0]
        assert ch["message"] == {"role": "assistant", "content": expected_text(4)} and ch["finish_reason"] == "length"
        assert [e["logprob"] for e in ch["logprobs"]["content"]] == [-0.5] * 4
        rendered = "system: be brief\nuser: hi\n"  # developer is the system role for the template
        assert fake.submitted[-1][0] == [0] + [3 + ord(c) % 90 for c in rendered]  # the template's bos
        assert fake.submitted[-1][1].logprobs == 1
        # without max_tokens, chat may use the rest of the context
        await post(client, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}]})
        assert fake.submitted[-1][1].max_new_tokens == _Config.max_seq_len - 1 - len("user: a\n")
    serve(t)


def test_streaming_events_and_done() -> None:
    async def t(client, fake, aeng):
        r = await post(client, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True,
                                                   "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        ev = sse(r.text)
        assert ev[-1] == "[DONE]"
        tokens, usage = ev[:-2], ev[-2]
        assert [e["choices"][0]["text"] for e in tokens] == ["t1 ", "t2 ", "t3 "]
        assert [e["choices"][0]["finish_reason"] for e in tokens] == [None, None, "length"]
        assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 3,
                                                             "total_tokens": 6}
        r = await post(client, "/v1/chat/completions", {"model": MODEL, "stream": True, "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "a"}]})
        ev = sse(r.text)
        assert ev[-1] == "[DONE]" and len(ev) == 4  # role, 2 tokens, [DONE] (no usage unless asked)
        assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert [e["choices"][0]["delta"] for e in ev[1:3]] == [{"content": "t1 "}, {"content": "t2 "}]
        assert ev[2]["choices"][0]["finish_reason"] == "length"
        assert aeng.num_running == 0 and not fake.running
    serve(t)


# ------------------------------------------------------------------------------------------------
# refusals
# ------------------------------------------------------------------------------------------------

def test_unknown_model_is_404_and_a_missing_model_400() -> None:
    async def t(client, fake, aeng):
        for path, body in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            r = await post(client, path, {**body, "model": "gpt-4"})
            assert r.status_code == 404, r.text
            assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
            r = await post(client, path, body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "model"
        assert not fake.submitted
    serve(t)


OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
BAD_FIELDS = [
    ("/v1/completions", b"{not json", None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", None, "invalid_json"),
    ("/v1/completions", {**OK, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ("/v1/completions", {**OK, "max_tokens": "ten"}, "max_tokens", "invalid_value"),
    ("/v1/completions", {**OK, "max_tokens": True}, "max_tokens", "invalid_value"),
    ("/v1/completions", {**OK, "temperature": -0.5}, "temperature", "invalid_value"),
    ("/v1/completions", {**OK, "temperature": 2.5}, "temperature", "invalid_value"),
    ("/v1/completions", {**OK, "top_p": 0}, "top_p", "invalid_value"),
    ("/v1/completions", {**OK, "seed": -1}, "seed", "invalid_value"),
    ("/v1/completions", {**OK, "stream": "yes"}, "stream", "invalid_value"),
    ("/v1/completions", {**OK, "n": 2}, "n", "invalid_value"),
    ("/v1/completions", {**OK, "logprobs": 99}, "logprobs", "invalid_value"),
    ("/v1/completions", {**OK, "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ("/v1/completions", {**OK, "stop": [""]}, "stop", "invalid_value"),
    ("/v1/completions", {**OK, "stop_token_ids": [1, "x"]}, "stop_token_ids", "invalid_value"),
    ("/v1/completions", {**OK, "stop_token_ids": [1, 100]}, "stop_token_ids", "invalid_value"),  # >= vocab
    ("/v1/completions", {**OK, "frequency_penalty": 0.5}, "frequency_penalty", "invalid_value"),
    ("/v1/completions", {**OK, "echo": True}, "echo", "invalid_value"),
    ("/v1/completions", {**OK, "prompt": ""}, "prompt", "invalid_value"),
    ("/v1/completions", {**OK, "prompt": ["a", "b"]}, "prompt", "invalid_value"),
    ("/v1/completions", {**OK, "prompt": [1, 100]}, "prompt", "invalid_prompt"),
    ("/v1/completions", {**OK, "prompt": [1] * 65}, "prompt", "context_length_exceeded"),
    ("/v1/completions", {**OK, "prompt": [1] * 62}, "max_tokens", "context_length_exceeded"),  # 62 + 4 > 64
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "messages", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens", "invalid_value"),
]


def test_bad_fields_are_400_naming_the_field() -> None:
    async def t(client, fake, aeng):
        for path, body, param, code in BAD_FIELDS:
            r = await post(client, path, body)
            assert r.status_code == 400, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), (body, err)
            assert err["message"]
        assert not fake.submitted, "a bad request reached the engine"
    serve(t)


def test_body_too_large_is_413_and_health_stays_responsive() -> None:
    limit = default_max_body_bytes(_Config.max_seq_len)
    assert limit >= 32 * _Config.max_seq_len

    async def t(client, fake, aeng):
        big = json.dumps({"model": MODEL, "prompt": "a" * 20_000_000}).encode()

        async def health_latency():
            await asyncio.sleep(0.01)
            t0 = time.perf_counter()
            r = await client.get("/health")
            return r.status_code, time.perf_counter() - t0

        t0 = time.perf_counter()
        r, (hs, ht) = await asyncio.gather(post(client, "/v1/completions", big), health_latency())
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
        assert time.perf_counter() - t0 < 5 and hs == 200 and ht < 1.0, ht

        async def chunks():  # no Content-Length: the limit applies while the body streams in
            for _ in range(30):
                yield b"x" * 100_000
        r = await client.post("/v1/completions", content=chunks())
        assert r.status_code == 413, r.text
        # just under the limit is parsed (and refused for what it says, not for its size)
        body = json.dumps({"model": MODEL, "prompt": [1] * 60}).encode()  # + 16 tokens > 64
        r = await post(client, "/v1/completions", body + b" " * (limit - len(body)))
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert not fake.submitted
    serve(t)
    # the limit is configurable
    serve(lambda client, fake, aeng: _expect_status(client, json.dumps(OK).encode() + b" " * 100, 413),
          max_body_bytes=64)


async def _expect_status(client, body: bytes, status: int) -> None:
    r = await post(client, "/v1/completions", body)
    assert r.status_code == status, r.text


def test_tokenization_runs_off_the_event_loop() -> None:
    async def t(client, fake, aeng):
        req = asyncio.create_task(post(client, "/v1/completions", {**OK, "prompt": SLOW_PROMPT}))
        await asyncio.sleep(0.2)  # the encode is under way
        t0 = time.perf_counter()
        h = await client.get("/health")
        waited = time.perf_counter() - t0
        r = await req
        assert r.status_code == 200 and h.status_code == 200
        assert waited < 0.5 * ENCODE_DELAY, waited
        assert fake.encode_threads and all(n.startswith("dsv4-engine") for n in fake.encode_threads)
    serve(t)


def test_api_key() -> None:
    async def t(client, fake, aeng):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"}):
            r = await post(client, "/v1/completions", OK, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
            assert (await client.get("/v1/models", headers=headers)).status_code == 401
        assert not fake.submitted
        r = await post(client, "/v1/completions", OK, headers={"Authorization": "Bearer secret"})
        assert r.status_code == 200, r.text
        r = await client.get("/v1/models", headers={"Authorization": "Bearer secret"})
        m = r.json()["data"][0]
        assert (m["id"], m["max_model_len"], m["vocab_size"]) == (MODEL, 64, 100)
        assert (await client.get("/health")).status_code == 200  # open, as in vLLM
        assert (await client.get("/metrics")).status_code == 200
    serve(t, api_key="secret")


def test_queue_full_is_503_with_retry_after() -> None:
    async def t(client, fake, aeng):
        p = SamplingParams(max_new_tokens=60)
        held = [aeng.submit([1], p) for _ in range(_Config.n_slots + 1)]  # 2 slots + a queue of 1
        r = await post(client, "/v1/completions", OK)
        assert r.status_code == 503, r.text
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "server_overloaded" and r.json()["error"]["type"] == "server_error"
        for h in held:
            h.cancel()
        r = await post(client, "/v1/completions", OK)
        assert r.status_code == 200, r.text
    serve(t, step_delay=0.002, max_queue=1)


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{"):
            got = ",".join(sorted(line[len(name) + 1:line.index("}")].split(",")))
            if got == want:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_count_every_request_once() -> None:
    async def t(client, fake, aeng):
        for n in (2, 3):
            assert (await post(client, "/v1/completions", {**OK, "max_tokens": n})).status_code == 200
        await post(client, "/v1/completions", {**OK, "stream": True, "max_tokens": 4})
        await post(client, "/v1/completions", {**OK, "max_tokens": 0})
        await post(client, "/v1/completions", {**OK, "model": "nope"})
        await post(client, "/v1/chat/completions", b"x" * 200)
        m = (await client.get("/metrics")).text
        lab = {"model_name": MODEL}
        assert _metric(m, "vllm:request_success_total", **lab, finished_reason="length") == 3
        assert _metric(m, "vllm:generation_tokens_total", **lab) == 2 + 3 + 4
        assert _metric(m, "vllm:prompt_tokens_total", **lab) == 3 * len("Hello") + 3  # with bos
        assert _metric(m, "dsv4:requests_rejected_total", **lab, status="400") == 1
        assert _metric(m, "dsv4:requests_rejected_total", **lab, status="404") == 1
        assert _metric(m, "dsv4:requests_rejected_total", **lab, status="413") == 1
        assert _metric(m, "vllm:time_to_first_token_seconds_count", **lab) == 3
        assert _metric(m, "vllm:num_requests_running", **lab) == 0
    serve(t, max_body_bytes=100)


def test_hangup_frees_the_slot_without_a_traceback(caplog) -> None:
    """A non-streaming client that goes away: its request is cancelled in the Engine and nothing
    is logged above INFO (no InvalidStateError traceback, no 'Task exception was never retrieved')."""
    caplog.set_level(logging.DEBUG)

    async def main():
        fake = FakeEngine(step_delay=0.01)  # 50 tokens: 0.5 s, the client leaves after 0.1 s
        aeng = AsyncEngine(fake)
        app = build_app(aeng, MODEL)
        async with aeng:
            for stream in (False, True):
                body = json.dumps({**OK, "max_tokens": 50, "stream": stream}).encode()
                sent = []

                async def receive():
                    if not sent:
                        sent.append(1)
                        return {"type": "http.request", "body": body, "more_body": False}
                    await asyncio.sleep(0.1)  # the client hangs up mid-generation
                    return {"type": "http.disconnect"}

                async def send(msg):  # uvicorn drops what is sent after the client left
                    pass

                scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                         "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                         "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                         "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
                await asyncio.wait_for(app(scope, receive, send), 10)
                for _ in range(100):
                    if not fake.running:
                        break
                    await asyncio.sleep(0.01)
                assert not fake.running and aeng.num_running == 0, "the hung-up request still holds its slot"
                assert fake.cancelled, "the request was not cancelled in the Engine"
                fake.cancelled.clear()
        import gc
        gc.collect()  # an unretrieved task exception is logged when the task is collected
        await asyncio.sleep(0)
    asyncio.run(main())
    loud = [r for r in caplog.records if r.levelno > logging.INFO or r.exc_info]
    assert not loud, [(r.name, r.getMessage()) for r in loud]


def test_lifespan_starts_and_stops_the_engine() -> None:
    from starlette.testclient import TestClient

    aeng = AsyncEngine(FakeEngine())
    with TestClient(build_app(aeng, MODEL)) as client:
        assert client.get("/health").json()["status"] == "ok"
        r = client.post("/v1/completions", json={**OK, "max_tokens": 2})
        assert r.json()["choices"][0]["text"] == expected_text(2)
    assert not aeng.alive


# ------------------------------------------------------------------------------------------------
# the runtime's request rules the server relies on
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(top_p=0.0), dict(max_new_tokens=0), dict(seed=-1)])
def test_sampling_params_raise_the_documented_error(kw: dict) -> None:
    with pytest.raises(RequestError) as ei:
        SamplingParams(**kw)
    assert isinstance(ei.value, EngineError) and next(iter(kw)) in str(ei.value)


def test_check_context_is_the_one_oversize_rule() -> None:
    check_context(60, 4, 64)  # exactly fits
    for prompt, n in ((61, 4), (64, 1), (10, 0)):
        with pytest.raises(RequestError, match="context is 64 tokens"):
            check_context(prompt, n, 64)


def test_bench_serve_draws_prompt_ids_from_the_served_vocabulary() -> None:
    """`dsv4 bench serve` without --id-limit keeps its random prompt ids inside the vocabulary the
    server reports (the fake's 100), so it works on exports smaller than its old fixed 1000."""
    uvicorn = pytest.importorskip("uvicorn")
    import socket

    from dsv4.bench.serve_load import run_bench

    fake = FakeEngine()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(AsyncEngine(fake), MODEL), host="127.0.0.1", port=port,
                                           log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.started
        (res,) = run_bench(f"http://127.0.0.1:{port}", [2], 6, max_tokens=3, prompt_tokens=8, seed=1)
    finally:
        server.should_exit = True
        th.join(20)
    assert res.failed == 0 and res.completed == 6, res.errors
    prompts = [p for p, _ in fake.submitted]
    assert len(prompts) == 7  # the warm-up and six
    assert max(max(p) for p in prompts) < _Config.vocab_size and max(max(p) for p in prompts) > 50


class _SpecFake(FakeEngine):
    """FakeEngine with speculative entry points (K = 2): a speculative request's result reports
    (verify calls, drafted, accepted) = (n - 1 - n // 3, 2 (n - 1 - n // 3), n // 3) for n tokens."""

    draft_tokens = 2

    def __init__(self) -> None:
        super().__init__()
        self.params: dict[int, SamplingParams] = {}

    def submit(self, prompt, params, add_bos: bool = True) -> int:
        rid = super().submit(prompt, params, add_bos)
        self.params[rid] = params
        return rid

    def result(self, rid: int):
        p = self.params.pop(rid)
        n = p.max_new_tokens
        if not p.speculative:
            return type("R", (), {"drafted": None})()
        return type("R", (), {"decode_calls": n - 1 - n // 3, "drafted": 2 * (n - 1 - n // 3), "accepted": n // 3})()


def test_serve_speculative_marks_requests_without_logprobs_and_counts_drafts() -> None:
    async def main():
        fake = _SpecFake()
        aeng = AsyncEngine(fake, max_queue=8, speculative=True)
        app = build_app(aeng, MODEL)
        async with aeng:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                for body in ({**OK, "temperature": 0, "max_tokens": 7}, {**OK, "temperature": 0, "max_tokens": 4},
                             {**OK, "temperature": 0.8, "max_tokens": 5},
                             {**OK, "temperature": 0, "max_tokens": 3, "logprobs": 1}):
                    assert (await post(client, "/v1/completions", body)).status_code == 200
                m = (await client.get("/metrics")).text
        # greedy and sampled requests speculate; the one with logprobs does not
        assert [p.speculative for _, p in fake.submitted] == [True, True, True, False]
        lab = {"model_name": MODEL}
        assert _metric(m, "vllm:spec_decode_num_drafts_total", **lab) == (6 - 2) + (3 - 1) + (4 - 1)
        assert _metric(m, "vllm:spec_decode_num_draft_tokens_total", **lab) == 2 * (4 + 2 + 3)
        assert _metric(m, "vllm:spec_decode_num_accepted_tokens_total", **lab) == 2 + 1 + 1
    asyncio.run(main())


def test_serve_speculative_needs_the_entry_points() -> None:
    with pytest.raises(EngineError, match="--draft-tokens K"):
        AsyncEngine(FakeEngine(), speculative=True)
