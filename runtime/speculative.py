"""Speculative decoding on a compiled export with MTP entry points (torch-free).

The loop of model/generate.speculative_greedy on the module's ``mtp_prefill_bs{N}`` and
``verify_bs{N}_k{K}`` (contract/artifact.py; docs/runtime.md, Speculative decoding): each prompt is
prefilled in chunks, the token after each chunk passed as ``next_tokens`` (-1 after the last);
then every live row is verified in one call per step with [last token, its K drafts], and continues
with the ``accepted + 1`` tokens chosen at its first positions. The module keeps the state exact, so
the greedy output is plain greedy's; with a temperature the module applies the speculative-sampling
rule (model/speculative.py), each row drawing one key per call from its own generator.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dsv4.contract.artifact import ExportConfig, mtp_prefill_name, verify_name
from dsv4.contract.errors import EngineError

from .sampling import SamplingParams, SamplingParamsError

__all__ = ["speculative_greedy", "speculative_decode", "sampling_inputs"]


def sampling_inputs(n: int, sampled: Sequence[tuple[int, float, int, float, np.random.Generator]]
                    ) -> tuple[np.ndarray, ...]:
    """The speculative entry points' per-row sampling inputs for a call of batch size n: temperature
    f32, top_k i64, top_p f32, key i64. ``sampled``: (row, temperature, top_k, top_p, generator) of
    each sampled row, whose key is drawn from its generator; every other row is greedy (temperature 0)."""
    temp, top_k = np.zeros(n, np.float32), np.zeros(n, np.int64)
    top_p, key = np.ones(n, np.float32), np.zeros(n, np.int64)
    for i, t, k, p, rng in sampled:
        temp[i], top_k[i], top_p[i], key[i] = t, k, p, rng.integers(0, 2**32)
    return temp, top_k, top_p, key


def _batch_size(sizes: Sequence[int], n: int) -> int:
    """The smallest exported batch size that holds n rows (the largest when none does)."""
    fit = [b for b in sorted(sizes) if b >= n]
    return fit[0] if fit else max(sizes)


def speculative_greedy(module: Any, config: ExportConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       stop_ids: Sequence[int] = ()) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy continuations of `prompts`: `speculative_decode` at temperature 0."""
    return speculative_decode(module, config, prompts, max_new_tokens, stop_ids)


def speculative_decode(module: Any, config: ExportConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       stop_ids: Sequence[int] = (), temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                       seed: int = 0) -> tuple[list[list[int]], dict[str, Any]]:
    """Continuations of `prompts` (token ids) on `module` (an IreeModule of `config`'s export), prompt r
    in slot r: greedy at temperature 0, else sampled (temperature, top_k, top_p as SamplingParams)
    with prompt r's keys from numpy's Generator seeded [seed, r]. Returns (tokens per prompt,
    {"drafted", "accepted", "verify_calls", "prefill_calls"})."""
    spec = config.speculative
    if spec is None:
        raise EngineError(f"{config.directory} has no speculative entry points (export with --draft-tokens K)")
    k = int(spec["draft_tokens"])
    if not prompts or len(prompts) > config.n_slots:
        raise EngineError(f"{len(prompts)} prompts: need 1 .. n_slots = {config.n_slots}")
    if max_new_tokens < 1:
        raise EngineError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for p in prompts:
        if not p:
            raise EngineError("prompt is empty")
        if len(p) + max_new_tokens > config.max_seq_len:
            raise EngineError(f"prompt ({len(p)}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len "
                              f"{config.max_seq_len}")
    try:  # the Engine's own checks of the settings
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    except SamplingParamsError as e:
        raise EngineError(f"bad sampling settings: {e}") from None
    state = [module.zeros(s) for s in config.state]
    i64 = np.int64
    rngs = [np.random.default_rng([seed, r]) for r in range(len(prompts))]

    def sampling(rows: Sequence[int], n: int) -> tuple[np.ndarray, ...]:
        """The sampling inputs of a call whose first rows are prompts `rows` (padding: greedy)."""
        sampled = [(i, temperature, top_k, top_p, rngs[r]) for i, r in enumerate(rows)] if temperature > 0 else []
        return sampling_inputs(n, sampled)

    stats = {"drafted": 0, "accepted": 0, "verify_calls": 0, "prefill_calls": 0}
    pbs = _batch_size(spec["prefill_batch_sizes"], 1)
    tmin, tmax = config.prefill_min_tokens, config.prefill_max_tokens
    outs: list[list[int]] = []
    drafts: list[np.ndarray] = []
    pos: list[int] = []
    for r, p in enumerate(prompts):
        pad_slots = [s for s in range(config.n_slots) if s != r][:pbs - 1]
        for s in range(0, len(p), tmax):
            piece = list(p[s:s + tmax])
            toks = np.zeros((pbs, max(len(piece), tmin)), i64)
            toks[0, :len(piece)] = piece
            nxt = p[s + tmax] if s + tmax < len(p) else -1
            _, chosen, d = module(mtp_prefill_name(pbs), toks, np.array([s] + [0] * (pbs - 1), i64),
                                  np.array([len(piece)] + [0] * (pbs - 1), i64), np.array([r, *pad_slots], i64),
                                  np.array([nxt] + [-1] * (pbs - 1), i64), *sampling([r] if nxt < 0 else [], pbs),
                                  *state)
            stats["prefill_calls"] += 1
        if int(chosen[0]) < 0:
            raise EngineError("non-finite logits after the prompt (a broken build or weights)")
        outs.append([int(chosen[0])])
        drafts.append(np.asarray(d[0]))
        pos.append(len(p))
    stop = set(stop_ids)
    vbs = spec["verify_batch_sizes"]
    while live := [r for r in range(len(prompts)) if len(outs[r]) < max_new_tokens and outs[r][-1] not in stop]:
        n = _batch_size(vbs, len(live))
        rows = live[:n]  # rows beyond the largest batch size wait until earlier ones finish
        free = [s for s in range(config.n_slots) if s not in rows]
        toks = np.zeros((n, 1 + k), i64)
        lengths = np.zeros(n, i64)
        start = np.zeros(n, i64)
        slots = np.array(rows + free[:n - len(rows)], i64)
        for i, r in enumerate(rows):
            toks[i, 0], toks[i, 1:] = outs[r][-1], np.clip(drafts[r], 0, None)
            lengths[i] = min(1 + k, max_new_tokens - len(outs[r]))
            start[i] = pos[r]
        _, chosen, accepted, d = module(verify_name(n, k), toks, start, lengths, slots, *sampling(rows, n), *state)
        stats["verify_calls"] += 1
        for i, r in enumerate(rows):
            a = int(accepted[i])
            new = [int(t) for t in chosen[i, :a + 1]]
            if min(new) < 0:
                raise EngineError("non-finite logits in a verify call (a broken build or weights)")
            stats["drafted"] += int(lengths[i]) - 1
            stats["accepted"] += a
            for t in new:
                outs[r].append(t)
                if t in stop:
                    break
            drafts[r], pos[r] = np.asarray(d[i]), pos[r] + a + 1
    return outs, stats
