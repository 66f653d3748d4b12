"""`dsv4 export`: build a compiled artifact directory (config.json, model.irpa, model.<target>.vmfb).

Wired into the `dsv4` command by `add_parser(subparsers)` (runtime/cli.py). This module imports no
torch at import time: torch, turbine and the compiler load only when the command runs, so `dsv4 --help`
stays fast and a runtime-only install can name the missing extra.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

__all__ = ["add_parser", "cmd_export"]

DESCRIPTION = """\
Export the model and compile it with IREE into OUT: config.json (the contract the runtime reads),
model.irpa (weights) and one model.<target>.vmfb per --target. Without --checkpoint/--preset the
embedded small model (model/assets/small) is exported. The export is built beside OUT and moved into
place only when it is complete: a failure leaves OUT as it was. Then: dsv4 generate OUT --prompt ...

examples:
  dsv4 export --target llvm-cpu -o out/cpu                        # run here with `dsv4 generate`
  dsv4 export --target gfx942 --target cuda -o out/gpu             # MI300X and NVIDIA (sm_89 PTX)
  dsv4 export --preset tiny --dtype fp32 --target llvm-cpu -o out/tiny
"""

# Warnings third-party code prints while tracing (torch.export's pytree deprecations, issued from
# copyreg and torch internals; turbine's "strict_export == False" notice), 6-12 lines per export;
# they say nothing about the user's export.
_QUIET = [(FutureWarning, ""), (DeprecationWarning, ""),
          (UserWarning, r"(torch\.(export|_export|fx|_dynamo)|iree\.turbine)(\.|$)")]


def _batch_sizes(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes like 1,4, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("no batch size given")
    return out


class _KernelHelp(str):
    """--kernel's help, derived from the kernel registry when argparse formats it (help % params),
    so torch loads for `dsv4 export -h` only, never for `dsv4 --help`."""

    def __mod__(self, params: object) -> str:
        from dsv4.export.lowering import kernel_help

        return kernel_help().replace("%", "%%") % params


def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="export + compile the model to IREE (vmfb per target, .irpa, config.json)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", metavar="DIR",
                     help="checkpoint directory (config.json + safetensors); default: the embedded small model")
    src.add_argument("--preset", help="a ModelConfig preset with random weights (e.g. tiny)")
    p.add_argument("--target", action="append", dest="targets", metavar="T",
                   help="gfx942 (default; MI300), llvm-cpu (this CPU), cuda (sm_89 PTX, runs on Ampere..Hopper); "
                        "NAME:ARCH picks the arch, e.g. cuda:sm_80, llvm-cpu:generic; repeatable")
    p.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 4], metavar="N,..",
                   help="prefill (and decode) batch sizes, one entry point each (default: 1,4)")
    p.add_argument("--decode-batch-sizes", type=_batch_sizes, default=None, metavar="N,..",
                   help="decode batch sizes (default: the --batch-sizes)")
    p.add_argument("--max-seq-len", type=int, default=None, metavar="N",
                   help="positions per slot in the state (default: the model config's)")
    p.add_argument("--max-chunk", type=int, default=None, metavar="T",
                   help="largest prefill chunk (default: min(max_seq_len, 512))")
    p.add_argument("--n-slots", type=int, default=None, metavar="N",
                   help="state slots = requests running at once (default: the largest batch size)")
    p.add_argument("--quant-sim", choices=("on", "off"), default=None,
                   help="the reference's FP8/FP4 QAT simulations (default: the config's)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="activation/state dtype (default: bf16)")
    p.add_argument("--expert-dtype", choices=("fp8",), default=None,
                   help="fp8: the MXFP4 routed experts re-encoded as FP8 with 128x128 block scales, exactly (a "
                        "checkpoint value that would round is refused), so their prefill GEMMs run FP8 x FP8 on "
                        "the matrix cores (gfx942 has no FP4 ones); costs 1.88x the expert bytes a decode step reads")
    p.add_argument("--seed", type=int, default=0, help="random-weight seed for --preset (default: 0)")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="keep the first N layers (and the MTP blocks): real dimensions at a fraction of the size")
    p.add_argument("--no-weights", action="store_true",
                   help="compile from shapes alone: config.json + vmfb, no .irpa (weights never loaded; "
                        "make them later, e.g. on the GPU host, with `dsv4 weights random OUT`)")
    p.add_argument("--devices", type=int, default=1, metavar="N",
                   help="one module over N devices of the target (default 1): query heads, routed experts, "
                        "embedding and head split across them (docs/scale.md); N must divide the heads, "
                        "o_groups, experts and vocabulary")
    p.add_argument("--pipeline", action="store_true",
                   help="with --devices N: split the layers into N consecutive stages, one module per device, "
                        "the streams crossing through host memory (needs no peer access between GPUs: the way "
                        "to run on several H200s with IREE 3.13's cuda driver; docs/scale.md)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="pad the GEMMs' rows to a 16-row tile so a GPU's decode functions give a request the same "
                        "bits at every batch size (docs/batch-invariance.md: costs decode speed at small batches; "
                        "llvm-cpu is batch-invariant without it, so an llvm-cpu-only export ignores it and "
                        "one that mixes llvm-cpu with a GPU target is refused)")
    p.add_argument("--kernel", action="append", default=[], metavar="OP=IMPL", help=_KernelHelp("OP=IMPL"))
    p.add_argument("--no-score", action="store_true",
                   help="skip the score_bs1 entry point (`dsv4 score` then cannot use the export)")
    p.add_argument("--keep-mlir", action="store_true", help="keep model.mlir in the output directory")
    p.add_argument("--force", action="store_true",
                   help="replace OUT even when it is a non-empty directory that is not a dsv4 export")
    p.add_argument("-o", "--out", required=True, metavar="OUT", help="output directory")
    p.set_defaults(fn=cmd_export)
    return p


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


def cmd_export(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)

    from dsv4.contract.artifact import check_out_dir

    from dsv4.export.exporter import ExportError, export_model
    from dsv4.export.spec import ExportSpec

    for cat, mod in _QUIET:
        warnings.filterwarnings("ignore", category=cat, module=mod)
    stage = "validate"
    try:
        check_out_dir(args.out, force=args.force)  # before minutes of work
        spec = ExportSpec.from_args(args)  # every option checked, the targets preflighted
        import torch

        from dsv4.model.config import ModelConfig
        from dsv4.model.model import empty_model

        stage = "load"
        dtype = getattr(torch, spec.dtype)
        overrides = {k: getattr(spec, k) for k in ("max_seq_len", "quant_sim") if getattr(spec, k) is not None}
        tokenizer = None
        if not args.preset:
            from dsv4.model.checkpoint import EMBEDDED_CHECKPOINT, checkpoint_tensors, load_checkpoint

            ckpt = Path(args.checkpoint) if args.checkpoint else EMBEDDED_CHECKPOINT
            tok = ckpt / "tokenizer.json"
            tokenizer = tok if tok.is_file() else None
            log(f"checkpoint {ckpt}" + ("" if args.checkpoint else " (the embedded default)") +
                (": config only (--no-weights)" if args.no_weights else ": tensors streamed into the .irpa shards"))
            model = load_checkpoint(ckpt, dtype=dtype, overrides=overrides, weights=False, layers=args.layers,
                                    expert_dtype=args.expert_dtype)
            weights = None if args.no_weights else (lambda specs, fp8: checkpoint_tensors(ckpt, model, fp8))
        else:
            from dsv4.contract.random_weights import random_tensors

            cfg = ModelConfig.preset(args.preset, **overrides)
            cfg = cfg if args.layers is None else cfg.first_layers(args.layers)
            if args.expert_dtype:
                if cfg.expert_dtype not in ("fp4", "fp8"):
                    raise ValueError(f"--expert-dtype {args.expert_dtype}: preset {args.preset} has float experts")
                cfg = cfg.replace(expert_dtype=args.expert_dtype)  # random weights are drawn in that format
            model = empty_model(cfg, dtype)
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
                           force=args.force)
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
