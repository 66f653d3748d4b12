"""A whole run: train from the seed (or take a master trained elsewhere), evaluate, and write the
model folder (official FP8/MXFP4 checkpoint, bf16 master, tokenizer, train_log.json)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsv4.model.checkpoint import load_checkpoint, write_checkpoint
from dsv4.model.config import ModelConfig
from dsv4.model.model import Transformer, init_random

from .config import TrainConfig
from .data import BatchSampler, prepare_data
from .evaluate import DEFAULT_PROMPT, eval_and_sample, evaluate
from .loop import train_steps
from .master import cast_model, load_master, master_model, save_master

__all__ = ["TrainResult", "train", "finish", "from_master"]


@dataclass
class TrainResult:
    model: Transformer  # fp32, training config
    cfg: ModelConfig  # the preset's config (runtime max_seq_len)
    tokenizer: Any
    history: list[dict[str, float]]
    record: dict[str, Any]
    eval_ids: torch.Tensor  # the held-out token stream


def _restores_torch_settings(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A run sets torch's thread count and flush-denormal mode for itself; the caller gets its own back
    (flush-denormal has no getter: torch's default, off, is restored), so code run after a training
    run in the same process (tests, a notebook) keeps IEEE denormals."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        threads = torch.get_num_threads()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
            torch.set_flush_denormal(False)
    return wrapper


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device}: {torch.cuda.get_device_name(torch.device(device))}, CUDA {torch.version.cuda}"
    return device


@_restores_torch_settings
def train(tcfg: TrainConfig = TrainConfig(), log: Callable[[str], None] | None = print,
          eval_windows: int | None = None, sample_tokens: int = 40, data: str | Path | None = None,
          on_best: Callable[[Transformer, dict[str, Any]], None] | None = None) -> TrainResult:
    """Tokenizer + model from the seed, `tcfg.steps` steps, then held-out eval (fp32 and bf16 eager)
    and a greedy sample. Deterministic for a given seed, torch build and machine (on CPU; CUDA
    kernels with atomics, e.g. index_add, may change the last bits from run to run).

    data: a folder from `save_data` instead of building corpus and tokenizer here. on_best(model,
    info): called after each periodic evaluation (tcfg.eval_every) that improves the held-out ppl.
    The model is initialized on the CPU (same weights on any device), then moved to tcfg.device;
    the final evaluations and the sample run on the CPU."""
    torch.manual_seed(tcfg.seed)
    torch.set_num_threads(tcfg.threads)
    torch.set_flush_denormal(True)  # denormal fp32 arithmetic is ~100x slower on x86
    corpus, cfg, tok, train_ids, eval_ids = prepare_data(tcfg, data)
    if log:
        ref = "matches" if corpus.matches_reference else f"DIFFERS from {corpus.reference_sha256}"
        log(f"corpus sha256 {corpus.sha256} ({ref}); train {len(train_ids):,} tokens, eval {len(eval_ids):,}")
    train_cfg = cfg.replace(max_seq_len=tcfg.seq_len)
    model = init_random(Transformer(train_cfg, dtype=torch.float32), seed=tcfg.seed, std=tcfg.init_std)
    n_params = sum(p.numel() for p in model.parameters() if p.is_floating_point())  # not tid2eid
    if log:
        log(f"preset {tcfg.preset}: {n_params:,} parameters; {tcfg.steps} steps of {tcfg.batch_size}x{tcfg.seq_len}")
    sampler = BatchSampler(train_ids, tcfg.seq_len, tcfg.batch_size, tcfg.seed)
    model.to(tcfg.device)
    best: dict[str, Any] = {"ppl": math.inf}
    evals: list[dict[str, float]] = []

    def on_eval(step: int) -> float:
        n = tcfg.eval_windows_during or None
        ppl = evaluate(model, eval_ids, tcfg.seq_len, tcfg.eval_batch, n)["ppl"]
        evals.append({"step": step, "tokens": step * tcfg.batch_size * tcfg.seq_len, "ppl": round(ppl, 3)})
        if ppl < best["ppl"]:
            best.update(ppl=ppl, step=step)
            if tcfg.keep_best:
                best["state"] = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            if on_best is not None:
                on_best(model, dict(step=step, ppl=ppl))
        return ppl

    t0 = time.perf_counter()
    history = train_steps(model, sampler, tcfg, log=log, on_eval=on_eval if tcfg.eval_every else None)
    if tcfg.device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    model.to("cpu")
    if tcfg.keep_best and "state" in best:
        model.load_state_dict(best.pop("state"))
        if log:
            log(f"keeping the weights of step {best['step']} (held-out ppl {best['ppl']:.2f} during training)")

    ev32 = evaluate(cast_model(model, cfg, torch.float32), eval_ids, tcfg.seq_len, tcfg.eval_batch, eval_windows)
    if log:
        log(f"fp32: held-out ppl {ev32['ppl']:.2f} over {ev32['tokens']:,} tokens")
    bf16 = master_model(model, cfg)  # exactly the shipped bf16 master
    ev16, sample = eval_and_sample(bf16, tok, eval_ids, tcfg.seq_len, tcfg.eval_batch, eval_windows,
                                   sample_tokens, "bf16 eager", log)
    tokens = history[-1]["tokens"] if history else 0
    record = {
        "train_config": dataclasses.asdict(tcfg),
        "parameters": n_params,
        "corpus_sha256": corpus.sha256,
        "corpus_matches_reference": corpus.matches_reference,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": tcfg.threads,
        "device": _device_name(tcfg.device),
        "train_tokens": tokens,
        "train_wall_s": round(wall, 1),
        "tokens_per_s": round(tokens / wall, 1) if wall else None,
        # process CPU time: with one thread, what the wall time would be on an idle machine
        "train_cpu_s": round(history[-1]["cpu_s"], 1) if history else None,
        "tokens_per_cpu_s": round(tokens / history[-1]["cpu_s"], 1) if history else None,
        "load_average_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "eval_during_training": evals,
        "kept_step": best.get("step") if tcfg.keep_best else None,
        # the tokens the returned weights were trained on (train_tokens counts every step run)
        "kept_tokens": best["step"] * tcfg.batch_size * tcfg.seq_len if tcfg.keep_best and "step" in best else tokens,
        "eval_fp32": ev32,
        "eval_bf16": ev16,
        "prompt": DEFAULT_PROMPT,
        "greedy_bf16": sample,
        "curve": [{k: round(h[k], 4) for k in ("step", "loss", "lm", "mtp", "indexer_kl", "indexer_captured",
                                               "load_max_over_mean", "wall_s", "eval_ppl")
                   if k in h} for h in history if h["step"] % tcfg.log_every == 0 or h["step"] == 1],
    }
    return TrainResult(model, cfg, tok, history, record, eval_ids)


def finish(res: TrainResult, out: str | Path, eval_windows: int | None = None, fp8: bool = True,
           log: Callable[[str], None] | None = print) -> None:
    """Write the run into `out`: the official FP8/MXFP4 checkpoint (evaluated and sampled here, bf16
    eager), then the bf16 master, tokenizer and train_log.json (res.record)."""
    seq_len, eval_batch = res.record["train_config"]["seq_len"], res.record["train_config"]["eval_batch"]
    if fp8:
        # first: with overwrite it removes every *.safetensors in the folder (an older master too)
        write_checkpoint(res.model, res.cfg, out, tokenizer=res.tokenizer, overwrite=True, progress=False)
        q = load_checkpoint(out, dtype=torch.bfloat16, progress=False)
        evq, sample = eval_and_sample(q, res.tokenizer, res.eval_ids, seq_len, eval_batch, eval_windows, 40,
                                      "official FP8/MXFP4 checkpoint (bf16 eager)", log)
        res.record["eval_fp8_checkpoint"] = evq
        res.record["greedy_fp8_checkpoint"] = sample
    written = save_master(res.model, res.cfg, out, res.tokenizer, res.record)
    if log:
        log(f"wrote {written}")


@_restores_torch_settings
def from_master(master: str | Path, tcfg: TrainConfig | None = None, data: str | Path | None = None,
                eval_windows: int | None = None, sample_tokens: int = 40, threads: int = 1,
                log: Callable[[str], None] | None = print) -> TrainResult:
    """A TrainResult from a master folder written by a run elsewhere (config.json,
    master-bf16.safetensors, train_log.json): its record, evaluated here (bf16 eager on this
    machine's CPU) and sampled, ready for `finish`. The run's own end-of-training evaluations are
    kept under "run_eval_fp32" / "run_eval_bf16" / "run_greedy_bf16"."""
    d = Path(master)
    record = json.loads((d / "train_log.json").read_text())
    tcfg = tcfg or TrainConfig(**{**record["train_config"], "betas": tuple(record["train_config"]["betas"])})
    torch.set_num_threads(threads)  # this machine's, not the run's
    torch.set_flush_denormal(True)
    corpus, cfg, tok, _, eval_ids = prepare_data(tcfg, data)
    if corpus.sha256 != record["corpus_sha256"]:
        raise RuntimeError(f"corpus {corpus.sha256} differs from the run's {record['corpus_sha256']}")
    model = load_master(d, torch.float32)
    if model.cfg != cfg:
        raise RuntimeError("the master's config is not the preset's")
    ev16, sample = eval_and_sample(master_model(model, cfg), tok, eval_ids, tcfg.seq_len, tcfg.eval_batch,
                                   eval_windows, sample_tokens, "bf16 eager here", log)
    for k in ("eval_fp32", "eval_bf16", "greedy_bf16"):
        if k in record:
            record["run_" + k] = record.pop(k)
    if "kept_tokens" not in record and record.get("kept_step"):
        record["kept_tokens"] = record["kept_step"] * tcfg.batch_size * tcfg.seq_len
    record.update(eval_bf16=ev16, greedy_bf16=sample, finished_here={
        "from_master": str(d), "python": platform.python_version(), "torch": torch.__version__,
        "machine": _cpu_name(), "threads": threads})
    return TrainResult(model, cfg, tok, [], record, eval_ids)
