"""Host-side token selection: greedy, temperature, top-k, top-p, with a numpy Generator per request.

Why on the host: the compiled modules return fp32 logits (and their argmax); keeping sampling here
means one vmfb serves every sampling setting. A full sort of a Flash-size vocabulary (129,280) costs
~11 ms per row, 0.7 s per step at batch 64, so `sample_token` sorts only the prefix of the
descending order it reads (`_top_prefix`: a partition, then a sort of the candidates): O(V) per row
plus the prefix, the same tokens as the full sort. Why one Generator per request: a request's draws then
depend only on its own seed and its own logits, never on which other requests share the decode
batch, so batched and solo runs give the same tokens.

Everything is computed in float64 so the distribution does not depend on summation order.
Order of the filters (the usual one): temperature scales the logits, top-k keeps the k largest,
top-p keeps the smallest prefix (by descending probability) whose mass reaches p, then one
uniform draw picks a token from the renormalised remainder. Ties are broken by the lower token id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dsv4.contract.errors import RequestError

__all__ = ["SamplingParams", "SamplingParamsError", "check_context", "sampling_distribution", "sample_token", "make_rng", "token_logprobs", "MAX_LOGPROBS"]

MAX_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's limit)


class SamplingParamsError(RequestError, ValueError):
    """A SamplingParams field out of range: a RequestError (the runtime's documented error type);
    also a ValueError, so callers that check arguments with ``except ValueError`` keep working."""


def check_context(prompt_tokens: int, max_new_tokens: int, max_seq_len: int) -> None:
    """The one rule for oversized requests (the CLI and the server both apply it): the prompt and
    every token asked for must fit the export's context, else RequestError. A request is refused
    up front rather than stopped early at max_seq_len, so asking for more than can be generated
    is never silently cut short."""
    if max_new_tokens < 1 or prompt_tokens + max_new_tokens > max_seq_len:
        raise RequestError(f"this model's context is {max_seq_len} tokens, but {prompt_tokens + max_new_tokens} "
                           f"were requested ({prompt_tokens} in the prompt, {max_new_tokens} to generate); "
                           "shorten the prompt or ask for fewer tokens")


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature 0 means greedy (argmax, no randomness). top_k 0 and top_p 1.0 disable those
    filters. seed None draws fresh OS entropy (recorded on the result so the run can be repeated).
    speculative: the MTP block drafts the export's K tokens per step and one verify call checks them
    (docs/runtime.md, Speculative decoding): greedy requests get plain greedy's tokens, sampled ones
    the speculative-sampling rule on the device (each token distributed as plain sampling's; the
    device sampler's draws, so a seed gives other tokens than without speculation). Not with logprobs.
    stop strings end generation when they appear in the decoded continuation (the text is cut
    before them); stop_token_ids add to the export's eos ids unless ignore_eos.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: each chunk carries its token's logprob and the top k
    speculative: bool = False  # speculative decoding with the export's MTP drafts (--draft-tokens K)

    def __post_init__(self) -> None:
        # normalise list inputs so the dataclass stays hashable/frozen
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        """Raise SamplingParamsError naming the bad field."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise SamplingParamsError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingParamsError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise SamplingParamsError(f"seed must be a non-negative integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise SamplingParamsError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.speculative and self.logprobs is not None:
            raise SamplingParamsError("logprobs are not reported with speculative decoding (the verify call "
                                      "chooses the tokens on the device); drop logprobs or speculation")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def make_rng(seed: int | None) -> tuple[np.random.Generator, int]:
    """A private Generator for one request and the seed that reproduces it."""
    if seed is None:
        seed = int(np.random.SeedSequence().generate_state(1, np.uint64)[0] >> np.uint64(1))
    return np.random.Generator(np.random.PCG64(seed)), seed


def _top_prefix(x: np.ndarray, c: int) -> np.ndarray:
    """The first c entries of np.argsort(-x, kind="stable") (descending, ties by the lower id),
    without sorting all of x: the c-th largest value by partition, then a stable sort of the ids at
    or above it (ascending ids, so ties keep the lower id first)."""
    if c <= 0:
        return np.zeros(0, np.int64)
    if c >= x.size:
        return np.argsort(-x, kind="stable")
    v = np.partition(x, x.size - c)[x.size - c]
    cand = np.flatnonzero(x >= v)
    return cand[np.argsort(-x[cand], kind="stable")][:c]


def _filtered(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """(token ids in descending-probability order, their renormalised float64 probabilities)."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1) / temperature
    # descending order, ties by lower id; with top-k only its first top_k entries are sorted
    order = _top_prefix(x, top_k if 0 < top_k < x.size else x.size)
    kept = x[order]
    p = np.exp(kept - kept[0])
    p /= p.sum()
    if top_p < 1.0:
        # keep tokens until the mass *before* them reaches top_p (the first one is always kept)
        n = min(int(np.searchsorted(np.cumsum(p), top_p, side="left")) + 1, p.size)
        order, p = order[:n], p[:n] / p[:n].sum()
    return order, p


def sampling_distribution(logits: np.ndarray, temperature: float, top_k: int = 0,
                          top_p: float = 1.0) -> np.ndarray:
    """Float64 probabilities over the vocabulary after temperature, top-k and top-p.

    Exposed so tests can compare the sampler against an independent reference.
    """
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    out = np.zeros_like(x)
    if temperature <= 0 or top_k == 1:
        out[int(np.argmax(x))] = 1.0
        return out
    order, p = _filtered(x, temperature, top_k, top_p)
    out[order] = p
    return out


def sample_token(logits: np.ndarray | None, params: SamplingParams, rng: np.random.Generator,
                 argmax: int | None = None) -> int:
    """Pick the next token. Greedy uses the device argmax when given (no logits transfer needed).

    Sampling consumes exactly one uniform draw per token, so a request's stream of draws is fixed
    by its seed alone.
    """
    if params.greedy:
        if argmax is not None:
            return int(argmax)
        return int(np.argmax(np.asarray(logits)))
    if logits is None:
        raise ValueError("sampling needs logits")
    u = rng.random()
    x = np.asarray(logits, dtype=np.float64).reshape(-1) / params.temperature
    if 0 < params.top_k < x.size:  # a small kept set: its whole descending order
        order, p = _filtered(x, 1.0, params.top_k, params.top_p)
        cum = np.cumsum(p)
        target = u * cum[-1]
    else:  # the whole vocabulary: its descending order only as far as top_p or the draw reaches
        e = np.exp(x - x.max())
        e /= e.sum()
        target = u  # the probabilities sum to 1
        c = min(x.size, 256)
        while True:
            order = _top_prefix(x, c)
            cum = np.cumsum(e[order])
            if params.top_p < 1.0 and cum[-1] >= params.top_p:  # the nucleus is in the prefix
                n = min(int(np.searchsorted(cum, params.top_p, side="left")) + 1, c)
                order, cum = order[:n], cum[:n]
                target = u * cum[-1]
                break
            if (params.top_p == 1.0 and cum[-1] > target) or c == x.size:  # the draw is in the prefix
                break
            c = 8 * c if 8 * c <= x.size // 4 else x.size  # a flat distribution: sort it all
    i = min(int(np.searchsorted(cum, target, side="right")), len(order) - 1)
    return int(order[i])


def token_logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """log p(token) under the model's own distribution (log-softmax of the raw logits, before
    temperature / top-k / top-p, as vLLM reports by default) and the k most likely (id, logprob),
    most likely first, ties by the lower id."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    m = x.max()
    lp = x - (m + np.log(np.exp(x - m).sum()))
    top = _top_prefix(lp, k)
    return float(lp[token]), [(int(t), float(lp[t])) for t in top]
