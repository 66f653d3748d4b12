"""TrainConfig: every knob of a training run (the package docstring says why each default is what it is)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TrainConfig"]


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
