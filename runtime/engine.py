"""The inference engine: requests and the step loop over an exported DeepSeek-V4
(config.json + the .irpa weight shards + model.<target>.vmfb).

Torch-free on purpose (numpy, iree.runtime, tokenizers; jinja2 for chat), so it runs where only
the base install is present (the GPU hosts). The parts it drives live beside it:
``artifact`` (the export directory's contract), ``module`` (the IREE context on one device),
``batching`` (slots, padded calls), ``text`` (tokenizer, chat template, stop strings,
incremental detokenization) and ``sampling`` (host-side token choice).

How a request runs (docs/architecture.md, A request, step by step):
* the decode state is a handful of device arrays allocated once (zeros) and updated in place by
  every call; each request owns one *slot* (dim 0 of every state tensor) while it runs;
* calls are padded to the exported batch sizes with ``lengths == 0`` rows on slots that are not in
  the call (such rows leave the state untouched);
* sampled tokens are chosen on the device by the export's ``sample_bs{N}`` (only ids come back;
  greedy reads the step's argmax), or on the host from the logits for exports without it; either
  way each request draws from its own numpy Generator, so its tokens do not depend on what else is
  in the batch.

Scheduling: ``submit()`` queues a request; each ``step()`` first admits queued requests while
slots are free and prefills them (each prompt in chunks of at most ``prefill.max_tokens``
tokens; one request per call of the smallest ``prefill_bs{N}`` in the default batch-invariant
mode, several per padded call otherwise; each yields its first token), then runs one decode step
for every request that was already running, several per ``decode_bs{N}`` call. Requests join
and leave between steps (continuous batching). ``generate``/``generate_batch``/``stream`` are
loops over ``step()``. A speculative request (``SamplingParams(speculative=True)``, greedy or sampled,
on an export with ``--draft-tokens K``) runs every call through the MTP entry points instead: its prompt
through ``mtp_prefill_bs{N}`` (which also yields K drafts), each step through ``verify_bs{N}_k{K}``
(1 .. 1 + K tokens per step); it shares the slots and steps with plain requests, never their calls
(the MTP window is kept only by those entry points; docs/runtime.md, Speculative decoding). Those
entry points choose the tokens themselves, on the device, sampled ones by the speculative-sampling
rule (model/speculative.py): a verify call's state commit and next drafts depend on what it accepted,
so the rule cannot wait for the host. A sampled request draws one 32-bit key per call from its seed.

Not thread-safe: one thread drives an Engine.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from dsv4.contract.artifact import ExportConfig, mtp_prefill_name, target_for_device, verify_name
from .batching import SlotAllocator, plan_calls
from dsv4.contract.errors import ArtifactError, EngineError, RequestError
from .module import IreeModule, PipelineModule
from .sampling import SamplingParams, check_context, make_rng, sample_token, token_logprobs
from .speculative import sampling_inputs
from .text import IncrementalDecoder, StopMatcher, TextCodec

__all__ = ["Engine", "GenerationResult", "StreamChunk", "ScoreResult", "SamplingParams",
           "EngineError", "ArtifactError", "RequestError", "ExportConfig"]


@dataclass
class GenerationResult:
    """A finished request. ``tokens`` include the eos/stop token that ended it; ``text`` does not
    (special tokens are skipped and the text is cut before a stop string); ``text`` is None when
    the export has no tokenizer. ``seed`` reproduces a sampled request (greedy ones draw nothing
    from it); ``ttft_s`` is submit-to-first-token, ``tpot_s`` the mean time per later token.
    ``decode_calls`` counts the decode (or verify) calls the request took part in; a speculative
    request also has ``drafted`` (MTP drafts checked) and ``accepted`` (those the model agreed with),
    None otherwise."""

    request_id: int
    prompt_tokens: list[int]
    tokens: list[int]
    text: str | None
    stop_reason: str  # "eos" | "stop_token" | "stop_string" | "length" | "max_seq_len"
    seed: int | None
    ttft_s: float
    tpot_s: float | None
    decode_calls: int = 0
    drafted: int | None = None
    accepted: int | None = None

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted (None without speculation or drafts)."""
        return self.accepted / self.drafted if self.drafted else None

    def to_json(self) -> dict:
        out = {"tokens": self.tokens, "text": self.text, "ttft_s": self.ttft_s, "tpot_s": self.tpot_s,
               "stop_reason": self.stop_reason, "seed": self.seed, "prompt_tokens": len(self.prompt_tokens),
               "decode_calls": self.decode_calls}
        if self.drafted is not None:
            out.update(drafted=self.drafted, accepted=self.accepted, acceptance_rate=self.acceptance_rate)
        return out


@dataclass
class StreamChunk:
    """One generated token of one request, and the text that became safe to show with it."""

    request_id: int
    token: int
    text: str
    finished: bool = False
    stop_reason: str | None = None
    logprob: float | None = None  # with SamplingParams.logprobs: log p(token) and the top alternatives
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class ScoreResult:
    """``logprobs[i] = log p(tokens[i] | tokens[:i])``; logprobs[0] is None (nothing predicts it)."""

    tokens: list[int]
    logprobs: list[float | None]
    perplexity: float

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "logprobs": self.logprobs, "perplexity": self.perplexity}


@dataclass
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    rng: np.random.Generator
    seed: int
    stop_ids: frozenset
    eos_ids: frozenset
    matcher: StopMatcher
    detok: IncrementalDecoder | None
    t_submit: float
    slot: int | None = None
    pos: int = 0  # tokens written into the state
    tokens: list[int] = field(default_factory=list)
    emitted: int = 0  # characters of text already handed out
    text: str = ""
    stop_reason: str | None = None
    t_first: float | None = None
    t_last: float | None = None
    decode_calls: int = 0
    drafts: np.ndarray | None = None  # speculative: the MTP drafts for the next verify call
    drafted: int = 0
    accepted: int = 0

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None


class Engine:
    """A loaded export on one device: slots, state, tokenizer, and the generation loop.

    Typical use::

        eng = Engine("out/default")                       # llvm-cpu on this machine
        print(eng.generate("Hello", max_new_tokens=32).text)
        for chunk in eng.stream("Once upon", SamplingParams(temperature=0.8, seed=1)):
            print(chunk.text, end="", flush=True)
    """

    def __init__(self, export_dir: str | Path, device: str = "local-task", device_index: int = 0,
                 *, check_export_id: bool = True, batch_invariant: bool = True, devices: int | None = None,
                 stage_devices: Sequence[int] | None = None, device_sampling: bool = True):
        """Load ``export_dir`` (config.json, .irpa, the vmfb for ``device``) and allocate the state.

        ``device`` is an IREE driver: "local-task" / "local-sync" (the llvm-cpu vmfb), "cuda"
        (cuda), "hip" (gfx942); ``device_index`` picks the GPU. ``devices``: how many devices the
        export drives (default: its config.json's count; a multi-device or pipeline export opens GPUs
        device_index, device_index + 1, ... or that many local devices; ``stage_devices`` puts a pipeline
        export's stage k on device stage_devices[k] instead, e.g. [0, 0] on one GPU). With ``check_export_id`` the vmfb's
        baked-in export id must match config.json's. ``batch_invariant`` (default) prefills every
        request through one function, the smallest exported prefill batch size (one request per
        call when that is 1), so a request's logits are bitwise the same whatever else is running:
        IREE compiles prefill_bs1 and prefill_bs4 into code that rounds differently
        (docs/numerics.md; the cost is measured there). Decode stays batched: its functions
        agree bit for bit on llvm-cpu; on a GPU only in an export made with ``--batch-invariant``
        (measured on the H200 at decode batch sizes 1 to 64). Speculative verify calls go through
        one function too (the smallest exported verify batch size): verify functions of different
        sizes round differently even on llvm-cpu. False batches prefills and verify calls across the
        exported sizes (fewer calls, logits may differ in the last bits with the company).
        ``device_sampling`` (default) lets the export's ``sample_bs{N}`` pick sampled requests' tokens
        on the device (model/device_sampling.py): only ids come back. False, or an export without
        those functions, samples on the host from the logits (runtime/sampling.py). The two draw
        differently, so a seed gives other tokens on each path (each reproducible). Speculative
        requests always choose on the device, inside mtp_prefill/verify (docs/runtime.md).
        Raises ArtifactError for a missing, corrupt or mismatched artifact and EngineError for an
        unknown or unavailable device.
        """
        self.config = cfg = ExportConfig.load(export_dir)
        self.batch_invariant = batch_invariant
        self.device_sampling = device_sampling
        self.device_name = device
        self.target = target_for_device(device)
        self.vmfb_path = cfg.vmfb_path(self.target)
        self.parameters_paths = cfg.parameters_for(self.target)
        group = next(g for g in cfg.weight_groups() if self.target in g.targets)
        n_dev = cfg.n_devices if devices is None else devices
        if n_dev != cfg.n_devices:
            raise EngineError(f"{cfg.directory} was exported for {cfg.n_devices} device(s) "
                              f"(dsv4 export --devices {cfg.n_devices}), not {n_dev}")
        if stage_devices is not None and not cfg.pipeline:
            raise EngineError(f"stage_devices is for pipeline exports; {cfg.directory} is one module")
        if cfg.pipeline:  # one module per stage, stage k on device device_index + k
            self.module = PipelineModule(cfg.stage_vmfb_paths(self.target), self.parameters_paths, driver=device,
                                         device_index=device_index, expect=group.specs, state=cfg.state,
                                         stage_devices=stage_devices)
        else:
            self.module = IreeModule(self.vmfb_path, self.parameters_paths, driver=device, device_index=device_index,
                                     expect=group.specs, devices=n_dev)
        names = set(self.module.function_names)
        missing = [f for f in cfg.functions if f not in names]
        if missing:
            raise ArtifactError(f"{self.vmfb_path.name} lacks function(s) {', '.join(missing)} named in "
                                "config.json (vmfb from a different export?)")
        self.module_export_id = self.module.read_export_id()
        if check_export_id and self.module_export_id is not None and cfg.export_id is not None \
                and self.module_export_id != cfg.export_id:
            raise ArtifactError(f"{self.vmfb_path.name} was built by export {self.module_export_id} but "
                                f"config.json is from export {cfg.export_id}: the directory mixes artifacts "
                                "of two exports")
        self.slots = SlotAllocator(cfg.n_slots)
        self.state = [self.module.zeros(s) for s in cfg.state]
        self.text = TextCodec(cfg.tokenizer, cfg.bos_token_id) if cfg.tokenizer is not None else None
        self._queue: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._done: dict[int, GenerationResult] = {}
        self._next_id = 0
        self.stats = {"prefill_calls": 0, "prefill_rows": 0, "decode_calls": 0, "decode_rows": 0,
                      "decode_padded_rows": 0, "device_samples": 0, "verify_calls": 0, "drafted": 0, "accepted": 0}

    @property
    def draft_tokens(self) -> int | None:
        """K of the export's MTP speculative entry points (``dsv4 export --draft-tokens K``), None
        when it has none."""
        spec = self.config.speculative
        return None if spec is None else int(spec["draft_tokens"])

    # ---- text ------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The export's ``tokenizers.Tokenizer``, or None when it has none."""
        return None if self.text is None else self.text.tokenizer

    @property
    def chat_template(self) -> str | None:
        return None if self.text is None else self.text.chat_template

    def _need_text(self) -> TextCodec:
        if self.text is None:
            raise RequestError(f"export {self.config.directory} has no tokenizer; pass token ids")
        return self.text

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text`` taken literally (special-token strings inside it stay plain text)."""
        return self._need_text().encode(text, add_bos)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens dropped."""
        return self._need_text().decode(ids)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` ([{"role", "content"}]) rendered with the export's chat template
        (tokenizer_config.json); the template's own special tokens are recognised, contents are
        inserted as given. Needs jinja2."""
        return self._need_text().apply_chat_template(messages, add_generation_prompt)

    # ---- low level ---------------------------------------------------------------------------
    def invoke(self, name: str, tokens: np.ndarray, start_pos: np.ndarray, lengths: np.ndarray,
               slots: np.ndarray) -> Any:
        """One call of the exported entry point ``name`` on the engine's state (no request
        bookkeeping; for benchmarks and tests). Results stay device arrays (``.to_host()``)."""
        return self.module.function(name)(tokens, start_pos, lengths, slots, *self.state)

    # ---- requests --------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | Sequence[int], add_bos: bool) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty")
            ids = self.encode(prompt, add_bos=add_bos)
        else:
            ids = list(prompt)
        self.check_ids(ids)
        return ids

    def check_ids(self, ids: Sequence[Any]) -> None:
        """RequestError unless ``ids`` is a non-empty list of in-range token ids that fits the state."""
        if len(ids) == 0:
            raise RequestError("prompt is empty")
        v = self.config.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < v]
        if bad:
            raise RequestError(f"invalid token id(s) {bad[:5]}: ids must be integers in [0, {v})")
        if len(ids) > self.config.max_seq_len:
            raise RequestError(f"prompt has {len(ids)} tokens, longer than max_seq_len "
                               f"{self.config.max_seq_len} of this export")

    def check_length(self, n_prompt: int, max_new_tokens: int) -> None:
        """RequestError unless a prompt of `n_prompt` tokens plus `max_new_tokens` fits this export's
        context: `check_context`, the one rule for oversized requests (`dsv4 generate` and the server's
        400 context_length_exceeded). `submit` itself stops such a request at the context instead."""
        check_context(n_prompt, int(max_new_tokens), self.config.max_seq_len)

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               add_bos: bool = True, **kw: Any) -> int:
        """Queue a request (text or token ids); returns its id. Sampling fields may be given as kwargs."""
        try:
            params = replace(params or SamplingParams(), **kw) if kw else (params or SamplingParams())
        except (TypeError, ValueError) as e:
            raise RequestError(str(e)) from None
        ids = self._prompt_ids(prompt, add_bos)
        if params.stop and self.text is None:
            raise RequestError("stop strings need a tokenizer; this export has none")
        if params.speculative and self.config.speculative is None:
            raise RequestError(f"export {self.config.directory} has no speculative entry points (mtp_prefill, "
                               "verify); re-export with `dsv4 export --draft-tokens K` for speculative decoding")
        for t in params.stop_token_ids:
            if not 0 <= t < self.config.vocab_size:
                raise RequestError(f"stop token id {t} out of range [0, {self.config.vocab_size})")
        rng, seed = make_rng(params.seed)
        req = _Request(id=self._next_id, prompt=ids, params=params, rng=rng, seed=seed,
                       stop_ids=frozenset(params.stop_token_ids),
                       eos_ids=frozenset(() if params.ignore_eos else self.config.eos_token_ids),
                       matcher=StopMatcher(params.stop),
                       detok=None if self.text is None else IncrementalDecoder(self.text.decode),
                       t_submit=time.perf_counter())
        self._next_id += 1
        self._queue.append(req)
        return req.id

    @property
    def has_work(self) -> bool:
        """True while any request is queued or running (``step()`` has something to do)."""
        return bool(self._queue or self._running)

    def result(self, request_id: int) -> GenerationResult | None:
        """The finished request's result (kept until taken)."""
        return self._done.pop(request_id, None)

    def cancel(self, request_id: int) -> None:
        """Drop a queued or running request and release its slot."""
        for r in list(self._queue):
            if r.id == request_id:
                self._queue.remove(r)
                return
        for r in list(self._running):
            if r.id == request_id:
                self._running.remove(r)
                if r.slot is not None:
                    self.slots.free(r.slot)
                return

    # ---- the loop --------------------------------------------------------------------------
    def step(self) -> list[StreamChunk]:
        """Admit queued requests (prefill + first token), then one decode step for the others."""
        events: list[StreamChunk] = []
        decoding = [r for r in self._running if not r.finished]
        admitted = []
        while self._queue and self.slots.n_free:
            r = self._queue.popleft()
            r.slot = self.slots.allocate()
            self._running.append(r)
            admitted.append(r)
        plain = [r for r in admitted if not r.params.speculative]
        spec = [r for r in admitted if r.params.speculative]
        first = dict(zip((r.id for r in plain), self._prefill(plain)))
        first.update(zip((r.id for r in spec), self._prefill_speculative(spec)))
        for r in admitted:
            r.pos = len(r.prompt)
            events.append(self._accept(r, *first[r.id]))
        if any(not r.params.speculative for r in decoding):
            events.extend(self._decode([r for r in decoding if not r.params.speculative]))
        if any(r.params.speculative for r in decoding):
            events.extend(self._verify([r for r in decoding if r.params.speculative]))
        for r in [r for r in self._running if r.finished]:
            self._running.remove(r)
            self.slots.free(r.slot)
            self._done[r.id] = self._result(r)
        return events

    def _groups(self, reqs: list[_Request], sizes: Sequence[int]) -> Iterator[tuple[list[_Request], int, np.ndarray]]:
        """The calls that serve ``reqs``: (requests, exported batch size, slot of every row incl.
        the padding rows), largest usable batch size first."""
        for group, bs, rows in plan_calls(reqs, [r.slot for r in reqs], sizes, self.config.n_slots):
            yield group, bs, np.asarray(rows, dtype=np.int64)

    def _call_rows(self, fname: str, bs: int, rows: np.ndarray, pieces: Sequence[Sequence[int]],
                   starts: Sequence[int], T: int) -> tuple[Any, Any]:
        """``fname`` on row k = pieces[k] at position starts[k]; rows past the pieces (and empty
        pieces) have length 0."""
        tokens = np.zeros((bs, T), dtype=np.int64)
        sp = np.zeros(bs, np.int64)
        ln = np.zeros(bs, np.int64)
        for k, (p, st) in enumerate(zip(pieces, starts)):
            tokens[k, :len(p)] = p
            sp[k] = st
            ln[k] = len(p)
        res = self.invoke(fname, tokens, sp, ln, rows)
        return res[0], res[1]

    def _prefill(self, reqs: list[_Request]) -> list[tuple[np.ndarray | None, int, int | None]]:
        """Write each request's prompt into its slot, several requests per call (padding to an
        exported prefill batch size), each prompt in chunks of at most ``prefill.max_tokens``; a row
        whose prompt is done rides along with length 0 (its state untouched). Returns (logits or
        None, argmax, token sampled on the device or None) at each prompt's last token."""
        cfg = self.config
        step = cfg.prefill_max_tokens
        out: list[tuple[np.ndarray | None, int, int | None]] = []
        # batch-invariant: always the same function (the decode functions agree bit for bit on llvm-cpu;
        # cuda: docs/numerics.md)
        sizes = cfg.prefill_batch_sizes[:1] if self.batch_invariant else cfg.prefill_batch_sizes
        for group, bs, rows in self._groups(reqs, sizes):
            last: list[tuple[np.ndarray | None, int, int | None]] = [(None, -1, None)] * len(group)
            for s in range(0, max(len(r.prompt) for r in group), step):
                pieces = [r.prompt[s:s + step] for r in group]
                T = max(max(len(p) for p in pieces), cfg.prefill_min_tokens)
                logits_d, argmax_d = self._call_rows(f"prefill_bs{bs}", bs, rows, pieces, [s] * len(group), T)
                self.stats["prefill_calls"] += 1
                self.stats["prefill_rows"] += sum(1 for p in pieces if p)
                ending = [k for k, r in enumerate(group) if s < len(r.prompt) <= s + step]
                if ending:
                    argmax = np.asarray(argmax_d.to_host()).reshape(-1)
                    done = [(k, group[k]) for k in ending]
                    self._check_finite(f"prefill_bs{bs}", argmax, done)
                    ids = self._sample_on_device(logits_d, bs, done)
                    # a copy: the host view's buffer is reused by the next call (the next group's)
                    logits = (np.array(logits_d.to_host(), copy=True)
                              if self._need_host_logits([r for _, r in done], ids) else None)
                    for k in ending:
                        last[k] = (None if logits is None else logits[k], int(argmax[k]),
                                   None if ids is None else ids.get(k))
            out.extend(last)
        return out

    def _decode(self, reqs: list[_Request]) -> list[StreamChunk]:
        events = []
        for group, bs, rows in self._groups(reqs, self.config.decode_batch_sizes):
            n = len(group)
            logits_d, argmax_d = self._call_rows(f"decode_bs{bs}", bs, rows, [[r.tokens[-1]] for r in group],
                                                 [r.pos for r in group], 1)
            self.stats["decode_calls"] += 1
            self.stats["decode_rows"] += n
            self.stats["decode_padded_rows"] += bs - n
            argmax = np.asarray(argmax_d.to_host()).reshape(-1)
            self._check_finite(f"decode_bs{bs}", argmax, list(enumerate(group)))
            ids = self._sample_on_device(logits_d, bs, list(enumerate(group)))
            logits = np.asarray(logits_d.to_host()) if self._need_host_logits(group, ids) else None
            for k, r in enumerate(group):
                r.pos += 1
                r.decode_calls += 1
                events.append(self._accept(r, None if logits is None else logits[k], int(argmax[k]),
                                           None if ids is None else ids.get(k)))
        return events

    def _spec_sampling(self, bs: int, rows: list[tuple[int, _Request]]) -> tuple[np.ndarray, ...]:
        """The speculative entry points' sampling inputs for a call of batch size ``bs``: temperature
        (0: greedy, also every row not in ``rows`` (row index, request)), top_k, top_p and a key drawn
        from each sampled request's generator (greedy requests draw nothing)."""
        return sampling_inputs(bs, [(k, r.params.temperature, r.params.top_k, r.params.top_p, r.rng)
                                    for k, r in rows if not r.params.greedy])

    def _prefill_speculative(self, reqs: list[_Request]) -> list[tuple[None, int, int]]:
        """``_prefill`` through ``mtp_prefill_bs{N}``: the prompt's chunks also run the MTP block (each
        chunk is told the token after it, -1 after the prompt's last), so the request's MTP window is
        kept and the call returns the first K drafts. Returns (None, token, token) per request: the
        token the call chose after the prompt (greedy, or sampled on the device from the request's
        key) and leaves each request's drafts on it."""
        cfg = self.config
        step = cfg.prefill_max_tokens
        sizes = list(cfg.speculative["prefill_batch_sizes"]) if reqs else []
        sizes = sizes[:1] if self.batch_invariant else sizes
        out: list[tuple[None, int, int]] = []
        for group, bs, rows in self._groups(reqs, sizes):
            last: list[tuple[None, int, int]] = [(None, -1, -1)] * len(group)
            for s in range(0, max(len(r.prompt) for r in group), step):
                pieces = [r.prompt[s:s + step] for r in group]
                T = max(max(len(p) for p in pieces), cfg.prefill_min_tokens)
                tokens = np.zeros((bs, T), np.int64)
                sp, ln, nxt = np.zeros(bs, np.int64), np.zeros(bs, np.int64), np.full(bs, -1, np.int64)
                for k, (r, p) in enumerate(zip(group, pieces)):
                    tokens[k, :len(p)], sp[k], ln[k] = p, s, len(p)
                    if s + step < len(r.prompt):
                        nxt[k] = r.prompt[s + step]
                ending = [k for k, r in enumerate(group) if s < len(r.prompt) <= s + step]
                # a key only for the chunk that ends a prompt (the only one whose token is used)
                sampling = self._spec_sampling(bs, [(k, group[k]) for k in ending])
                name = mtp_prefill_name(bs)
                _, argmax_d, drafts_d = self.module.function(name)(tokens, sp, ln, rows, nxt, *sampling, *self.state)
                self.stats["prefill_calls"] += 1
                self.stats["prefill_rows"] += sum(1 for p in pieces if p)
                if ending:
                    argmax = np.asarray(argmax_d.to_host()).reshape(-1)
                    self._check_finite(name, argmax, [(k, group[k]) for k in ending])
                    drafts = np.array(drafts_d.to_host(), dtype=np.int64, copy=True).reshape(bs, -1)
                    for k in ending:
                        group[k].drafts = drafts[k]
                        last[k] = (None, int(argmax[k]), int(argmax[k]))
            out.extend(last)
        return out

    def _verify(self, reqs: list[_Request]) -> list[StreamChunk]:
        """One speculative step for ``reqs``: ``verify_bs{N}_k{K}`` on [last token, K drafts] per row
        (fewer real tokens where max_new_tokens or the context ends first); each row takes its
        accepted drafts and one token chosen by the call (1 .. 1 + K tokens), and its next drafts.
        Greedy rows accept a draft equal to the argmax; sampled rows by the speculative-sampling rule
        (model/speculative.py), so every token is distributed as plain sampling's."""
        k_d = self.draft_tokens
        events = []
        # batch-invariant: one verify function for every request (the smallest size), as prefill: on
        # llvm-cpu verify_bs1 and verify_bs3 round differently (docs/runtime.md, Batch invariance of verify)
        sizes = list(self.config.speculative["verify_batch_sizes"])
        for group, bs, rows in self._groups(reqs, sizes[:1] if self.batch_invariant else sizes):
            name = verify_name(bs, k_d)
            tokens = np.zeros((bs, 1 + k_d), np.int64)
            sp, ln = np.zeros(bs, np.int64), np.zeros(bs, np.int64)
            for k, r in enumerate(group):
                tokens[k, 0], tokens[k, 1:] = r.tokens[-1], np.clip(r.drafts, 0, None)
                sp[k] = r.pos
                ln[k] = min(1 + k_d, r.params.max_new_tokens - len(r.tokens), self.config.max_seq_len - r.pos)
            sampling = self._spec_sampling(bs, list(enumerate(group)))
            _, chosen_d, accepted_d, drafts_d = self.module.function(name)(tokens, sp, ln, rows, *sampling,
                                                                           *self.state)
            self.stats["verify_calls"] += 1
            self.stats["decode_calls"] += 1
            self.stats["decode_rows"] += len(group)
            self.stats["decode_padded_rows"] += bs - len(group)
            chosen = np.asarray(chosen_d.to_host()).reshape(bs, 1 + k_d)
            accepted = np.asarray(accepted_d.to_host()).reshape(-1)
            drafts = np.array(drafts_d.to_host(), dtype=np.int64, copy=True).reshape(bs, k_d)
            for k, r in enumerate(group):
                a = int(accepted[k])
                if not 0 <= a < ln[k]:
                    raise EngineError(f"{name} accepted {a} drafts of row {k} with {ln[k] - 1} (a broken build)")
                self._check_finite(name, chosen[k, :a + 1], [(i, r) for i in range(a + 1)])
                r.decode_calls += 1
                r.drafted += int(ln[k]) - 1
                r.accepted += a
                self.stats["drafted"] += int(ln[k]) - 1
                self.stats["accepted"] += a
                r.drafts = drafts[k]
                for t in chosen[k, :a + 1]:
                    r.pos += 1
                    events.append(self._accept(r, None, int(t), int(t)))
                    if r.finished:
                        break
        return events

    def _check_finite(self, fname: str, argmax: np.ndarray, rows: list[tuple[int, _Request]]) -> None:
        """The step marks a row whose logits hold NaN or inf with argmax -1 (export/exporter.py):
        such a row has no next token, and picking one anyway would be a wrong answer."""
        bad = [(k, r) for k, r in rows if argmax[k] < 0]
        if bad:
            k, r = bad[0]
            raise EngineError(f"{fname} returned non-finite logits for {len(bad)} request(s), e.g. request {r.id} "
                              f"(row {k}, slot {r.slot}, position {r.pos}): the export or its weights are "
                              "broken (docs/performance.md)")

    def _sample_on_device(self, logits_d: Any, bs: int, rows: list[tuple[int, _Request]]) -> dict[int, int] | None:
        """{row: token} for the sampled (non-greedy) requests among ``rows`` (row index in the call,
        request), chosen by the export's ``sample_bs{bs}`` on the logits still on the device; None
        when none of them samples or the export has no such function (the host then samples).
        Each sampled request draws one 32-bit key from its own generator."""
        name = f"sample_bs{bs}"
        todo = [(k, r) for k, r in rows if not r.params.greedy]
        if not todo or not self.device_sampling or not self.config.has_function(name):
            return None
        temp = np.zeros(bs, np.float32)  # 0: greedy (padding rows)
        top_k = np.zeros(bs, np.int64)
        top_p = np.ones(bs, np.float32)
        key = np.zeros(bs, np.int64)
        for k, r in todo:
            temp[k], top_k[k], top_p[k] = r.params.temperature, r.params.top_k, r.params.top_p
            key[k] = r.rng.integers(0, 2**32)
        ids = np.asarray(self.module.function(name)(logits_d, temp, top_k, top_p, key).to_host()).reshape(-1)
        self._check_finite(name, ids, todo)
        self.stats["device_samples"] += len(todo)
        return {k: int(ids[k]) for k, _ in todo}

    def _need_host_logits(self, reqs: Sequence[_Request], ids: dict[int, int] | None) -> bool:
        """Whether the host must read the logits: logprobs to report, or sampling the device did not do."""
        return any(r.params.logprobs is not None or (not r.params.greedy and ids is None) for r in reqs)

    def _accept(self, r: _Request, logits: np.ndarray | None, argmax: int, token: int | None = None) -> StreamChunk:
        """Take ``token`` (sampled on the device) or sample one for ``r`` on the host, extend its text
        (incrementally) and stop state, make its chunk."""
        tok = token if token is not None else sample_token(logits, r.params, r.rng, argmax=argmax)
        now = time.perf_counter()
        if r.t_first is None:
            r.t_first = now
        r.t_last = now
        r.tokens.append(tok)
        if tok in r.eos_ids:
            r.stop_reason = "eos"
        elif tok in r.stop_ids:
            r.stop_reason = "stop_token"
        elif len(r.tokens) >= r.params.max_new_tokens:
            r.stop_reason = "length"
        elif r.pos >= self.config.max_seq_len:
            r.stop_reason = "max_seq_len"  # the next token would have no position to go to
        delta = ""
        if r.detok is not None:
            before = len(r.text)
            r.text += r.detok.push(tok)
            if r.finished:
                r.text += r.detok.flush()
            cut = r.matcher.find_new(r.text, before)
            if cut is not None:
                r.text = r.text[:cut]
                r.stop_reason = "stop_string"
            upto = len(r.text) if r.finished else r.matcher.safe_len(r.text)
            if upto > r.emitted:
                delta = r.text[r.emitted:upto]
                r.emitted = upto
        chunk = StreamChunk(r.id, tok, delta, r.finished, r.stop_reason)
        if r.params.logprobs is not None:
            chunk.logprob, chunk.top_logprobs = token_logprobs(logits, tok, r.params.logprobs)
        return chunk

    def _result(self, r: _Request) -> GenerationResult:
        n = len(r.tokens)
        tpot = (r.t_last - r.t_first) / (n - 1) if n > 1 else None
        spec = r.params.speculative
        return GenerationResult(r.id, r.prompt, list(r.tokens), r.text if self.text is not None else None,
                                r.stop_reason, r.seed, r.t_first - r.t_submit, tpot, r.decode_calls,
                                r.drafted if spec else None, r.accepted if spec else None)

    # ---- one-shot and streaming front ends -------------------------------------------------
    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               add_bos: bool = True, **kw: Any) -> Iterator[StreamChunk]:
        """Tokens of one request as they are produced (other queued requests advance too).

        The final GenerationResult is available afterwards from ``result(chunk.request_id)``.
        """
        rid = self.submit(prompt, params, add_bos=add_bos, **kw)
        done = False
        try:
            while not done:
                for ev in self.step():
                    if ev.request_id == rid:
                        done = ev.finished
                        yield ev
        finally:
            if not done:  # the consumer stopped early: release the slot
                self.cancel(rid)

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                 add_bos: bool = True, **kw: Any) -> GenerationResult:
        """Run one request to completion."""
        rid = self.submit(prompt, params, add_bos=add_bos, **kw)
        while rid not in self._done:
            self.step()
        return self._done.pop(rid)

    def generate_batch(self, prompts: Sequence[str | Sequence[int]],
                       params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                       add_bos: bool = True) -> list[GenerationResult]:
        """Run several requests together (decoded in shared batches); results in input order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.submit(p, sp, add_bos=add_bos) for p, sp in zip(prompts, params)]
        while not all(i in self._done for i in ids):
            self.step()
        return [self._done.pop(i) for i in ids]

    # ---- scoring ---------------------------------------------------------------------------
    def score(self, ids: Sequence[int] | str, *, add_bos: bool = True, max_chunk: int | None = None) -> ScoreResult:
        """Per-token log-probabilities and perplexity of ``ids`` via ``score_bs1``.

        Sequences longer than one call (``prefill.max_tokens``, or ``max_chunk``) are scored in
        chunks that overlap by one token: chunk k covers ids[s:e] and yields log p(ids[t+1]) for
        s <= t < e-1, and the next chunk starts at e-1. Re-writing position e-1 is safe for the
        same reason slot reuse is: reads of the state are masked by position, so what a position
        held before it is written again is never seen.
        """
        cfg = self.config
        if "score_bs1" not in cfg.functions:
            raise ArtifactError(f"export {cfg.directory} has no score_bs1 function (exported with --no-score, "
                                "as `make run` does); re-export without --no-score to score")
        if isinstance(ids, str):
            ids = self._prompt_ids(ids, add_bos)
        ids = list(ids)
        self.check_ids(ids)
        if len(ids) < 2:
            raise RequestError("scoring needs at least 2 tokens (the first one is not predicted)")
        L = min(cfg.prefill_max_tokens, max_chunk or cfg.prefill_max_tokens)
        if L < 2:
            raise RequestError("max_chunk must be at least 2")
        if not self.slots.n_free:
            raise EngineError(f"all {cfg.n_slots} slots are in use; cannot score now")
        slot = self.slots.allocate()
        lps: list[float | None] = [None]
        try:
            s = 0
            while s < len(ids) - 1:
                piece = ids[s:s + L]
                T = max(len(piece), cfg.prefill_min_tokens)
                tokens = np.zeros((1, T), np.int64)
                tokens[0, :len(piece)] = piece
                out = self.invoke("score_bs1", tokens, np.array([s], np.int64), np.array([len(piece)], np.int64),
                                  np.array([slot], np.int64))
                if isinstance(out, (tuple, list)):
                    out = out[0]
                lp = np.asarray(out.to_host() if hasattr(out, "to_host") else out, dtype=np.float64).reshape(-1)
                lps.extend(float(x) for x in lp[:len(piece) - 1])
                s += len(piece) - 1
        finally:
            self.slots.free(slot)
        vals = np.asarray(lps[1:], dtype=np.float64)
        return ScoreResult(ids, lps, float(math.exp(-vals.mean())))
