"""An English training corpus that every machine already has: the text shipped inside CPython.

Why: the project's embedded default model is a small DeepSeek-V4-architecture model trained here on
CPU, and real weights or data sets cannot be downloaded. CPython ships a few megabytes of English
prose offline: the documentation topics behind ``help()`` (``pydoc_data.topics``) and the
docstrings of the standard library. That is what we train on.

Licence: all of this text is part of CPython and is distributed under the Python Software
Foundation License (PSF License Agreement, version 2), as is the text in any corpus built here.

Determinism: docstrings are read in a fresh ``python -I -S`` (so packages that patch the stdlib
on import cannot leak in), everything is walked in sorted order, docstrings come from the objects'
own ``__dict__`` (never inherited), text is normalized (NFC, no trailing spaces, at most one blank
line), and documents are split into train/eval by a SHA-256 of a stable key, not Python's ``hash``.
Two builds on the same CPython release give byte-identical text. Another Python version (even a
different 3.11 patch release, since ``pydoc_data/topics.py`` is regenerated every release) can give
different text, so :class:`Corpus` carries a ``sha256`` and :data:`REFERENCE_SHA256` records the
value for the release the shipped model was trained on; a training script compares the two.

Run ``python -m dsv4.train.corpus`` for statistics.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import unicodedata
from dataclasses import dataclass, field

__all__ = [
    "Corpus",
    "CorpusError",
    "build_corpus",
    "MODULES",
    "REFERENCE_SHA256",
    "DOC_SEPARATOR",
    "EVAL_MODULUS",
]


class CorpusError(RuntimeError):
    """The running interpreter cannot produce the corpus (e.g. docstrings stripped by ``-OO``)."""


# Pure-Python (or C-accelerated but platform-independent) standard-library modules whose
# public docstrings we use. Left out on purpose: anything that prints or opens windows on import
# (this, antigravity, turtle, tkinter, idlelib), needs the network, or whose members/docstrings
# differ by platform or build (os, os.path, sys, time, shutil, tempfile, socket, select, signal,
# subprocess, asyncio, threading, locale, platform, hashlib, zlib, sqlite3), or that Debian ships
# separately (venv, distutils, lib2to3, ensurepip), or that are optional in some builds (lzma, bz2),
# or that warn on import as deprecated in 3.11 (cgi, imghdr, telnetlib, ...). Sorted; order matters
# only for which copy of a shared docstring is kept.
MODULES: tuple[str, ...] = (
    "abc",
    "argparse",
    "array",
    "ast",
    "base64",
    "bdb",
    "binascii",
    "bisect",
    "calendar",
    "cmath",
    "cmd",
    "code",
    "codecs",
    "codeop",
    "collections",
    "collections.abc",
    "colorsys",
    "compileall",
    "concurrent.futures",
    "configparser",
    "contextlib",
    "contextvars",
    "copy",
    "copyreg",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "doctest",
    "email.charset",
    "email.header",
    "email.headerregistry",
    "email.message",
    "email.parser",
    "email.policy",
    "email.utils",
    "enum",
    "filecmp",
    "fnmatch",
    "fractions",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "graphlib",
    "gzip",
    "heapq",
    "hmac",
    "html",
    "html.parser",
    "http",
    "http.cookiejar",
    "http.cookies",
    "importlib.abc",
    "importlib.resources",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "json.decoder",
    "keyword",
    "linecache",
    "logging",
    "logging.config",
    "logging.handlers",
    "mailbox",
    "math",
    "mimetypes",
    "numbers",
    "operator",
    "optparse",
    "pathlib",
    "pickle",
    "pickletools",
    "pkgutil",
    "plistlib",
    "pprint",
    "profile",
    "pstats",
    "py_compile",
    "pyclbr",
    "queue",
    "random",
    "re",
    "reprlib",
    "runpy",
    "sched",
    "secrets",
    "shelve",
    "shlex",
    "statistics",
    "string",
    "struct",
    "symtable",
    "tarfile",
    "textwrap",
    "timeit",
    "tokenize",
    "trace",
    "traceback",
    "tracemalloc",
    "types",
    "typing",
    "unicodedata",
    "unittest",
    "unittest.mock",
    "urllib.parse",
    "urllib.robotparser",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "xml.sax.saxutils",
    "xmlrpc.client",
    "zipfile",
    "zipimport",
)

# Documents are joined with this; normalized documents never contain three newlines in a row, so
# ``text.split(DOC_SEPARATOR)`` gives the documents back.
DOC_SEPARATOR = "\n\n\n"

# A document goes to eval when int(sha256(key)) % EVAL_MODULUS == 0 (about 5 %).
EVAL_MODULUS = 20

# Corpus.sha256 of build_corpus() (default arguments) per CPython release, "X.Y.Z". The embedded
# model is trained on 3.11.7's text. Any change to MODULES, normalization or the split changes the
# hash: update it here together with retraining.
REFERENCE_SHA256: dict[str, str] = {
    "3.11.7": "2883c17851f0cbd382e6255f76937a9dca9484ba050f377e5782d1b7cebb96d1",
}

# Text that would differ between processes or machines (object addresses, local paths).
_UNSTABLE = re.compile(r"0x[0-9a-fA-F]{6,}|/usr/|/home/|site-packages|[A-Z]:\\\\")
_MANY_NEWLINES = re.compile(r"\n{3,}")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


@dataclass(frozen=True)
class Corpus:
    """The corpus split into train and eval documents, with a content hash to detect drift."""

    train_docs: tuple[str, ...]
    eval_docs: tuple[str, ...]
    train_keys: tuple[str, ...]
    eval_keys: tuple[str, ...]
    python_version: str
    train_text: str = field(init=False, repr=False)
    eval_text: str = field(init=False, repr=False)
    sha256: str = field(init=False)

    def __post_init__(self) -> None:
        train_text = DOC_SEPARATOR.join(self.train_docs)
        eval_text = DOC_SEPARATOR.join(self.eval_docs)
        h = hashlib.sha256()
        for part in ("train", train_text, "eval", eval_text):
            h.update(part.encode("utf-8"))
            h.update(b"\x00")
        object.__setattr__(self, "train_text", train_text)
        object.__setattr__(self, "eval_text", eval_text)
        object.__setattr__(self, "sha256", h.hexdigest())

    @property
    def sizes(self) -> dict[str, int]:
        """Chars, whitespace-separated words and documents of each split."""
        return {
            "train_chars": len(self.train_text),
            "train_words": len(self.train_text.split()),
            "train_docs": len(self.train_docs),
            "eval_chars": len(self.eval_text),
            "eval_words": len(self.eval_text.split()),
            "eval_docs": len(self.eval_docs),
        }

    @property
    def reference_sha256(self) -> str | None:
        """The recorded hash for this Python release, or None when none was recorded."""
        return REFERENCE_SHA256.get(self.python_version) or None

    @property
    def matches_reference(self) -> bool:
        """True when this text is byte-identical to what the shipped model was trained on."""
        return self.sha256 == self.reference_sha256


def normalize(text: str) -> str:
    """Canonical whitespace so that the same prose always gives the same bytes.

    Keeps paragraphs and code indentation (useful structure for a model), drops what only
    varies with how the text was written: CRLF, tabs, trailing spaces, runs of blank lines.
    """
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n").expandtabs(8)
    text = _CONTROL.sub(" ", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = _MANY_NEWLINES.sub("\n\n", text)
    return text.strip("\n").rstrip()


def _clean_doc(doc: object) -> str | None:
    """A usable docstring, or None for missing / empty / machine-dependent ones."""
    if not isinstance(doc, str):
        return None
    text = normalize(inspect.cleandoc(doc))
    if not text or _UNSTABLE.search(text):
        return None
    return text


def _public_names(module: object, modname: str) -> list[str]:
    """A module's API: ``__all__`` if it has one, else the public objects it defines itself."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return sorted(set(names))
    out = []
    for name in sorted(vars(module)):
        if name.startswith("_"):
            continue
        obj = vars(module)[name]
        # C accelerators: bisect.bisect_left lives in _bisect, struct.pack in _struct.
        if getattr(obj, "__module__", None) in (modname, "_" + modname.rsplit(".", 1)[-1]):
            out.append(name)
    return out


def _member_doc(obj: object) -> object:
    """The docstring a class member owns itself (unwrapping static/class methods)."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if (
        inspect.isroutine(obj)
        or inspect.isclass(obj)
        or inspect.isdatadescriptor(obj)
        or isinstance(obj, functools.cached_property)
    ):
        return getattr(obj, "__doc__", None)
    return None  # constants, enum members, ...: their __doc__ is their type's


def _module_documents(modname: str, seen: set[str]) -> list[tuple[str, str]]:
    """(key, text) documents for one module: its docstring, then one per public class/function.

    A class document holds the class docstring followed by its own public members' docstrings.
    ``seen`` holds docstrings already used anywhere, so a re-exported or shared docstring
    appears once, at its first place in sorted order.
    """
    module = importlib.import_module(modname)
    docs: list[tuple[str, str]] = []

    def take(doc: object) -> str | None:
        text = _clean_doc(doc)
        if text is None or text in seen:
            return None
        seen.add(text)
        return text

    mod_doc = take(module.__doc__)
    if mod_doc is not None:
        docs.append((f"module:{modname}", f"Module {modname}\n\n{mod_doc}"))

    for name in _public_names(module, modname):
        obj = getattr(module, name, None)
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        qual = f"{modname}.{name}"
        parts: list[str] = []
        head = take(obj.__doc__)
        if head is not None:
            parts.append(f"{qual}\n\n{head}")
        if inspect.isclass(obj):
            members = vars(obj)
            for mname in sorted(members):
                if mname.startswith("_"):
                    continue
                mdoc = take(_member_doc(members[mname]))
                if mdoc is not None:
                    parts.append(f"{qual}.{mname}\n\n{mdoc}")
        if parts:
            docs.append((f"object:{qual}", "\n\n".join(parts)))
    return docs


def _topic_documents() -> list[tuple[str, str]]:
    """(key, text) for each pydoc topic (the text behind ``help('keywords')`` etc.), sorted."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        text = normalize(topics[key])
        if text:
            out.append((f"topic:{key}", text))
    return out


def _is_eval(key: str) -> bool:
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % EVAL_MODULUS == 0


def _collect(modules: tuple[str, ...], include_topics: bool) -> list[tuple[str, str]]:
    """All (key, text) documents in build order, from the interpreter this runs in."""
    if sys.flags.optimize >= 2:
        raise CorpusError("docstrings are stripped under python -OO; run without -OO")
    seen: set[str] = set()
    documents: list[tuple[str, str]] = _topic_documents() if include_topics else []
    seen.update(text for _, text in documents)
    for modname in modules:
        documents.extend(_module_documents(modname, seen))
    return documents


def _collect_isolated(modules: tuple[str, ...], include_topics: bool) -> list[tuple[str, str]]:
    """:func:`_collect` in a fresh ``python -I -S``: a pristine standard library.

    Why: importing other packages can monkeypatch stdlib functions (``import torch`` replaces
    ``inspect.getfile``), and sitecustomize or PYTHONPATH can do the same, which would silently
    change the corpus depending on what the caller imported before. This file imports only the
    standard library, so it runs as a script there.
    """
    request = json.dumps({"modules": list(modules), "include_topics": include_topics})
    proc = subprocess.run(
        [sys.executable, "-I", "-S", os.path.abspath(__file__), "--collect-json"],
        input=request.encode("ascii"),
        capture_output=True,
        check=False,
    )
    if proc.returncode != 0:
        raise CorpusError(f"corpus collection failed:\n{proc.stderr.decode('utf-8', 'replace')}")
    return [(k, t) for k, t in json.loads(proc.stdout.decode("ascii"))]


def build_corpus(
    modules: tuple[str, ...] = MODULES,
    include_topics: bool = True,
    isolated: bool = True,
) -> Corpus:
    """Collect the CPython documentation text and split it deterministically into train/eval.

    ``isolated`` (the default) reads the docstrings in a fresh interpreter so that whatever the
    caller has imported cannot change the text; ``isolated=False`` reads them in this process
    (faster, only safe when nothing has patched the standard library).

    Eval holds the documents whose key hashes to 0 mod :data:`EVAL_MODULUS`. An eval document
    whose text already occurs verbatim inside the training text would measure memorization, not
    generalization, so such documents are moved to train (repeated until none is left).
    """
    modules = tuple(modules)
    if isolated:
        documents = _collect_isolated(modules, include_topics)
    else:
        documents = _collect(modules, include_topics)

    # Whole-document dedupe (keeps the first in build order).
    seen_text: set[str] = set()
    kept: list[tuple[str, str]] = []
    for key, text in documents:
        if text not in seen_text:
            seen_text.add(text)
            kept.append((key, text))
    order = {key: i for i, (key, _) in enumerate(kept)}

    train = [(k, t) for k, t in kept if not _is_eval(k)]
    evals = [(k, t) for k, t in kept if _is_eval(k)]
    moved = True
    while moved:
        train_text = DOC_SEPARATOR.join(t for _, t in train)
        leak = [(k, t) for k, t in evals if t in train_text]
        moved = bool(leak)
        if moved:
            evals = [(k, t) for k, t in evals if t not in train_text]
            train.extend(leak)
            train.sort(key=lambda kt: order[kt[0]])

    return Corpus(
        train_docs=tuple(t for _, t in train),
        eval_docs=tuple(t for _, t in evals),
        train_keys=tuple(k for k, _ in train),
        eval_keys=tuple(k for k, _ in evals),
        python_version="%d.%d.%d" % sys.version_info[:3],
    )


def main() -> None:
    """Print corpus statistics and whether the text matches the recorded reference."""
    import time

    t0 = time.perf_counter()
    corpus = build_corpus()
    dt = time.perf_counter() - t0
    s = corpus.sizes
    print(f"python {corpus.python_version}; built in {dt:.2f} s")
    print(f"{'split':6} {'chars':>10} {'words':>9} {'docs':>6}")
    for split in ("train", "eval"):
        chars, words, docs = (s[f"{split}_{k}"] for k in ("chars", "words", "docs"))
        print(f"{split:6} {chars:>10,} {words:>9,} {docs:>6,}")
    print(f"sha256 {corpus.sha256}")
    ref = corpus.reference_sha256
    if ref is None:
        print(f"no reference hash recorded for Python {corpus.python_version}")
    else:
        print("matches reference" if corpus.matches_reference else f"DIFFERS from reference {ref}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--collect-json"]:  # the isolated child of _collect_isolated
        _req = json.loads(sys.stdin.read())
        _docs = _collect(tuple(_req["modules"]), bool(_req["include_topics"]))
        sys.stdout.write(json.dumps(_docs, ensure_ascii=True))
    else:
        main()
