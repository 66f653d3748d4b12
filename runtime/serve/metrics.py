"""Prometheus metrics with vLLM's names (``vllm:`` prefix, label ``model_name``), so dashboards
made for vLLM read them, plus ``dsv4:requests_rejected`` by HTTP status.

Every /v1 request that reaches a route is counted exactly once: requests that were queued end in
``vllm:request_success`` (by finish reason: stop, length, abort = cancelled or client gone,
error), requests refused before they were queued in ``dsv4:requests_rejected`` (by status).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .async_engine import AsyncEngine, RequestRecord

__all__ = ["ServeMetrics", "FINISH_REASON", "CONTENT_TYPE_LATEST"]

# the Engine's stop reasons as OpenAI's finish_reason
FINISH_REASON = {"eos": "stop", "stop_token": "stop", "stop_string": "stop", "length": "length",
                 "max_seq_len": "length"}

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


class ServeMetrics:
    """The metrics of one served model; ``observe`` takes each finished request's record."""

    def __init__(self, aeng: AsyncEngine, model_name: str):
        disable_created_metrics()  # no *_created series (vLLM omits them too)
        self.registry = r = CollectorRegistry()
        lab = ["model_name"]
        self.model = model_name
        running = Gauge("vllm:num_requests_running", "Requests in the engine (holding a slot).", lab, registry=r)
        waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a slot.", lab, registry=r)
        running.labels(model_name).set_function(lambda: aeng.num_running)
        waiting.labels(model_name).set_function(lambda: aeng.num_waiting)

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, lab, buckets=_LATENCY_BUCKETS, registry=r)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token (arrival to first token).")
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive tokens of a request.")
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Per request: (last token - first token) / (tokens - 1).")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to the end of the request.")
        self.queue = hist("vllm:request_queue_time_seconds", "Arrival to admission into the engine.")
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of admitted requests.", lab, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", lab, registry=r)
        self.finished = Counter("vllm:request_success", "Requests that ended, by finish reason "
                                "(stop, length, abort = cancelled or client gone, error).",
                                lab + ["finished_reason"], registry=r)
        # speculative decoding (vLLM's names): verify calls, drafts checked, drafts accepted
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Speculative verify calls (finished requests).",
                                   lab, registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", lab,
                                         registry=r)
        self.spec_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", lab,
                                            registry=r)
        self.rejected = Counter("dsv4:requests_rejected", "Requests refused before they were queued, by HTTP status.",
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
        if rec.drafted or rec.verify_calls:
            self.spec_drafts.labels(m).inc(rec.verify_calls)
            self.spec_draft_tokens.labels(m).inc(rec.drafted)
            self.spec_accepted_tokens.labels(m).inc(rec.accepted)
        reason = rec.finish_reason or "stop"
        self.finished.labels(m, FINISH_REASON.get(reason, reason)).inc()

    def reject(self, status: int) -> None:
        self.rejected.labels(self.model, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
