"""The OpenAI request bodies as pydantic models, and OpenAI's error body.

Each request is validated once, from the raw JSON (``parse``), before anything is tokenized or
queued. A failure becomes ``ApiError(400)`` whose ``param`` names the offending top-level field
and whose message gives its path and what was expected; the fields this server does not
implement (n > 1, penalties, logit_bias, echo, suffix) are refused when set to anything but their
default, so a client never silently gets something other than what it asked for. Unknown fields
are ignored (OpenAI clients send "user", "metadata", ... freely).

Shapes and limits follow OpenAI's API; top_k, ignore_eos, stop_token_ids and
return_tokens_as_token_ids are vLLM's extensions.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError,
                      field_validator)
from pydantic_core import PydanticCustomError
from starlette.responses import JSONResponse

from ..sampling import MAX_LOGPROBS, SamplingParams

__all__ = ["ApiError", "bad_request", "parse", "CompletionRequest", "ChatCompletionRequest", "ChatMessage",
           "MAX_STOP"]

MAX_STOP = 4  # OpenAI's limit on stop strings


class ApiError(Exception):
    """An error answered with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type_
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param)


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", message)


Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
PositiveInt = Annotated[int, Field(strict=True, ge=1)]
NLogprobs = Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _SamplingRequest(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    temperature: Annotated[Number, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(strict=True, ge=-1)] | None = None  # vLLM: -1 (or 0) disables it
    seed: Annotated[int, Field(strict=True, ge=0)] | None = None
    stop: Any = ()
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    return_tokens_as_token_ids: StrictBool = False
    # accepted only at their defaults (see the module docstring)
    n: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict | None = None

    @field_validator("n", "best_of", check_fields=False)
    @classmethod
    def _one(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise _invalid("only 1 is supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty", "logit_bias", "echo", "suffix", check_fields=False)
    @classmethod
    def _off(cls, v: Any) -> Any:
        if v:  # set to anything but its default (0, {}, false, "")
            raise _invalid("not supported by this server")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> tuple[str, ...]:
        if v is None:
            return ()
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or len(v) > MAX_STOP or any(not isinstance(s, str) or not s for s in v):
            raise _invalid(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them")
        return tuple(v)

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (the newer name) or max_tokens; None: the endpoint's default."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, logprobs: int | None) -> SamplingParams:
        """SamplingParams with max_new_tokens 1 (the caller sets it once the prompt length is
        known); RequestError for what the field checks above leave to SamplingParams."""
        return SamplingParams(
            max_new_tokens=1, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=max(self.top_k or 0, 0), seed=self.seed,
            stop=self.stop, stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            logprobs=logprobs)


class CompletionRequest(_SamplingRequest):
    prompt: Any
    logprobs: NLogprobs | None = None
    best_of: StrictInt | None = None
    echo: StrictBool | None = None
    suffix: StrictStr | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, p: Any) -> str | list[int]:
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            if not p:
                raise _invalid("prompt is empty")
            return p
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            raise _invalid("batched prompts are not supported; send one prompt per request")
        raise _invalid("prompt must be a non-empty string or a non-empty list of token ids")


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]

    def as_template_input(self) -> dict:
        """{"role", "content"} as the chat template takes it (developer is OpenAI's new system)."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: StrictBool = False
    top_logprobs: NLogprobs | None = None

    @property
    def n_logprobs(self) -> int | None:
        """None (no logprobs) or how many alternatives each token reports."""
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


R = TypeVar("R", bound=BaseModel)


def _describe(err: dict) -> ApiError:
    """One pydantic error as OpenAI's 400: param is the top-level field, the message its path."""
    loc = err["loc"]
    if not loc:  # the body itself: not JSON, or not an object
        return bad_request(f"the request body is not a JSON object: {err['msg']}", None, "invalid_json")
    path = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))
    if err["type"] == "missing":
        return bad_request(f"'{path}' is required", str(loc[0]), "missing_required_parameter")
    got = repr(err.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    return bad_request(f"{path}: {err['msg']} (got {got})", str(loc[0]))


def parse(model: type[R], raw: bytes) -> R:
    """The validated request, or ApiError(400) naming the first offending field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise _describe(e.errors(include_url=False)[0]) from None
