"""`dsv4 export`: parse and check the arguments (torch-free, about a second: the out directory, the
checkpoint, each target's preflight compile, the counts), then run dsv4.export.command.cmd_export.
The `export` extra (torch, turbine, the compiler) is needed only for the export itself: on a
runtime-only install `--help` still works and the command names the missing extra."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import add_command, fail

__all__ = ["add_parser", "validate", "run"]

PRESETS = ("tiny", "small", "flash", "pro")  # dsv4.model.config.PRESETS (a test keeps them equal)

DESCRIPTION = """\
Export the model and compile it with IREE into OUT: config.json (the contract the runtime reads,
with each weight file's sha256), the weights as .irpa shards (model-00001-of-0000N.irpa ...) and one
model.<target>.vmfb per --target. Without --checkpoint/--preset the embedded small model
(model/assets/small) is exported. The export is built beside OUT and moved into place only when it is
complete: a failure, Ctrl-C or SIGTERM leaves OUT as it was. Then: dsv4 generate OUT --prompt ...
(`dsv4 check OUT` verifies the files after a copy).

examples:
  dsv4 export --target llvm-cpu -o out/cpu                        # run here with `dsv4 generate`
  dsv4 export --target gfx942 --target cuda -o out/gpu             # MI300X and NVIDIA (sm_89 PTX)
  dsv4 export --preset tiny --dtype fp32 --target llvm-cpu -o out/tiny
"""


def _batch_sizes(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes like 1,4, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("no batch size given")
    return out


def _kernel(text: str) -> str:
    op, sep, impl = text.partition("=")
    if not sep or not op.strip() or not impl.strip():
        raise argparse.ArgumentTypeError(f"expected OP=IMPL, got {text!r}")
    return f"{op.strip()}={impl.strip()}"


class _KernelHelp(str):
    """--kernel's help from the export's lowering table (dsv4.export.lowering.kernel_help), made
    when argparse formats it (help % params): torch loads for `dsv4 export --help` only, and a
    runtime-only install gets the short form."""

    def __mod__(self, params: object) -> str:
        try:
            from dsv4.export.lowering import kernel_help

            return kernel_help().replace("%", "%%") % params
        except ImportError:
            return ("the implementation of one op (repeatable); the list of ops and their implementations "
                    "needs the 'export' extra")


def add_parser(subparsers: Any, name: str = "export") -> argparse.ArgumentParser:
    p = add_command(subparsers, name, description=DESCRIPTION)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", metavar="DIR",
                     help="checkpoint directory (config.json + safetensors; default: the embedded small model)")
    src.add_argument("--preset", choices=PRESETS, help="a model preset with random weights")
    p.add_argument("--target", action="append", dest="targets", metavar="T",
                   help="gfx942 (the default; MI300), llvm-cpu (this CPU), cuda (sm_89 PTX, runs on Ampere..Hopper); "
                        "NAME:ARCH picks the arch, e.g. cuda:sm_80, llvm-cpu:generic; repeatable")
    p.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 4], metavar="N,..",
                   help="prefill (and decode) batch sizes, one entry point each (default: 1,4)")
    p.add_argument("--decode-batch-sizes", type=_batch_sizes, default=None, metavar="N,..",
                   help="decode batch sizes (default: the --batch-sizes)")
    p.add_argument("--max-seq-len", type=int, default=None, metavar="N",
                   help="positions per slot in the state (default: the model config's)")
    p.add_argument("--max-chunk", type=int, default=None, metavar="T",
                   help="largest prefill chunk (default: min(max_seq_len, 512))")
    p.add_argument("--static-prefill", action="store_true",
                   help="prefill entry points of exactly --max-chunk tokens a row, every chunk padded to it: IREE "
                        "tiles each prefill kernel for its size (Flash-4 on an H100: 8-row prefill +25 %%, time to "
                        "the first token of a 128-token prompt -17 %% at --max-chunk 128), but a shorter prompt "
                        "computes the whole chunk")
    p.add_argument("--n-slots", type=int, default=None, metavar="N",
                   help="state slots = requests running at once (default: the largest batch size)")
    p.add_argument("--quant-sim", choices=("on", "off"), default=None,
                   help="the reference's FP8/FP4 QAT simulations (default: the config's)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="activation/state dtype")
    p.add_argument("--expert-dtype", choices=("fp8",), default=None,
                   help="fp8: the MXFP4 routed experts re-encoded as FP8 with 128x128 block scales, exactly (a "
                        "checkpoint value that would round is refused), so their prefill GEMMs run FP8 x FP8 on "
                        "the matrix cores (gfx942 has no FP4 ones); costs 1.88x the expert bytes a decode step reads")
    p.add_argument("--seed", type=int, default=0, help="random-weight seed for --preset")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="keep the first N layers (and the MTP blocks): real dimensions at a fraction of the size "
                        "(default: all)")
    p.add_argument("--no-weights", action="store_true",
                   help="compile from shapes alone: config.json + vmfb, no .irpa shards (weights never loaded; "
                        "make them later, e.g. on the GPU host, with `dsv4 weights random OUT`)")
    p.add_argument("--devices", type=int, default=1, metavar="N",
                   help="one module over N devices of the target: query heads, routed experts, "
                        "embedding and head split across them (docs/scale.md); N must divide the heads, "
                        "o_groups, experts and vocabulary")
    p.add_argument("--pipeline", action="store_true",
                   help="with --devices N: split the layers into N consecutive stages, one module per device, "
                        "the streams crossing through host memory (needs no peer access between GPUs: the way "
                        "to run on several H200s with IREE 3.13's cuda driver; docs/scale.md)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="pad the GEMMs' rows to a 16-row tile so a GPU's decode functions give a request the same "
                        "bits at every batch size (docs/numerics.md: costs decode speed at small batches; "
                        "llvm-cpu is batch-invariant without it, so an llvm-cpu-only export ignores it and "
                        "one that mixes llvm-cpu with a GPU target is refused)")
    p.add_argument("--kernel", action="append", default=[], type=_kernel, metavar="OP=IMPL", help=_KernelHelp("OP=IMPL"))
    p.add_argument("--draft-tokens", type=int, default=0, metavar="K",
                   help="MTP speculative decoding: add mtp_prefill_bs{N} and verify_bs{N}_k{K} (the MTP block drafts "
                        "K tokens, the model verifies 1 + K per row in one call; docs/runtime.md). Default 0: none")
    p.add_argument("--no-score", action="store_true",
                   help="skip the score_bs1 entry point (`dsv4 score` then cannot use the export)")
    p.add_argument("--compile-jobs", type=int, default=None, metavar="N",
                   help="iree-compile processes at once, one per target (and pipeline stage); default: as many "
                        "as there are, up to the CPU count. Each holds a whole module's compile in memory: "
                        "1 where memory is short")
    p.add_argument("--keep-mlir", action="store_true", help="keep model.mlir in the output directory (dsv4 inspect needs it)")
    p.add_argument("--force", action="store_true",
                   help="replace OUT even when it is a non-empty directory that is not a dsv4 export")
    p.add_argument("-o", "--out", required=True, metavar="OUT", help="output directory")
    p.set_defaults(fn=run)
    return p


def validate(args: argparse.Namespace) -> Any:
    """The ExportSpec of the command line (dsv4.export.spec: every option checked, the targets
    preflighted once), after what needs no compiler: the output and checkpoint directories. Raises
    ValueError (ExportError for the spec's checks) before torch loads, so a config error shows within
    about a second. None when the export extra is missing (`run` names it)."""
    from dsv4.contract.artifact import check_out_dir

    check_out_dir(args.out, force=args.force)
    if args.checkpoint is not None:
        ck = Path(args.checkpoint)
        if not ck.is_dir():
            raise ValueError(f"--checkpoint {ck}: no such directory")
        if not (ck / "config.json").is_file():
            raise ValueError(f"--checkpoint {ck}: no config.json there (not a checkpoint directory)")
    from dsv4.export.spec import ExportSpec  # torch- and compiler-free until a spec is made

    try:
        return ExportSpec.from_args(args)  # plain values are checked before the compiler or torch loads
    except ModuleNotFoundError:  # the targets' preflight or the kernel table: the export extra is missing
        return None


def run(args: argparse.Namespace) -> int:
    try:
        spec = validate(args)
    except (ValueError, RuntimeError) as e:  # ExportError("validate", ...) is a RuntimeError
        return fail("export", e)
    from dsv4.export.command import cmd_export

    import torch  # noqa: F401  (a runtime-only install: the missing extra is named, see dsv4.cli)

    return cmd_export(args, spec)
