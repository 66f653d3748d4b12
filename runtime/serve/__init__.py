"""The OpenAI-compatible server, split as vLLM splits it: ``protocol`` (the request models and
error body), ``app`` (the routes), ``async_engine`` (the Engine under asyncio), ``metrics``
(Prometheus). Needs the `serve` extra; torch-free."""

from .app import build_app, default_max_body_bytes
from .async_engine import AsyncEngine

__all__ = ["build_app", "default_max_body_bytes", "AsyncEngine"]
