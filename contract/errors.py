"""The runtime's exceptions: every refusal is an EngineError whose message names the problem."""

from __future__ import annotations

__all__ = ["EngineError", "ArtifactError", "RequestError"]


class EngineError(RuntimeError):
    """Anything the engine refuses to do; the message names the problem."""


class ArtifactError(EngineError):
    """The export directory is incomplete, malformed, corrupt, or mixes files of different exports."""


class RequestError(EngineError):
    """A request the model cannot serve (empty/too long prompt, bad token ids, bad sampling params)."""
