"""What `dsv4 export` does once its arguments are parsed and checked (dsv4.cli.export): load the
model (a checkpoint's, or a preset with random weights), export and compile it, print the summary.
This module imports no torch at import time: torch, turbine and the compiler load when `cmd_export` runs.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsv4.export.spec import ExportSpec

__all__ = ["cmd_export", "parameter_counts"]

# Warnings third-party code prints while tracing (torch.export's pytree deprecations, issued from
# copyreg and torch internals; turbine's "strict_export == False" notice), 6-12 lines per export;
# they say nothing about the user's export.
_QUIET = [(FutureWarning, ""), (DeprecationWarning, ""),
          (UserWarning, r"(torch\.(export|_export|fx|_dynamo)|iree\.turbine)(\.|$)")]


def parameter_counts(model) -> tuple[int, int, int]:
    """(weights as trained, of which a packed MXFP4 byte holds 2; FP8/FP4 block scales; tensor
    elements stored). Integer tables (hash routing) are in neither of the first two."""
    import torch

    weights = scales = stored = 0
    for name, p in model.named_parameters():
        stored += p.numel()
        if p.dtype == torch.uint8 and name.endswith("scale"):
            scales += p.numel()  # e8m0 block scales
        elif p.dtype == torch.uint8:
            weights += 2 * p.numel()  # MXFP4: two 4-bit weights per byte
        elif p.is_floating_point():
            weights += p.numel()
    return weights, scales, stored


def _count(model) -> str:
    weights, scales, stored = parameter_counts(model)
    if weights == stored:
        return f"{weights / 1e6:.2f} M weights"
    return (f"{weights / 1e6:.2f} M weights ({stored / 1e6:.2f} M stored tensor elements: MXFP4 packs 2 per "
            f"byte, {scales / 1e6:.2f} M block scales)")


def cmd_export(args: argparse.Namespace, spec: "ExportSpec") -> int:
    """Run the export `spec` describes (dsv4.cli.export built and checked it from `args`, which also
    say where the model comes from: a checkpoint, a preset, the weights' seed)."""
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)

    from dsv4.export.exporter import ExportError, export_model

    for cat, mod in _QUIET:
        warnings.filterwarnings("ignore", category=cat, module=mod)
    stage = "load"
    try:
        import torch

        from dsv4.model.config import ModelConfig
        from dsv4.model.model import empty_model

        dtype = getattr(torch, spec.dtype)
        overrides = {k: getattr(spec, k) for k in ("max_seq_len", "quant_sim") if getattr(spec, k) is not None}
        tokenizer = None
        if not args.preset:
            from dsv4.model.checkpoint import EMBEDDED_CHECKPOINT, checkpoint_tensors, load_checkpoint

            ckpt = Path(args.checkpoint) if args.checkpoint else EMBEDDED_CHECKPOINT
            tok = ckpt / "tokenizer.json"
            tokenizer = tok if tok.is_file() else None
            model = load_checkpoint(ckpt, dtype=dtype, overrides=overrides, weights=False, layers=args.layers,
                                    expert_dtype=args.expert_dtype)
            log(f"checkpoint {ckpt}" + ("" if args.checkpoint else " (the embedded default)") +
                (": config only (--no-weights)" if args.no_weights else
                 ": its tensors will be streamed into the .irpa shards"))
            weights = None if args.no_weights else (lambda specs, fp8: checkpoint_tensors(ckpt, model, fp8))
            source = {"checkpoint": str(ckpt.resolve())}
        else:
            from dsv4.contract.random_weights import random_tensors

            cfg = ModelConfig.preset(args.preset, **overrides)
            cfg = cfg if args.layers is None else cfg.first_layers(args.layers)
            if args.expert_dtype:
                if cfg.expert_dtype not in ("fp4", "fp8"):
                    raise ValueError(f"--expert-dtype {args.expert_dtype}: preset {args.preset} has float experts")
                cfg = cfg.replace(expert_dtype=args.expert_dtype)  # random weights are drawn in that format
            model = empty_model(cfg, dtype)
            source = {"preset": args.preset, "seed": args.seed}
            if args.no_weights:
                log(f"preset {args.preset}: no weights (--no-weights)")
                weights = None
            else:
                log(f"preset {args.preset}: random weights in the release format (seed {args.seed}, "
                    "as `dsv4 weights random` writes them)")
                weights = lambda specs, fp8: random_tensors(specs, cfg.to_dict(), args.seed)  # noqa: E731
        cfg = model.cfg
        log(f"model: {cfg.n_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, {_count(model)}, "
            f"{args.dtype}")
        stage = "export"
        res = export_model(model, spec, args.out, weights=weights, tokenizer=tokenizer, progress=log,
                           force=args.force, source=None if args.no_weights else source,
                           compile_jobs=args.compile_jobs)
    except ExportError as e:  # already names the stage and the op
        print(f"dsv4 export: error: {e}", file=sys.stderr)
        return 1 if e.stage.startswith(("trace", "import", "compile")) else 2
    except (ValueError, OSError) as e:  # ConfigError/CheckpointError are ValueErrors
        print(f"dsv4 export: error in stage '{stage}': {e}", file=sys.stderr)
        return 2
    print("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in res.timings.items()))
    for name, info in res.config["targets"].items():
        vmfbs = info.get("stages", [info["vmfb"]])
        size = sum((res.out_dir / v).stat().st_size for v in vmfbs)
        print(f"  {name}: {', '.join(vmfbs)} ({size / 1e6:.2f} MB, compiled in {info['compile_s']:.1f} s)")
    files = [res.out_dir / f for f in res.config["parameters"]]
    if all(f.is_file() for f in files):
        size = sum(f.stat().st_size for f in files)
        print(f"  parameters: {files[0].name}{' ...' if len(files) > 1 else ''} ({len(files)} file(s), "
              f"{size / 1e6:.1f} MB); config: {res.config_path}")
    else:
        print(f"  parameters: none (--no-weights; `dsv4 weights random {res.out_dir}` writes {len(files)} "
              f"file(s)); config: {res.config_path}")
    if not res.config["functions"].get("score_bs1"):
        print("  (no score_bs1: `dsv4 score` needs an export without --no-score)")
    return 0
