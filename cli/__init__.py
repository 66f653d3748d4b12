"""The `dsv4` command. One table (`COMMANDS`) names every subcommand, its one-line help and the module
that defines it; a module is imported only when its subcommand runs or its --help is asked for, so
`dsv4 --help` is instant and a runtime-only install (no torch) shows every subcommand's help.

Each subcommand module has ``add_parser(subparsers) -> ArgumentParser`` (which sets ``fn``), or, for a
command that parses its own arguments, ``main(argv) -> int`` (``OWN_PARSER``). Errors print one line
and exit 2; a command that needs a missing extra names it; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["COMMANDS", "main", "HelpFormatter", "add_command", "fail"]

# name -> (module, one-line help); the order is `dsv4 --help`'s
COMMANDS: dict[str, tuple[str, str]] = {
    "export": ("dsv4.cli.export", "export + compile the model to IREE: sharded .irpa weights, a vmfb per target, "
                                  "config.json (export extra)"),
    "generate": ("dsv4.cli.generate", "continue a prompt with a compiled export (torch-free)"),
    "score": ("dsv4.cli.generate", "log-probabilities and perplexity with a compiled export (torch-free)"),
    "serve": ("dsv4.cli.serve", "OpenAI-compatible HTTP server for an export (serve extra)"),
    "bench": ("dsv4.cli.bench_serve", "speed of an export (dsv4 bench OUT -h) or of a running server "
                                "(dsv4 bench serve -h)"),
    "audit": ("dsv4.cli.audit", "where a compiled export leaves its eager reference, layer by layer: weights "
                                "and activations (export extra)"),
    "check": ("dsv4.cli.check", "verify an export's files: weight shards' sha256, vmfbs' structure (torch-free)"),
    "inspect": ("dsv4.cli.inspect", "per entry point of an export: each dispatch's kind, shape, FLOPs, bytes and "
                                    "whether it uses the matrix cores (gfx942 MFMA, cuda mma; no GPU, no torch)"),
    "weights": ("dsv4.cli.weights", "write an export's weights: weights random OUT (torch-free)"),
    "checkpoint": ("dsv4.cli.checkpoint", "write a random-weight checkpoint in the released layout "
                                          "(checkpoint make -h; export extra)"),
    "eager": ("dsv4.cli.eager", "greedy continuation with the eager PyTorch model (export extra)"),
}

# commands whose module parses its own arguments: `dsv4 bench OUT ...` (its speed benchmark) has
# options of its own, but `dsv4 bench serve ...` is an ordinary subcommand (dsv4.cli.bench_serve)
OWN_PARSER = {"bench": "dsv4.bench.speed"}

# the modules each extra installs: a missing one means that extra is not installed
_EXPORT_EXTRA = ("torch", "iree.turbine", "iree.compiler", "safetensors", "ml_dtypes")
_SERVE_EXTRA = ("starlette", "uvicorn", "prometheus_client", "httpx", "pydantic")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; each option's help ends with its default unless the help already
    names it or there is none to show (None, False, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if ("default" in text or d is None or d is False or d == [] or d is argparse.SUPPRESS
                or not action.option_strings):
            return text
        shown = ",".join(map(str, d)) if isinstance(d, (list, tuple)) else str(d)
        return f"{text} (default: {shown.replace('%', '%%')})"  # argparse %-formats the help afterwards


def add_command(subparsers, name: str, **kw) -> argparse.ArgumentParser:
    """`subparsers.add_parser(name)` with COMMANDS' help line and the command's formatter."""
    kw.setdefault("help", COMMANDS[name][1])
    kw.setdefault("description", kw["help"][:1].upper() + kw["help"][1:] + ".")
    return subparsers.add_parser(name, formatter_class=HelpFormatter, **kw)


def fail(cmd: str, msg: object) -> int:
    """One error line for `dsv4 CMD`; the exit status of a refused command (2)."""
    print(f"dsv4 {cmd}: error: {msg}", file=sys.stderr)
    return 2


def missing_extra(err: ModuleNotFoundError) -> str | None:
    """The extra that would provide the module `err` names (None: not one of ours)."""
    name = err.name or ""
    for extra, mods in (("export", _EXPORT_EXTRA), ("serve", _SERVE_EXTRA)):
        if any(name == m or name.startswith(m + ".") for m in mods):
            return extra
    return None


def _dispatch(cmd: str, argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dsv4", formatter_class=HelpFormatter,
                                description="DeepSeek-V4 as a compiled IREE pipeline. `dsv4 COMMAND --help` shows "
                                            "a command's options and their defaults.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", title="commands")
    for name, (module, help_) in COMMANDS.items():
        if name == cmd:  # only the command asked for loads its module
            importlib.import_module(module).add_parser(sub, name)
        else:
            sub.add_parser(name, help=help_)
    args = p.parse_args(argv)
    return args.fn(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cmd = argv[0] if argv else "dsv4"
    if cmd in OWN_PARSER and argv[1:2] != ["serve"]:
        return _run(cmd, lambda: importlib.import_module(OWN_PARSER[cmd]).main(argv[1:]))
    return _run(cmd, lambda: _dispatch(cmd, argv))


def _run(cmd: str, fn) -> int:
    try:
        return fn()
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM during an export (contract.artifact.staged_export)
        sys.stdout.flush()
        print(f"\ndsv4 {cmd}: interrupted", file=sys.stderr)
        return 130
    except ValueError as err:  # bad requests get one line, not a traceback
        return fail(cmd, err)
    except ModuleNotFoundError as err:  # a runtime-only install (no torch / turbine / compiler / server)
        extra = missing_extra(err)
        if extra is None:
            raise
        return fail(cmd, f"needs the '{extra}' extra ({err.name} is not installed): pip install 'dsv4-iree[{extra}]'")


if __name__ == "__main__":
    sys.exit(main())
