"""Train the embedded "small" DeepSeek-V4 model: on CPU, reproducibly, in minutes, or longer on a GPU.

The model is the exact V4 architecture at toy size (preset "small": sliding-only, CSA with the
lightning indexer, HCA, hash-routed and score-routed MoE with a shared expert, mHC, MTP) trained on
the CPython-docs corpus (`corpus.py`) with the corpus BPE tokenizer (`tokenizer.py`).

Choices, and why:
* fp32 master weights and fp32 compute. The CPU has no fast path that makes bf16 training cheaper
  for this op mix (the step is dominated by small element-wise ops), bf16 weights would lose the
  small AdamW updates, and fp32 needs no loss scaling. The result is evaluated and shipped in bf16
  (and quantized to the official FP8/MXFP4 format), the reference's inference dtypes.
* Forward = the model's own chunk forward (`Transformer.hidden` + `logits`, i.e. `model(...,
  all_logits=True)`) from position 0 with a fresh state per batch; autograd runs through the
  in-place `index_put_` state writes (compressed entries are written to the state, then read back).
* QAT as the release: the FP8 KV / FP4 indexer simulations stay on and pass gradients straight
  through (`quant_sim.straight_through`); forward values are exactly the inference values.
* Losses: next-token cross entropy + `mtp_weight` x the MTP block's cross entropy on token t+2
  + `indexer_weight` x the indexer KL: KL(p_attn || softmax(indexer scores)) over the visible
  compressed entries, where p_attn is the main attention's distribution over those entries (scores
  q·k of every head against every visible entry, softmax per head, summed over heads, normalized;
  detached), as DeepSeek trains its lightning indexer. The indexer's inputs are detached (the
  `Indexer.aux` hook), so this loss trains only the indexer and the LM loss never reaches it.
* Speed: the `moe_experts` kernel hook is swapped (kernels.overrides) for `routed_moe_experts`,
  which runs each expert on its routed tokens only: the same math as the reference (whose unrouted
  tokens get weight exactly 0), E/k = 4x fewer expert FLOPs. Evaluation uses the reference.
* MoE balance as DeepSeek does it (ExpertLoad): the auxiliary-loss-free bias (after each step every
  score-routed gate's selection bias moves by `bias_update` x sign(mean load - expert load)) plus
  the complementary balance loss with a small weight (`balance_weight`).
* One thread by default: on the 2 shared cores of the dev machine, a second OpenMP thread gained
  nothing whenever another process was busy (and lost 2-4x with spinning waits, see below), and
  the step is dominated by small element-wise ops. Results are bitwise reproducible for a given
  seed, thread count, torch build and machine (the thread count changes fp32 summation order).
* Sequences are 256 tokens (+2 for the MTP target) cut from the token stream of the training
  documents (each framed by bos/eos) at a per-epoch random offset, in a per-epoch random order:
  both from generators seeded by (seed, epoch), so the data order is a pure function of the seed.
  Training runs the model with max_seq_len = seq_len: that only sizes the state and the RoPE tables
  (positions < seq_len see the same values), so the weights are the preset's, at lower cost.

Run: ``python -m dsv4.model.train`` writes model/assets/small: the official-layout FP8/MXFP4
checkpoint (config.json, model.safetensors: what `checkpoint.load_checkpoint` loads, the default),
the bf16 master (master-bf16.safetensors, this model's state_dict names: `load_master`), the
tokenizer files and train_log.json (settings, loss curve, timings, evaluations).

A longer run on a GPU (how the shipped model was made; docs/training.md has the commands):
* ``--save-data DIR`` here writes the tokenized train/eval streams, the tokenizer and the corpus
  hash: the corpus comes from the local stdlib (its hash is checked against the reference), so it is
  built here, not on a GPU host with another Python;
* there, ``--data DIR --device cuda`` trains on them (the model is initialized on the CPU, so the
  start is the same on any device); ``--eval-every N`` measures the held-out perplexity during
  training, ``--keep-best true`` returns the weights of the best such evaluation (the corpus is
  small: a few hundred k tokens, which this model overfits after about ten epochs), ``--snapshot``
  writes each new best master as it comes, ``--out DIR --no-fp8`` the master + train_log.json;
* back here, ``--from-master DIR`` evaluates that master on this CPU (bf16 eager), writes the
  official checkpoint into --out, evaluates and samples it, and writes master + train_log.json
  (the run's record, with this machine's evaluations added).
"""

from __future__ import annotations

import os

# Read by libgomp when torch is first imported, so it only takes effect if this module is imported
# before torch (as `python -m dsv4.model.train` does). It matters for --threads 2: with spinning
# OpenMP workers, 2 threads on the 2 shared dev cores ran 2-4x slower than 1 thread whenever another
# process was busy; with passive waiting they ran about as fast as 1 (hence the default of 1).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from . import quant_sim  # noqa: E402
from .checkpoint import EMBEDDED_PROMPT  # noqa: E402
from .config import ModelConfig  # noqa: E402
from .kernels import overrides  # noqa: E402
from .kernels.indexer import indexer_scores  # noqa: E402
from .kernels.linear import linear  # noqa: E402
from .kernels.moe import swiglu  # noqa: E402
from .model import Gate, Indexer, Transformer, init_random  # noqa: E402
from .state import new_state  # noqa: E402

__all__ = [
    "TrainConfig",
    "TrainResult",
    "token_stream",
    "BatchSampler",
    "compute_losses",
    "indexer_kl",
    "routed_moe_experts",
    "ExpertLoad",
    "make_optimizer",
    "lr_at",
    "train_steps",
    "train",
    "evaluate",
    "greedy",
    "cast_model",
    "master_state",
    "master_model",
    "save_master",
    "load_master",
    "MASTER_FILE",
    "DEFAULT_PROMPT",
]

MASTER_FILE = "master-bf16.safetensors"
DEFAULT_PROMPT = EMBEDDED_PROMPT  # the fixed prompt of `make run` (defined beside the checkpoint location)
ASSETS = Path(__file__).resolve().parent / "assets"

# Small fp32 tensors the official checkpoint also keeps in fp32 (spec §4.2); everything else
# floating-point is stored bf16 in the master.
_F32_LEAVES = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
               "hc_head_fn", "hc_head_base", "hc_head_scale", "attn_sink", "ape", "bias")


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of a training run. `TrainConfig()` is the CPU default (500 steps of 4x256); the
    shipped model's settings are in its train_log.json (a GPU run, docs/training.md)."""

    preset: str = "small"
    seed: int = 0
    seq_len: int = 256
    batch_size: int = 4
    steps: int = 500
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    indexer_weight: float = 1.0
    bias_update: float = 0.01
    balance_weight: float = 0.01
    quant_sim: bool = True
    routed_moe: bool = True
    init_std: float = 0.02
    threads: int = 1
    log_every: int = 10
    eval_batch: int = 8
    # where the steps run: "cpu" (the default, bitwise reproducible) or e.g. "cuda" for a longer run
    device: str = "cpu"
    # every N steps (0: never) the held-out perplexity of the training model (fp32, max_seq_len =
    # seq_len, reference MoE kernel) is measured on the first eval_windows_during windows (0: all)
    eval_every: int = 0
    eval_windows_during: int = 0
    # with eval_every: the result is the weights of the evaluation with the lowest perplexity
    # (early stopping on the held-out curve) instead of the last step's
    keep_best: bool = False


# ---------------------------------------------------------------------------------------------
# data


def token_stream(tok: Any, docs: Sequence[str]) -> torch.Tensor:
    """All documents as one int64 stream, each framed as bos + text + eos (how documents are seen)."""
    from .tokenizer import BOS_ID, EOS_ID

    tok.encode_special_tokens = True
    ids: list[int] = []
    for enc in tok.encode_batch(list(docs), add_special_tokens=False):
        ids.append(BOS_ID)
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


class BatchSampler:
    """Deterministic random-access batches of `seq_len + 2` tokens (inputs, next, and t+2 targets).

    Epoch e cuts the stream into chunks at an offset drawn from a generator seeded by (seed, e) and
    visits them in a permutation from the same generator; batch `step` is chunks
    [step*B, (step+1)*B) of that sequence, so any step can be produced without replaying the others.
    """

    def __init__(self, stream: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        self.stream, self.L, self.B, self.seed = stream, seq_len + 2, batch_size, seed
        self.per_epoch = (len(stream) - self.L) // self.L
        if self.per_epoch < 1:
            raise ValueError(f"stream of {len(stream)} tokens is too short for sequences of {self.L}")
        self._epoch: tuple[int, torch.Tensor] | None = None

    def _starts(self, epoch: int) -> torch.Tensor:
        if self._epoch is None or self._epoch[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            offset = int(torch.randint(0, self.L, (1,), generator=g))
            order = torch.randperm(self.per_epoch, generator=g)
            self._epoch = (epoch, offset + order * self.L)
        return self._epoch[1]

    def batch(self, step: int) -> torch.Tensor:
        rows = []
        for i in range(step * self.B, (step + 1) * self.B):
            s = int(self._starts(i // self.per_epoch)[i % self.per_epoch])
            rows.append(self.stream[s:s + self.L])
        return torch.stack(rows)


# ---------------------------------------------------------------------------------------------
# losses


def routed_moe_experts(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                       w1: torch.Tensor, s1: torch.Tensor | None, w2: torch.Tensor, s2: torch.Tensor | None,
                       w3: torch.Tensor, s3: torch.Tensor | None, limit: float) -> torch.Tensor:
    """The `moe_experts` hook computed on routed tokens only (training speed; same math).

    The reference runs every expert on every token and multiplies unrouted ones by a zero weight,
    which keeps export static but costs E/k times the work; their contribution (and gradient) is
    exactly zero, so running each expert on its own tokens gives the same result up to fp32
    summation order. Eager only (data-dependent shapes)."""
    N, k = indices.shape
    E = w1.shape[0]
    flat = indices.flatten()
    order = torch.argsort(flat, stable=True)
    token = order // k
    wsel = weights.flatten()[order][:, None]
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    a0 = 0
    for e, c in enumerate(torch.bincount(flat, minlength=E).tolist()):
        if c:
            t = token[a0:a0 + c]
            xe = x[t]
            s1e, s2e, s3e = (None if s is None else s[e] for s in (s1, s2, s3))
            a = swiglu(linear(xe, w1[e], s1e), linear(xe, w3[e], s3e), limit) * wsel[a0:a0 + c]
            y = y.index_add(0, t, linear(a.to(x.dtype), w2[e], s2e).float())
            a0 += c
    return y


def indexer_kl(aux: dict[str, torch.Tensor], attn_scale: float, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(main attention || indexer) over visible compressed entries, and the attention mass the
    indexer's top-k captures (NaN when no query had more than k entries to choose from).

    Rows with fewer than two visible entries carry no information and are skipped.
    """
    q, w, keys, n_vis = aux["q"], aux["w"], aux["keys"], aux["n_vis"]
    R = keys.shape[1]
    vis = torch.arange(R, device=keys.device) < n_vis[..., None]  # [B,T,R]
    rows = n_vis >= 2
    v = vis[rows]
    if v.shape[0] == 0:
        zero = (q.sum() * 0.0) + (w.sum() * 0.0) + (keys.sum() * 0.0)
        return zero, torch.tensor(float("nan"), device=keys.device)
    logp = torch.log_softmax(indexer_scores(q, w, keys).float()[rows].masked_fill(~v, float("-inf")), -1)
    with torch.no_grad():
        s = torch.einsum("bthd,brd->bthr", aux["attn_q"].float(), aux["attn_kv"].float()) * attn_scale
        s = s[rows].masked_fill(~v[:, None, :], float("-inf"))  # [N,H,R]
        p = s.softmax(-1).sum(1)
        p = p / p.sum(-1, keepdim=True)
        sel = aux["sel"][rows]
        choose = n_vis[rows] > topk
        got = (p.gather(-1, sel.clamp(min=0)) * (sel >= 0)).sum(-1)
        captured = got[choose].mean() if bool(choose.any()) else torch.tensor(float("nan"), device=keys.device)
    kl = (torch.xlogy(p, p) - p * logp.masked_fill(~v, 0.0)).sum(-1)
    return kl.mean(), captured


def _indexers(model: Transformer) -> list[tuple[Indexer, float]]:
    return [(layer.attn.indexer, layer.attn.scale) for layer in model.layers if hasattr(layer.attn, "indexer")]


def compute_losses(model: Transformer, batch: torch.Tensor, mtp_weight: float = 0.3,
                   indexer_weight: float = 1.0) -> dict[str, torch.Tensor]:
    """Training losses of one batch [B, T+2] run from position 0 with a fresh state.

    Returns lm (next token), mtp (token t+2), indexer_kl, indexer_captured (diagnostic) and loss
    (their weighted sum; train_steps adds the MoE balance term). indexer_weight=0 leaves the aux
    hook off entirely.
    """
    cfg = model.cfg
    B, T = batch.shape[0], batch.shape[1] - 2
    dev = batch.device
    state = new_state(cfg, B, model.dtype, device=dev)
    start = torch.zeros(B, dtype=torch.long, device=dev)
    lengths = torch.full((B,), T, dtype=torch.long, device=dev)
    slots = torch.arange(B, device=dev)
    inp, nxt, nxt2 = batch[:, :T], batch[:, 1:T + 1], batch[:, 2:T + 2]
    idx = _indexers(model) if indexer_weight else []
    for ix, _ in idx:
        ix.aux = {}
    try:
        h = model.hidden(inp, start, lengths, slots, state)
        logits = model.logits(h, lengths, all_logits=True)
        out = {"lm": F.cross_entropy(logits.flatten(0, 1), nxt.flatten())}
        loss = out["lm"]
        if cfg.n_mtp and mtp_weight:
            ml = model.mtp_logits(h, nxt, start, lengths, slots, state, all_logits=True)
            out["mtp"] = F.cross_entropy(ml.flatten(0, 1), nxt2.flatten())
            loss = loss + mtp_weight * out["mtp"]
        if idx:
            kls, caps = zip(*(indexer_kl(ix.aux, scale, ix.topk) for ix, scale in idx))
            out["indexer_kl"] = torch.stack(kls).mean()
            out["indexer_captured"] = torch.stack(caps).nanmean()
            loss = loss + indexer_weight * out["indexer_kl"]
        out["loss"] = loss
    finally:
        for ix, _ in idx:
            ix.aux = None
    return out


class ExpertLoad:
    """MoE load balancing as DeepSeek does it, attached with forward hooks on the score-routed gates.

    * auxiliary-loss-free: counts routed tokens per expert; `update` moves each gate's selection
      bias by speed * sign(mean load - load) (noaux_tc; the bias steers selection only);
    * the complementary balance loss sum_i f_i P_i (f_i = routed share of expert i x E/k over
      the batch, P_i = mean normalized affinity s_i / sum_j s_j), which DeepSeek adds with a tiny
      weight. Both are needed here: in a few hundred steps the bias alone cannot keep up with a gate
      whose logits share one direction across tokens (routing collapsed onto 2 of 8 experts).
    Hash-routed gates have no bias and a fixed token -> experts table: nothing to balance.
    """

    def __init__(self, model: Transformer):
        self.gates = [m for m in model.modules() if isinstance(m, Gate) and m.bias is not None]
        self.counts = {id(g): torch.zeros(g.bias.shape[0]) for g in self.gates}
        self.balance: list[torch.Tensor] = []
        self.handles = [g.register_forward_hook(self._hook) for g in self.gates]

    def _hook(self, gate: Gate, inputs: tuple[torch.Tensor, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        if not torch.is_grad_enabled():  # training forwards only
            return
        x, idx = inputs[0], output[1]
        E, k = gate.bias.shape[0], idx.shape[-1]
        count = torch.bincount(idx.flatten(), minlength=E).float()
        self.counts[id(gate)] += count.detach().cpu()
        s = F.softplus(F.linear(x.float(), gate.weight.float())).sqrt()
        P = (s / s.sum(-1, keepdim=True)).mean(0)
        f = count * E / (k * idx.shape[0])
        self.balance.append((f * P).sum())

    def take_balance_loss(self) -> torch.Tensor | None:
        """Mean balance loss of the gates run since the last call (1.0 when perfectly balanced)."""
        out = torch.stack(self.balance).mean() if self.balance else None
        self.balance = []
        return out

    @torch.no_grad()
    def update(self, speed: float) -> float:
        """Apply the bias step and reset the counts; returns the worst max/mean load ratio seen."""
        worst = 0.0
        for g in self.gates:
            c = self.counts[id(g)]
            if c.sum() > 0:
                worst = max(worst, float(c.max() / c.mean()))
                g.bias += speed * torch.sign(c.mean() - c).to(g.bias)
            c.zero_()
        return worst

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# ---------------------------------------------------------------------------------------------
# optimization


def make_optimizer(model: Transformer, tcfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on the weight matrices (embedding and head included) and none on
    vectors (norms, mHC base/scale, attention sinks) or the compressors' position biases (ape).
    Gate biases are not optimized: ExpertLoad sets them (the top-k gives them no gradient)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad or not p.is_floating_point() or name.endswith("gate.bias"):
            continue
        leaf = name.rsplit(".", 1)[-1]
        (decay if p.dim() >= 2 and leaf != "ape" else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": tcfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=tcfg.lr, betas=tcfg.betas, eps=1e-8)


def lr_at(step: int, tcfg: TrainConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at the last step."""
    if step < tcfg.warmup_steps:
        return tcfg.lr * (step + 1) / tcfg.warmup_steps
    t = (step - tcfg.warmup_steps) / max(1, tcfg.steps - tcfg.warmup_steps - 1)
    return tcfg.min_lr + 0.5 * (tcfg.lr - tcfg.min_lr) * (1 + math.cos(math.pi * min(1.0, t)))


def train_steps(model: Transformer, sampler: BatchSampler, tcfg: TrainConfig, steps: int | None = None,
                log: Callable[[str], None] | None = print,
                on_eval: Callable[[int], float] | None = None) -> list[dict[str, float]]:
    """Run the optimization loop on `model` (fp32, training config); returns per-step metrics.

    Batches go to the model's device. With tcfg.eval_every and `on_eval` (step -> held-out ppl, run
    with the model in eval mode and gradients off), each eval_every-th step and the last record it
    as `eval_ppl`."""
    steps = tcfg.steps if steps is None else steps
    dev = next(model.parameters()).device
    opt = make_optimizer(model, tcfg)
    load = ExpertLoad(model)
    params = [p for g in opt.param_groups for p in g["params"]]
    history: list[dict[str, float]] = []
    model.train()
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        for step in range(steps):
            lr = lr_at(step, tcfg)
            for g in opt.param_groups:
                g["lr"] = lr
            batch = sampler.batch(step).to(dev)
            kernels = {"moe_experts": routed_moe_experts} if tcfg.routed_moe else {}
            with quant_sim.straight_through(tcfg.quant_sim), overrides(kernels):
                out = compute_losses(model, batch, tcfg.mtp_weight, tcfg.indexer_weight)
                bal = load.take_balance_loss()
                if bal is not None:
                    out["balance"] = bal
                    if tcfg.balance_weight:
                        out["loss"] = out["loss"] + tcfg.balance_weight * bal
                out["loss"].backward()
            gnorm = torch.nn.utils.clip_grad_norm_(params, tcfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            imbalance = load.update(tcfg.bias_update)
            rec = {k: float(v.detach()) for k, v in out.items()}
            rec.update(step=step + 1, lr=lr, grad_norm=float(gnorm), load_max_over_mean=imbalance,
                       tokens=(step + 1) * batch.shape[0] * (batch.shape[1] - 2), wall_s=time.perf_counter() - t0,
                       cpu_s=time.process_time() - c0)
            if on_eval is not None and tcfg.eval_every and ((step + 1) % tcfg.eval_every == 0 or step + 1 == steps):
                model.eval()
                with torch.no_grad():
                    rec["eval_ppl"] = on_eval(step + 1)
                model.train()
                if log:
                    log(f"step {step + 1:5d}/{steps}  held-out ppl {rec['eval_ppl']:.2f}  ({rec['wall_s']:.0f} s)")
            history.append(rec)
            if log and ((step + 1) % tcfg.log_every == 0 or step == 0 or step + 1 == steps):
                log(f"step {step + 1:5d}/{steps}  loss {rec['loss']:.4f}  lm {rec['lm']:.4f}  "
                    f"mtp {rec.get('mtp', float('nan')):.4f}  idx_kl {rec.get('indexer_kl', float('nan')):.4f}  "
                    f"idx_cap {rec.get('indexer_captured', float('nan')):.3f}  lr {lr:.2e}  gn {rec['grad_norm']:.2f}  "
                    f"load {imbalance:.2f}  {rec['tokens'] / rec['wall_s']:.0f} tok/s ({rec['tokens'] / rec['cpu_s']:.0f}/cpu-s)")
    finally:
        load.remove()
    model.eval()
    return history


# ---------------------------------------------------------------------------------------------
# evaluation and generation


@torch.no_grad()
def evaluate(model: Transformer, stream: torch.Tensor, seq_len: int, batch_size: int = 8,
             max_windows: int | None = None) -> dict[str, float]:
    """Held-out perplexity: non-overlapping windows of seq_len predictions, each from position 0."""
    n = (len(stream) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    dev = model.embed.weight.device
    nll, count = 0.0, 0
    for a in range(0, n, batch_size):
        rows = torch.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in range(a, min(n, a + batch_size))])
        rows = rows.to(dev)
        B = rows.shape[0]
        state = new_state(model.cfg, B, model.dtype, device=dev)
        logits = model(rows[:, :-1], torch.zeros(B, dtype=torch.long, device=dev),
                       torch.full((B,), seq_len, device=dev), torch.arange(B, device=dev), state, all_logits=True)
        nll += float(F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(), reduction="sum"))
        count += rows[:, 1:].numel()
    return {"nll": nll / count, "ppl": math.exp(nll / count), "tokens": count}


@torch.no_grad()
def greedy(model: Transformer, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation: one prefill of the prompt, then one-token decode steps on the state."""
    state = new_state(model.cfg, 1, model.dtype)
    one = torch.ones(1, dtype=torch.long)
    logits = model(torch.tensor([list(prompt)]), 0 * one, len(prompt) * one, 0 * one, state)
    out: list[int] = []
    for pos in range(len(prompt), len(prompt) + max_new_tokens):
        out.append(int(logits[0].argmax()))
        if pos + 1 >= model.cfg.max_seq_len:
            break
        logits = model(torch.tensor([[out[-1]]]), pos * one, one, 0 * one, state)
    return out


def cast_model(model: Transformer, cfg: ModelConfig, dtype: torch.dtype) -> Transformer:
    """The same weights in a model of `dtype` and config `cfg` (e.g. fp32 at max_seq_len 1024)."""
    out = Transformer(cfg, dtype=dtype)
    out.load_state_dict(model.state_dict())
    return out.eval()


# ---------------------------------------------------------------------------------------------
# the bf16 master


def _master_tensor(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() and name.rsplit(".", 1)[-1] not in _F32_LEAVES:
        return t.detach().to("cpu", torch.bfloat16).contiguous()
    return t.detach().cpu().contiguous()


def master_state(model: Transformer) -> dict[str, torch.Tensor]:
    """The tensors of the bf16 master, exactly as saved (the model's own state_dict names)."""
    return {k: _master_tensor(k, v) for k, v in model.state_dict().items()}


def master_model(model: Transformer, cfg: ModelConfig) -> Transformer:
    """The bf16 eager model the shipped master gives (same bytes as save_master + load_master)."""
    out = Transformer(cfg, dtype=torch.bfloat16)
    out.load_state_dict(master_state(model))
    return out.eval()


def save_master(model: Transformer, cfg: ModelConfig, directory: str | Path, tokenizer: Any = None,
                record: dict[str, Any] | None = None) -> Path:
    """Write the bf16 master (the model's own state_dict names; mHC, sinks, ape and gate biases
    fp32 as in the official checkpoint), config.json, the tokenizer files and train_log.json."""
    from .tokenizer import save_tokenizer

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = master_state(model)
    save_file(tensors, str(out / MASTER_FILE), metadata={"format": "pt", "layout": "dsv4.model state_dict"})
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    if tokenizer is not None:
        save_tokenizer(tokenizer, out, model_max_length=cfg.max_seq_len)
    if record is not None:
        (out / "train_log.json").write_text(json.dumps(record, indent=1) + "\n")
    return out


def load_master(directory: str | Path, dtype: torch.dtype = torch.bfloat16, **overrides: Any) -> Transformer:
    """Build the model from a master folder (config.json + master-bf16.safetensors), in `dtype`."""
    d = Path(directory)
    cfg = ModelConfig.from_json(d / "config.json", **overrides)
    model = Transformer(cfg, dtype=dtype)
    model.load_state_dict(load_file(str(d / MASTER_FILE)))
    return model.eval()


# ---------------------------------------------------------------------------------------------
# the whole run


@dataclass
class TrainResult:
    model: Transformer  # fp32, training config
    cfg: ModelConfig  # the preset's config (runtime max_seq_len)
    tokenizer: Any
    history: list[dict[str, float]]
    record: dict[str, Any]
    eval_ids: torch.Tensor  # the held-out token stream


@dataclass(frozen=True)
class _CorpusInfo:
    """What the log records of a corpus whose token streams were prepared elsewhere (`--data`)."""

    sha256: str
    matches_reference: bool
    reference_sha256: str | None


DATA_STREAMS = "streams.safetensors"
DATA_INFO = "corpus.json"


def _prepare(tcfg: TrainConfig, data: str | Path | None = None):
    """Corpus info, preset config, tokenizer and the train/eval token streams: built from the local
    stdlib (the corpus is checked against its reference hash), or loaded from a folder written by
    `save_data` (for a machine whose Python differs, e.g. the GPU host)."""
    from .tokenizer import load_tokenizer

    cfg = ModelConfig.preset(tcfg.preset, quant_sim=tcfg.quant_sim)
    if data is not None:
        d = Path(data)
        info = json.loads((d / DATA_INFO).read_text())
        corpus: Any = _CorpusInfo(info["sha256"], info["matches_reference"], info["reference_sha256"])
        tok = load_tokenizer(d)
        streams = load_file(str(d / DATA_STREAMS))
        train_ids, eval_ids = streams["train"].long(), streams["eval"].long()
    else:
        from .corpus import build_corpus
        from .tokenizer import train_tokenizer

        corpus = build_corpus()
        tok = train_tokenizer(corpus.train_docs, vocab_size=cfg.vocab_size)
        train_ids, eval_ids = token_stream(tok, corpus.train_docs), token_stream(tok, corpus.eval_docs)
    if tok.get_vocab_size() != cfg.vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, the preset {cfg.vocab_size}")
    return corpus, cfg, tok, train_ids, eval_ids


def save_data(tcfg: TrainConfig, directory: str | Path) -> Path:
    """Build the corpus, tokenizer and token streams here and write them for `--data`: tokenizer
    files, streams.safetensors (int32 train/eval streams) and corpus.json (hash, reference check)."""
    from .tokenizer import save_tokenizer

    corpus, cfg, tok, train_ids, eval_ids = _prepare(tcfg)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tok, out, model_max_length=cfg.max_seq_len)
    save_file({"train": train_ids.int().contiguous(), "eval": eval_ids.int().contiguous()}, str(out / DATA_STREAMS))
    (out / DATA_INFO).write_text(json.dumps({
        "sha256": corpus.sha256, "matches_reference": corpus.matches_reference,
        "reference_sha256": corpus.reference_sha256, "python": platform.python_version(),
        "train_tokens": len(train_ids), "eval_tokens": len(eval_ids)}, indent=1) + "\n")
    return out


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
    corpus, cfg, tok, train_ids, eval_ids = _prepare(tcfg, data)
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

    from .tokenizer import decode, encode

    t1 = time.perf_counter()
    ev32 = evaluate(cast_model(model, cfg, torch.float32), eval_ids, tcfg.seq_len, tcfg.eval_batch, eval_windows)
    bf16 = master_model(model, cfg)  # exactly the shipped bf16 master
    ev16 = evaluate(bf16, eval_ids, tcfg.seq_len, tcfg.eval_batch, eval_windows)
    prompt = encode(tok, DEFAULT_PROMPT, bos=True)
    sample = decode(tok, greedy(bf16, prompt, sample_tokens)) if sample_tokens else ""
    if log:
        log(f"held-out ppl: fp32 {ev32['ppl']:.2f}, bf16 eager {ev16['ppl']:.2f} over {ev16['tokens']:,} tokens "
            f"(eval {time.perf_counter() - t1:.0f} s)")
        log(f"greedy bf16: {DEFAULT_PROMPT!r} -> {sample!r}")
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
        from .checkpoint import load_checkpoint, write_checkpoint
        from .tokenizer import decode, encode

        # first: with overwrite it removes every *.safetensors in the folder (an older master too)
        write_checkpoint(res.model, res.cfg, out, tokenizer=res.tokenizer, overwrite=True, progress=False)
        q = load_checkpoint(out, dtype=torch.bfloat16, progress=False)
        evq = evaluate(q, res.eval_ids, seq_len, eval_batch, eval_windows)
        sample = decode(res.tokenizer, greedy(q, encode(res.tokenizer, DEFAULT_PROMPT, bos=True), 40))
        res.record["eval_fp8_checkpoint"] = evq
        res.record["greedy_fp8_checkpoint"] = sample
        if log:
            log(f"official FP8/MXFP4 checkpoint: held-out ppl (bf16 eager) {evq['ppl']:.2f}")
            log(f"greedy: {DEFAULT_PROMPT!r} -> {sample!r}")
    written = save_master(res.model, res.cfg, out, res.tokenizer, res.record)
    if log:
        log(f"wrote {written}")


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
    corpus, cfg, tok, _, eval_ids = _prepare(tcfg, data)
    if corpus.sha256 != record["corpus_sha256"]:
        raise RuntimeError(f"corpus {corpus.sha256} differs from the run's {record['corpus_sha256']}")
    model = load_master(d, torch.float32)
    if model.cfg != cfg:
        raise RuntimeError("the master's config is not the preset's")
    from .tokenizer import decode, encode

    bf16 = master_model(model, cfg)
    t1 = time.perf_counter()
    ev16 = evaluate(bf16, eval_ids, tcfg.seq_len, tcfg.eval_batch, eval_windows)
    sample = decode(tok, greedy(bf16, encode(tok, DEFAULT_PROMPT, bos=True), sample_tokens)) if sample_tokens else ""
    if log:
        log(f"held-out ppl here: bf16 eager {ev16['ppl']:.2f} over {ev16['tokens']:,} tokens "
            f"(eval {time.perf_counter() - t1:.0f} s)")
        log(f"greedy bf16: {DEFAULT_PROMPT!r} -> {sample!r}")
    for k in ("eval_fp32", "eval_bf16", "greedy_bf16"):
        if k in record:
            record["run_" + k] = record.pop(k)
    if "kept_tokens" not in record and record.get("kept_step"):
        record["kept_tokens"] = record["kept_step"] * tcfg.batch_size * tcfg.seq_len
    record.update(eval_bf16=ev16, greedy_bf16=sample, finished_here={
        "from_master": str(d), "python": platform.python_version(), "torch": torch.__version__,
        "machine": _cpu_name(), "threads": threads})
    return TrainResult(model, cfg, tok, [], record, eval_ids)


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: train, then write the official FP8/MXFP4 checkpoint and the bf16 master into --out."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(TrainConfig):
        if f.name == "betas":
            continue
        kind = type(f.default)
        if kind is bool:
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=lambda s: s.lower() in ("1", "true", "yes"),
                            default=f.default)
        else:
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default)
    ap.add_argument("--out", default=str(ASSETS / "small"),
                    help="model folder: official checkpoint + bf16 master + tokenizer ('' = write nothing)")
    ap.add_argument("--no-fp8", action="store_true", help="skip the official FP8/MXFP4 checkpoint")
    ap.add_argument("--eval-windows", type=int, default=None, help="evaluate on the first N windows only")
    ap.add_argument("--save-data", metavar="DIR", help="only write corpus token streams + tokenizer to DIR")
    ap.add_argument("--data", metavar="DIR", help="train on the streams + tokenizer of --save-data DIR")
    ap.add_argument("--snapshot", metavar="DIR",
                    help="with --eval-every: write the bf16 master (+ log so far) of each new best evaluation")
    ap.add_argument("--from-master", metavar="DIR",
                    help="no training: finish a master folder trained elsewhere (its train_log.json gives "
                         "the settings) into --out: evaluate here, official checkpoint, master, log")
    args = ap.parse_args(argv)
    tcfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if f.name != "betas"})
    if args.save_data:
        print(f"wrote {save_data(tcfg, args.save_data)}")
        return
    if args.from_master:
        res = from_master(args.from_master, data=args.data, eval_windows=args.eval_windows, threads=args.threads)
    else:
        on_best = None
        if args.snapshot:
            def on_best(model: Transformer, info: dict[str, Any]) -> None:
                cfg = ModelConfig.preset(tcfg.preset, quant_sim=tcfg.quant_sim)
                save_master(model, cfg, args.snapshot, record={"train_config": dataclasses.asdict(tcfg), **info})
        res = train(tcfg, eval_windows=args.eval_windows, data=args.data, on_best=on_best)
    if args.out:
        finish(res, args.out, args.eval_windows, fp8=not args.no_fp8)
    json.dump({k: v for k, v in res.record.items() if k != "curve"}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
