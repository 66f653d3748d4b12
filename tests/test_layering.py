"""The dependency order of the packages (docs: architecture; the table below is the rule).

contract is the bottom and imports no other dsv4 package; model and runtime import the contract only
(so runtime stays torch-free by construction); export and train build on model; bench may use
everything but train and cli; cli is the top. Every import counts: top level, inside functions
(lazy imports), relative ones (resolved to their dsv4.* name) and the lazy-name tables that
``importlib.import_module`` reads (PEP 562 ``__getattr__``), so a dependency cannot hide by being
deferred. A second test imports every module of the torch-free packages in a fresh interpreter and
checks that torch never got loaded.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# package -> the dsv4 packages it may import (besides itself)
ALLOWED: dict[str, frozenset[str]] = {
    "contract": frozenset(),
    "model": frozenset({"contract"}),
    "runtime": frozenset({"contract"}),
    "export": frozenset({"model", "contract"}),
    "train": frozenset({"model", "contract"}),
    "bench": frozenset({"runtime", "model", "export", "contract"}),
    "cli": frozenset({"contract", "model", "runtime", "export", "train", "bench"}),
}
TORCH_FREE = ("contract", "runtime")

# a module path as a lazy-name table spells it: ".engine", "..quant.quantize", "dsv4.contract.errors"
_MODULE_STRING = re.compile(r"^(\.+|dsv4\.)[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def packages() -> list[str]:
    """The layered packages present in this tree (bench/ and cli/ count once they are packages)."""
    return [p for p in ALLOWED if (REPO / p / "__init__.py").is_file()]


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["dsv4", *parts])


@dataclass(frozen=True)
class Import:
    file: Path
    line: int
    target: str  # absolute module name, e.g. "dsv4.model.model"

    def where(self) -> str:
        return f"{self.file.relative_to(REPO)}:{self.line}"


def _resolve(name: str, level: int, path: Path) -> str:
    """A relative import's absolute name, as Python resolves it against the importing module."""
    if level == 0:
        return name
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()  # a plain module's package is its parent
    if level - 1 > len(package) - 1:
        raise ValueError(f"{path}: relative import beyond the top package")
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[Import] = []
    dynamic = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(path, node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, path)
            if node.module is None or base == "dsv4":
                # `from . import compat`, `from dsv4 import model`: a name is a submodule or a name of the package
                found += [Import(path, node.lineno, f"{base}.{a.name}" if _exists(f"{base}.{a.name}") else base)
                          for a in node.names]
            else:
                found.append(Import(path, node.lineno, base))
        elif isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
                    isinstance(f, ast.Name) and f.id in ("import_module", "__import__")):
                dynamic = True
    if dynamic:
        # the module resolves names through importlib: every module path it spells is an import
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_STRING.match(node.value):
                text = node.value
                level = len(text) - len(text.lstrip("."))
                found.append(Import(path, node.lineno, _resolve(text[level:], level, path)))
    return sorted(found, key=lambda i: (i.line, i.target))


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (REPO / rel).with_suffix(".py").is_file() or (REPO / rel / "__init__.py").is_file()


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "dsv4" else None


def violations() -> list[str]:
    out = []
    for pkg in packages():
        for path in sorted((REPO / pkg).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            for imp in imports_of(path):
                other = package_of(imp.target)
                if other is not None and other != pkg and other not in ALLOWED[pkg]:
                    out.append(f"{imp.where()}: {pkg} imports {imp.target} "
                               f"({pkg} may import {', '.join(sorted(ALLOWED[pkg])) or 'no dsv4 package'})")
    return out


def test_imports_follow_the_dependency_order():
    found = violations()
    assert not found, "imports against the dependency order:\n  " + "\n  ".join(found)


def test_imported_dsv4_modules_exist():
    # a lazy-name table is only a string: after a module moves, a stale entry fails on first use only
    missing = [f"{i.where()}: {i.target}" for pkg in packages() for p in sorted((REPO / pkg).rglob("*.py"))
               if "__pycache__" not in p.parts for i in imports_of(p)
               if package_of(i.target) in ALLOWED and not _exists(i.target)]
    assert not missing, "imports of dsv4 modules that do not exist:\n  " + "\n  ".join(missing)


def test_resolution_of_relative_and_lazy_imports(tmp_path, monkeypatch):
    # the checker itself on a planted package: each way of spelling an upward import is caught
    pkg = tmp_path / "model" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "model" / "__init__.py").write_text("")
    (tmp_path / "model" / "config.py").write_text("")
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .. import config, VERSION\n")
    (pkg / "m.py").write_text(
        "import importlib\n"
        "from ..x import y\n"
        "def f():\n"
        "    from dsv4.runtime.engine import Engine\n"
        "    import dsv4.export.compile\n"
        "    from dsv4 import train\n"
        "_LAZY = {'a': '...runtime.text', 'b': '.local'}\n"
        "def __getattr__(n):\n"
        "    return importlib.import_module(_LAZY[n], __name__)\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert [i.target for i in imports_of(pkg / "__init__.py")] == ["dsv4.model", "dsv4.model.config"]
    got = [(i.line, i.target) for i in imports_of(pkg / "m.py")]
    assert sorted(got) == [(1, "importlib"), (2, "dsv4.model.x"), (4, "dsv4.runtime.engine"),
                           (5, "dsv4.export.compile"), (6, "dsv4.train"), (7, "dsv4.model.sub.local"),
                           (7, "dsv4.runtime.text")]
    bad = violations()
    assert [b.split(": ")[0] for b in bad] == ["model/sub/m.py:4", "model/sub/m.py:5", "model/sub/m.py:6",
                                              "model/sub/m.py:7"]
    assert "model imports dsv4.runtime.engine" in bad[0]


_PROBE = """
import importlib, json, sys, traceback
repo, first = sys.argv[2], []

class Witness:
    # records where the first `import torch` came from (the repository's frames of that moment)
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not first:
            first.extend(f"{f.filename[len(repo) + 1:]}:{f.lineno}" for f in traceback.extract_stack()
                         if f.filename.startswith(repo + "/"))
        return None

sys.meta_path.insert(0, Witness())
culprits = []
for name in json.loads(sys.argv[1]):
    had = "torch" in sys.modules
    importlib.import_module(name)
    if not had and "torch" in sys.modules:
        culprits.append(name)
print(json.dumps([culprits, first]))
"""


@pytest.mark.parametrize("pkg", TORCH_FREE)
def test_torch_free_packages_load_no_torch(pkg):
    modules = sorted(module_name(p) for p in (REPO / pkg).rglob("*.py")
                     if "__pycache__" not in p.parts and p.name != "__main__.py")
    assert len(modules) > 1
    res = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(modules), str(REPO)], capture_output=True,
                         text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr
    culprits, chain = json.loads(res.stdout.strip().splitlines()[-1])
    assert not culprits, (f"importing {culprits[0]} loads torch ({pkg} must stay torch-free); the import "
                          f"chain: {' -> '.join(chain)}")
