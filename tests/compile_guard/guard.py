"""The net under the slow rule: every way a process compiles an IREE module passes through here.

A compile is any of
* an `iree-compile` process (iree.compiler.compile_str / compile_file, dsv4's compile_mlir, a test's
  own subprocess call), seen by an audit hook on process creation, so no call path can dodge it;
* an in-process compile (iree.compiler.api Invocation.execute: turbine's eager kernels,
  ExportOutput.compile), seen by wrapping that method when the module is imported.

`install(report)` makes every compile outside an allowance call `report(what)`. Allowances are
explicit and narrow: `allowed()` (tests/conftest.py's `kernel_compile` fixture) and the export's
target preflight (dsv4.export.compile.check_target compiles a four-line function once per process).

The pytest process installs it from tests/conftest.py; child processes a test starts (`python -m
dsv4.cli export ...`) install it from tests/compile_guard/sitecustomize.py, which conftest
puts on PYTHONPATH, and append what they compiled to the file $DSV4_COMPILE_GUARD_LOG.
Importing this module imports nothing heavy: the iree.compiler and dsv4.export hooks wait for
those modules to be imported (runtime-only tests check that a child never imports them)."""

from __future__ import annotations

import contextlib
import importlib.abc
import os
import re
import sys
from typing import Callable, Iterator

_report: Callable[[str], None] | None = None
_allow = 0
# iree-compile invocations that compile nothing
_QUERY_FLAGS = ("--version", "--help", "--iree-hal-list-target-backends", "--iree-hal-list-target-devices")
_IREE_COMPILE = re.compile(r"(^|[\s/\"'])iree-compile(\s|$|[\"'])")


@contextlib.contextmanager
def allowed() -> Iterator[None]:
    """Compiles inside this block are not reported (an explicit allowance)."""
    global _allow
    _allow += 1
    try:
        yield
    finally:
        _allow -= 1


def compiling(what: str) -> None:
    if _allow == 0 and _report is not None:
        _report(what)


def _argv_compiles(args: object) -> str | None:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args or ())
    argv = [os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else str(a) for a in argv]
    if not argv:
        return None
    hit = os.path.basename(argv[0]) == "iree-compile" or (
        os.path.basename(argv[0]) in ("sh", "bash") and any(_IREE_COMPILE.search(a) for a in argv[1:]))
    if not hit or any(f in argv for f in _QUERY_FLAGS):
        return None
    return "iree-compile " + " ".join("<stdin>" if a == "-" else a for a in argv[1:] if a == "-" or not a.startswith("-"))[:200]


def _audit(event: str, args: tuple) -> None:
    if event == "subprocess.Popen":
        what = _argv_compiles(args[1] if args[1] is not None else args[0])
    elif event in ("os.posix_spawn", "os.exec", "os.spawn"):
        what = _argv_compiles(args[1])
    elif event == "os.system":
        what = _argv_compiles(["sh", "-c", args[0]])
    else:
        return
    if what:
        compiling(what)


def _patch_invocation(mod) -> None:
    cls = mod.Invocation
    if getattr(cls.execute, "_dsv4_guarded", False):
        return
    orig = cls.execute

    def execute(self, *a, **k):
        compiling("an in-process IREE compile (iree.compiler.api Invocation.execute: an eager turbine "
                  "kernel or ExportOutput.compile)")
        return orig(self, *a, **k)

    execute._dsv4_guarded = True
    cls.execute = execute


def _patch_check_target(mod) -> None:
    if getattr(mod.check_target, "_dsv4_guarded", False):
        return
    orig = mod.check_target

    def check_target(*a, **k):
        with allowed():  # the target preflight: a four-line function, ~1 s, once per process
            return orig(*a, **k)

    check_target._dsv4_guarded = True
    check_target.__wrapped__ = orig
    mod.check_target = check_target


_PATCHES = {"iree.compiler.api.ctypes_dl": _patch_invocation, "dsv4.export.compile": _patch_check_target}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Applies _PATCHES to a module right after it executes (first import)."""

    def find_spec(self, name, path, target=None):
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        orig_exec = loader.exec_module

        def exec_module(module):
            orig_exec(module)
            patch(module)

        loader.exec_module = exec_module
        return spec


def install(report: Callable[[str], None]) -> None:
    """Call `report(what)` on every compile outside an allowance, in this process (idempotent)."""
    global _report
    first = _report is None
    _report = report
    if not first:
        return
    sys.addaudithook(_audit)
    for name, patch in _PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _PatchOnImport())
