"""`python -m dsv4.train`: train (or finish a master trained elsewhere), then write the model folder."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from dsv4.model.checkpoint import EMBEDDED_CHECKPOINT
from dsv4.model.config import ModelConfig
from dsv4.model.model import Transformer

from .config import TrainConfig
from .data import save_data
from .master import save_master
from .run import finish, from_master, train


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: train, then write the official FP8/MXFP4 checkpoint and the bf16 master into --out."""
    ap = argparse.ArgumentParser(prog="python -m dsv4.train",
                                 description="Train the embedded small DeepSeek-V4 model (docs/training.md).")
    for f in dataclasses.fields(TrainConfig):
        if f.name == "betas":
            continue
        kind = type(f.default)
        if kind is bool:
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=lambda s: s.lower() in ("1", "true", "yes"),
                            default=f.default)
        else:
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default)
    ap.add_argument("--out", default=str(EMBEDDED_CHECKPOINT),
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
