"""The optimization loop: AdamW with the warmup + cosine schedule, QAT straight-through, the
routed-tokens MoE kernel, the MoE balance, periodic held-out evaluation."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from dsv4.model.quant import sim as quant_sim
from dsv4.model.kernels import overrides
from dsv4.model.model import Transformer

from .config import TrainConfig
from .data import BatchSampler
from .losses import ExpertLoad, compute_losses, routed_moe_experts

__all__ = ["make_optimizer", "lr_at", "train_steps"]


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
