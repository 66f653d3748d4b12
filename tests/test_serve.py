"""`dsv4 serve` and the AsyncEngine.

* AsyncEngine on a scripted fake Engine (no device, fast): a step that raises fails only the
  requests in it and the loop keeps serving; cancelling frees the slot before the next step;
  the bounded queue refuses the request past it.
* The server as a real process on 127.0.0.1 (a free port), driven with the official `openai`
  client and raw httpx: concurrent greedy == solo, stream == non-stream, logprobs == the export's
  own score function, every bad-request class -> 400 with OpenAI's error body, 401 without the key,
  hang-ups free their slot, overload -> 503 + Retry-After, /metrics counters move, SIGTERM drains.

The export is the embedded default checkpoint, prefill batch size 1, decode batch sizes 1 and 4,
4 slots (tests/conftest.py's embedded_bf16_export, shared with tests/test_batch_invariance.py, which
holds its decode bs1 and bs4 functions to the same bits): greedy equality of a request alone and among others then tests the
engine's slot bookkeeping (no cross-talk).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from dsv4.runtime.serve.async_engine import AsyncEngine, Overloaded  # noqa: E402
from dsv4.runtime.engine import EngineError, StreamChunk  # noqa: E402
from dsv4.runtime.sampling import SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KEY = "test-key-123"
MODEL = "dsv4-small"
SLOTS = 4
MAX_QUEUE = 12
MAX_SEQ_LEN = 512  # the shared export's (tests/conftest.py); long enough that max_seq_len - 16 greedy tokens outlast the short timeouts below (~2.5 ms/token here)
PROMPTS = ["The list data type has some more methods.", "Here are all of the methods of list objects:",
           "A function definition", "The for statement in Python", "Strings can be concatenated",
           "You can also add new items", "To iterate over the indices", "The del statement",
           "Tuples are immutable", "A set is an unordered collection", "Dictionaries are indexed by keys",
           "Looping techniques"]


# ------------------------------------------------------------------------------------------------
# AsyncEngine on a fake Engine
# ------------------------------------------------------------------------------------------------

class _FakeConfig:
    n_slots, vocab_size, max_seq_len = 2, 100, 64


class FakeEngine:
    """Engine's public surface, scripted: request r emits tokens 1..max_new_tokens, one per step;
    a prompt containing 66 makes step() raise (a device failure)."""

    config = _FakeConfig()
    tokenizer = None

    def __init__(self) -> None:
        self.running: dict[int, list] = {}  # id -> [prompt, params, emitted]
        self.queue: list[int] = []
        self.next_id = 0
        self.steps = 0
        self.cancelled: list[tuple[int, int]] = []  # (request id, step count when cancelled)
        self.max_running = 0

    def check_ids(self, ids):
        if not ids:
            raise EngineError("prompt is empty")

    def submit(self, prompt, params, add_bos=True):
        rid = self.next_id
        self.next_id += 1
        self.running[rid] = [list(prompt), params, 0]
        return rid

    @property
    def has_work(self):
        return bool(self.running)

    def step(self):
        self.steps += 1
        self.max_running = max(self.max_running, len(self.running))
        assert len(self.running) <= self.config.n_slots, "more requests than slots"
        if any(66 in r[0] for r in self.running.values()):
            raise RuntimeError("device lost")
        out = []
        for rid, r in list(self.running.items()):
            r[2] += 1
            done = r[2] >= r[1].max_new_tokens
            out.append(StreamChunk(rid, r[2], f"<{r[2]}>", done, "length" if done else None))
            if done:
                del self.running[rid]
        return out

    def cancel(self, rid):
        if self.running.pop(rid, None) is not None:
            self.cancelled.append((rid, self.steps))

    def result(self, rid):
        return None


def _collect(aeng: AsyncEngine, prompt, n: int):
    async def run():
        return [c.token async for c in aeng.generate(prompt, SamplingParams(max_new_tokens=n))]
    return run()


def test_async_engine_survives_a_failing_step() -> None:
    async def main():
        eng = FakeEngine()
        async with AsyncEngine(eng, max_queue=4) as aeng:
            good = asyncio.create_task(_collect(aeng, [1, 2], 3))
            await asyncio.sleep(0)
            with pytest.raises(EngineError, match="device lost"):
                await _collect(aeng, [66], 5)
            with pytest.raises(EngineError):  # it shared the failed step
                await good
            assert aeng.alive and aeng.failed_steps == 1
            assert not eng.running, "the failed step's requests were cancelled in the Engine"
            assert await _collect(aeng, [3], 4) == [1, 2, 3, 4]  # the loop still serves
            assert aeng.num_running == aeng.num_waiting == 0
    asyncio.run(main())


def test_async_engine_cancel_and_bounded_queue() -> None:
    async def main():
        eng = FakeEngine()
        async with AsyncEngine(eng, max_queue=1) as aeng:
            p = SamplingParams(max_new_tokens=1000)
            hs = [aeng.submit([1], p) for _ in range(3)]  # 2 slots + 1 waiting
            with pytest.raises(Overloaded):
                aeng.submit([1], p)
            first = await hs[0].__anext__()
            assert first.token == 1
            steps_at_cancel = eng.steps
            hs[0].cancel()
            assert aeng.num_running == 1
            assert (await hs[2].__anext__()).token == 1  # the waiting request got the freed slot
            rid, at = eng.cancelled[0]
            assert rid == hs[0].engine_id
            assert at <= steps_at_cancel + 1, "the slot is freed before the step after the current one"
            assert eng.max_running == 2
            for h in hs[1:]:
                h.cancel()
            for _ in range(100):
                if not eng.running:
                    break
                await asyncio.sleep(0.01)
            assert not eng.running and aeng.num_running == aeng.num_waiting == 0
    asyncio.run(main())


def test_async_engine_cancel_while_its_admission_tick_runs() -> None:
    """A request cancelled while the tick that submits it is still stepping is dropped from the
    Engine at the next tick (it must not keep a slot with nobody reading it)."""
    class SlowEngine(FakeEngine):
        def __init__(self):
            super().__init__()
            self.in_step = threading.Event()

        def step(self):
            self.in_step.set()
            time.sleep(0.2)
            return super().step()

    async def main():
        eng = SlowEngine()
        async with AsyncEngine(eng, max_queue=0) as aeng:
            h = aeng.submit([1], SamplingParams(max_new_tokens=1000))
            while not eng.in_step.is_set():
                await asyncio.sleep(0.005)
            h.cancel()  # its tick is running: submitted, not yet handed back
            assert h.engine_id is not None and aeng.num_running == 0
            for _ in range(200):
                if eng.cancelled:
                    break
                await asyncio.sleep(0.01)
            assert eng.cancelled and eng.cancelled[0][0] == h.engine_id and not eng.running
    asyncio.run(main())


# ------------------------------------------------------------------------------------------------
# the server process
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def serve_export(embedded_bf16_export: Path) -> Path:
    """The embedded checkpoint exported for llvm-cpu (tests/conftest.py's shared export: minutes, cached)."""
    return embedded_bf16_export


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, export: Path, log: Path, *extra: str):
        self.export = export
        self.cfg = json.loads((export / "config.json").read_text())
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dsv4.cli", "serve", str(export), "--port", str(self.port),
             "--api-key", KEY, "--served-model-name", MODEL, "--max-queue", str(MAX_QUEUE), *extra],
            stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, f"server exited:\n{log.read_text()}"
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"server did not come up:\n{log.read_text()}"
            time.sleep(0.2)

    def post(self, path: str, body=None, *, key: str | None = KEY, content: bytes | None = None, timeout=120):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.base + path, json=body, content=content, headers=headers, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """name{labels} -> value, labels other than model_name kept in the key."""
        out = {}
        for line in httpx.get(self.base + "/metrics", timeout=10).text.splitlines():
            m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$', line)
            if m:
                labels = ",".join(sorted(p for p in (m.group(2) or "").split(",") if p and "model_name" not in p))
                out[m.group(1) + (f"{{{labels}}}" if labels else "")] = float(m.group(3))
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(serve_export: Path, tmp_path_factory):
    s = Server(serve_export, tmp_path_factory.mktemp("serve") / "server.log")
    yield s
    rc = s.stop()
    assert rc == 0, f"server exit status {rc}:\n{s.log.read_text()[-3000:]}"


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _greedy(client, prompt: str, n: int = 24, **kw):
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                  extra_body={"ignore_eos": True}, **kw)
    return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens


def test_models_health_and_api_key(server, client) -> None:
    import openai

    assert httpx.get(server.base + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]
    for key in (None, "wrong"):
        r = server.post("/v1/completions", {"prompt": "x", "max_tokens": 1}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server.base + "/v1/models")
    assert r.status_code == 401
    bad = openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=1)


def test_concurrent_greedy_equals_solo(server, client) -> None:
    solo = [_greedy(client, p) for p in PROMPTS]
    assert len(set(t for t, _, _ in solo)) > len(PROMPTS) // 2, "prompts should give different texts"
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        together = list(ex.map(lambda p: _greedy(client, p), PROMPTS))
    assert together == solo
    assert all(n == 24 and fr == "length" for _, fr, n in solo)


def _stream_text(stream) -> tuple[str, str | None, object]:
    text, finish, usage = [], None, None
    for ch in stream:
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            text.append(getattr(c, "text", None) or (c.delta.content if hasattr(c, "delta") and c.delta.content else ""))
            finish = c.finish_reason or finish
    return "".join(text), finish, usage


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, top_p=0.9, seed=7)])
def test_stream_equals_nonstream(server, client, sampling) -> None:
    kw = dict(model=MODEL, max_tokens=20, **sampling)
    a = client.completions.create(prompt=PROMPTS[0], **kw)
    s = _stream_text(client.completions.create(prompt=PROMPTS[0], stream=True,
                                               stream_options={"include_usage": True}, **kw))
    assert s == (a.choices[0].text, a.choices[0].finish_reason, a.usage)
    msgs = [{"role": "user", "content": "What is a list?"}]
    c = client.chat.completions.create(messages=msgs, **kw)
    s = _stream_text(client.chat.completions.create(messages=msgs, stream=True,
                                                    stream_options={"include_usage": True}, **kw))
    assert s == (c.choices[0].message.content, c.choices[0].finish_reason, c.usage)
    assert c.usage.prompt_tokens > 4 and c.usage.completion_tokens >= 1


def test_stop_string(server, client) -> None:
    full, _, _ = _greedy(client, PROMPTS[1], 24)
    stop = next((full[i:i + 3] for i in range(len(full) // 2, len(full) - 3) if full[i:i + 3].strip() == full[i:i + 3]),
                None)
    assert stop, f"need a stop string without blanks at its ends in {full!r}"
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[:full.index(stop)]


def test_logprobs_match_the_score_function(server, client) -> None:
    """Completions logprobs (greedy) against the export's score_bs1 run in this process."""
    from dsv4.runtime.engine import Engine

    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    gen = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    assert len(gen) == 8 == len(lp.token_logprobs) == len(lp.top_logprobs)
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and max(top.values()) == val and top[tok] == val  # greedy: the top token
    eng = Engine(server.export)
    prompt = eng.encode(PROMPTS[2])
    ref = eng.score(prompt + gen).logprobs[len(prompt):]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs, ref)) < 0.05, (lp.token_logprobs, ref)


def _bad_cases(max_len: int, vocab: int) -> list[tuple[str, object, str]]:
    c = "/v1/completions"
    ok = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    return [
        (c, b"{not json", "invalid_json"),
        (c, b"[1, 2]", "invalid_json"),
        (c, {**ok, "max_tokens": 0}, "invalid_value"),
        (c, {**ok, "max_tokens": -3}, "invalid_value"),
        (c, {**ok, "max_tokens": "ten"}, "invalid_value"),
        (c, {**ok, "prompt": [1] * (max_len + 1)}, "context_length_exceeded"),
        (c, {**ok, "prompt": [1] * (max_len - 2)}, "context_length_exceeded"),  # + 4 new tokens
        (c, {**ok, "temperature": -0.5}, "invalid_value"),
        (c, {**ok, "temperature": 2.5}, "invalid_value"),
        (c, {**ok, "top_p": 0}, "invalid_value"),
        (c, {**ok, "top_p": 1.5}, "invalid_value"),
        (c, {**ok, "seed": -1}, "invalid_value"),
        (c, {**ok, "prompt": [1, vocab]}, "invalid_prompt"),
        (c, {**ok, "prompt": [1, -1]}, "invalid_prompt"),
        (c, {**ok, "prompt": ""}, "invalid_value"),
        (c, {**ok, "prompt": ["a", "b"]}, "invalid_value"),
        (c, {**ok, "n": 2}, "invalid_value"),
        (c, {**ok, "logprobs": 99}, "invalid_value"),
        (c, {**ok, "stop": ["a", "b", "c", "d", "e"]}, "invalid_value"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, "invalid_value"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 0}, "invalid_value"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]},
         "invalid_value"),
    ]


def test_bad_requests_get_400(server) -> None:
    cases = _bad_cases(server.cfg["max_seq_len"], server.cfg["model"]["vocab_size"])
    for path, body, code in cases:
        r = server.post(path, content=body) if isinstance(body, bytes) else server.post(path, body)
        assert r.status_code == 400, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == code and err["type"] == "invalid_request_error" and err["message"], (body, err)
    r = server.post("/v1/completions", {"model": "gpt-4", "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert _healthy_and_idle(server)


def test_bad_request_through_the_openai_client(client) -> None:
    import openai

    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=0)


def _healthy_and_idle(server, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            return httpx.get(server.base + "/health").status_code == 200
        time.sleep(0.05)
    return False


def test_hangup_frees_the_slot(server, client) -> None:
    before = server.metrics()
    n = server.cfg["max_seq_len"] - 16
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": n, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=60) as c:  # streamed: read two events, then hang up
        with c.stream("POST", server.base + "/v1/completions", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data:")
                if seen == 2:
                    break
    with pytest.raises(httpx.ReadTimeout):  # not streamed: give up while it runs
        server.post("/v1/completions", body, timeout=0.2)
    assert _healthy_and_idle(server), "a hung-up request still holds a slot"
    after = server.metrics()
    assert after['vllm:request_success_total{finished_reason="abort"}'] \
        - before.get('vllm:request_success_total{finished_reason="abort"}', 0) == 2
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 2 * n - 8
    assert _greedy(client, PROMPTS[0]) == _greedy(client, PROMPTS[0])  # and the next ones are served
    assert "Traceback" not in server.log.read_text(), "a hang-up logged a traceback"


def test_huge_body_is_413_while_health_answers(server) -> None:
    """A 20 MB prompt is refused with 413 (before it is parsed or tokenized) and /health stays quick."""
    big = json.dumps({"model": MODEL, "prompt": "a" * 20_000_000}).encode()
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(server.post, "/v1/completions", content=big)
        time.sleep(0.05)
        t0 = time.perf_counter()
        h = httpx.get(server.base + "/health", timeout=10)
        waited = time.perf_counter() - t0
        r = fut.result()
    assert h.status_code == 200 and waited < 1.0, waited
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text


def test_overload_answers_503_with_retry_after(server) -> None:
    total = SLOTS + MAX_QUEUE + 4
    body = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(total) as ex:
        rs = list(ex.map(lambda _: server.post("/v1/completions", body), range(total)))
    busy = [r for r in rs if r.status_code == 503]
    ok = [r for r in rs if r.status_code == 200]
    assert len(busy) >= 1 and len(busy) + len(ok) == total, [r.status_code for r in rs]
    assert len(ok) >= SLOTS + MAX_QUEUE - 2  # only what exceeded slots + queue was refused
    for r in busy:
        assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == "server_overloaded"
    texts = {r.json()["choices"][0]["text"] for r in ok}
    assert len(texts) == 1 and all(r.json()["usage"]["completion_tokens"] == 48 for r in ok)
    assert server.metrics()['dsv4:requests_rejected_total{status="503"}'] >= len(busy)
    assert _healthy_and_idle(server)


def test_metrics_counters_move(server, client) -> None:
    before = server.metrics()
    r = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = server.metrics()
    d = lambda k: after[k] - before.get(k, 0)  # noqa: E731
    assert d("vllm:prompt_tokens_total") == r.usage.prompt_tokens
    assert d("vllm:generation_tokens_total") == r.usage.completion_tokens == 10
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_time_per_output_token_seconds"):
        assert d(f"vllm:{h}_count") == 1, h
        assert 0 < d(f"vllm:{h}_sum") < 60 or h == "request_queue_time_seconds" and d(f"vllm:{h}_sum") == 0, h  # seconds, not ms
    assert d("vllm:inter_token_latency_seconds_count") == 9
    assert d('vllm:request_success_total{finished_reason="length"}') == 1
    assert after["vllm:e2e_request_latency_seconds_sum"] - before["vllm:e2e_request_latency_seconds_sum"] \
        >= after["vllm:time_to_first_token_seconds_sum"] - before["vllm:time_to_first_token_seconds_sum"]


def test_sigterm_drains_and_exits_cleanly(serve_export, tmp_path) -> None:
    s = Server(serve_export, tmp_path / "server.log", "--drain-timeout", "60")
    got: dict = {}

    def reader():
        body = {"model": MODEL, "prompt": PROMPTS[6], "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        lines = []
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", s.base + "/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        lines.append(line[5:].strip())
                        got["first"] = True
        got["lines"] = lines

    t = threading.Thread(target=reader)
    t.start()
    deadline = time.monotonic() + 60
    while "first" not in got and time.monotonic() < deadline:
        time.sleep(0.01)
    s.proc.send_signal(signal.SIGTERM)
    t.join(timeout=90)
    assert s.proc.wait(timeout=60) == 0, s.log.read_text()[-3000:]
    lines = got["lines"]
    assert lines[-1] == "[DONE]"
    assert json.loads(lines[-2])["usage"]["completion_tokens"] == 40, "the in-flight request was drained"
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.base + "/health", timeout=2)


def test_bench_percentiles_match_numpy() -> None:
    import numpy as np

    from dsv4.bench.serve_load import summarize

    xs = [0.003, 0.001, 0.010, 0.002, 0.5, 0.004, 0.007]
    s = summarize(xs)
    assert s["mean_ms"] == pytest.approx(1e3 * np.mean(xs))
    assert s["p50_ms"] == pytest.approx(1e3 * np.percentile(xs, 50))
    assert s["p99_ms"] == pytest.approx(1e3 * np.percentile(xs, 99))


def test_bench_serve_against_the_server(server) -> None:
    from dsv4.bench.serve_load import format_table, run_bench

    res = run_bench(server.base, [1, 3], 3, max_tokens=6, prompt_tokens=5, api_key=KEY)
    assert [r.concurrency for r in res] == [1, 3]
    for r in res:
        assert (r.completed, r.failed, r.output_tokens, r.prompt_tokens) == (3, 0, 18, 15), r.errors
        assert 0 < r.ttft["p50_ms"] <= r.e2el["p50_ms"] and r.tpot["mean_ms"] > 0
    assert "TTFT p99 (ms)" in format_table(res)


_BLOCK = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in BLOCKED or name.startswith(('iree.compiler', 'iree.turbine')):
            raise ModuleNotFoundError('blocked: ' + name, name=name)  # as if not installed
sys.meta_path.insert(0, Block())
"""


def test_serving_imports_no_torch() -> None:
    code = ("BLOCKED = ('torch',)" + _BLOCK + "import dsv4.runtime.serve, dsv4.runtime.serve.app, "
            "dsv4.runtime.serve.async_engine, dsv4.bench.serve_load, dsv4.cli.serve, dsv4.cli.bench_serve")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@pytest.mark.parametrize("cmd", [["serve", "/nonexistent"], ["bench", "serve", "http://127.0.0.1:9"]])
def test_serve_commands_without_the_serve_extra_say_what_is_missing(cmd) -> None:
    code = ("BLOCKED = ('starlette', 'uvicorn', 'httpx', 'prometheus_client', 'pydantic')" + _BLOCK
            + f"from dsv4.cli import main; sys.exit(main({cmd!r}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "needs the 'serve' extra" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_token_logprobs_against_a_float64_log_softmax() -> None:
    import numpy as np

    from dsv4.runtime.sampling import token_logprobs

    x = np.array([2.0, -1.0, 3.5, 3.5, 0.0], dtype=np.float32)
    ref = [math.log(math.exp(v) / sum(math.exp(w) for w in x.tolist())) for v in x.tolist()]
    lp, top = token_logprobs(x, 1, 3)
    assert lp == pytest.approx(ref[1], abs=1e-12)
    assert [t for t, _ in top] == [2, 3, 0]  # ties by the lower id
    assert [v for _, v in top] == pytest.approx([ref[2], ref[3], ref[0]], abs=1e-12)


def test_sigterm_past_the_drain_timeout_cancels_and_exits_cleanly(serve_export, tmp_path) -> None:
    s = Server(serve_export, tmp_path / "server.log", "--drain-timeout", "0.1")
    n = s.cfg["max_seq_len"] - 16
    body = {"model": MODEL, "prompt": PROMPTS[7], "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True}
    lines = []
    t0 = time.monotonic()
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", s.base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
            try:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        lines.append(line)
                        if len(lines) == 1:
                            s.proc.send_signal(signal.SIGTERM)
            except httpx.HTTPError:  # the server closed the stream
                pass
    assert s.proc.wait(timeout=60) == 0, s.log.read_text()[-3000:]
    assert len(lines) < n and "data: [DONE]" not in lines, "the request should have been cut at the drain timeout"
    assert time.monotonic() - t0 < 30
