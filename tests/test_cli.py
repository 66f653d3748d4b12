"""The `dsv4` command tree (dsv4.cli): lazy subcommands, the runtime-only install's help and errors,
help texts, the README's Commands in order, early refusals, SIGTERM, one rule for oversized
requests, and the weight shards' sha256 with `dsv4 check`. Nothing here compiles a module except
the tests marked slow."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from pathlib import Path

import pytest

from dsv4.cli import COMMANDS, main

REPO = Path(__file__).resolve().parents[1]

# a runtime-only install: torch and the compiler/turbine are not there
_NO_TORCH = textwrap.dedent("""
    import sys, importlib.abc
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] == 'torch' or name.startswith(('iree.compiler', 'iree.turbine')):
                raise ModuleNotFoundError('blocked: ' + name, name=name)
            return None
    sys.meta_path.insert(0, Block())
""")


def _dsv4(*args: str, no_torch: bool = False, timeout: float = 120) -> subprocess.CompletedProcess:
    code = (_NO_TORCH if no_torch else "import sys\n") + "from dsv4.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout)


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every (sub)command's parser, built the way `dsv4 CMD` builds it, by its path ("bench serve")."""
    import importlib

    out: dict[str, argparse.ArgumentParser] = {}

    def walk(path: str, p: argparse.ArgumentParser) -> None:
        out[path] = p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    walk(f"{path} {name}", sp)

    for name, (module, _) in COMMANDS.items():
        top = argparse.ArgumentParser(prog="dsv4")
        sub = top.add_subparsers()
        walk(name, importlib.import_module(module).add_parser(sub, name))
    return out


# ---- item 41.4: one tree, lazy subcommands ------------------------------------------------------

def test_top_help_lists_every_command_and_imports_none_of_them() -> None:
    code = ("import sys\nfrom dsv4.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('dsv4.cli.') or m.split('.')[0] == 'torch')\n"
            "print('LOADED', loaded)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert "LOADED []" in r.stdout, r.stdout
    listed = re.findall(r"^    (\w+)", r.stdout, re.M)
    assert listed == list(COMMANDS), listed
    assert set(COMMANDS) == {"export", "generate", "score", "serve", "bench", "audit", "check", "inspect", "weights",
                             "checkpoint", "eager"}


def test_pyproject_points_dsv4_at_the_cli_package() -> None:
    import tomllib

    pp = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pp["project"]["scripts"]["dsv4"] == "dsv4.cli:main"
    assert "dsv4.cli" in pp["tool"]["setuptools"]["packages"]
    assert pp["tool"]["setuptools"]["package-dir"]["dsv4.cli"] == "cli"


# ---- item 42.3: a runtime-only install --------------------------------------------------------

@pytest.mark.parametrize("cmd", ["export", "generate", "score", "serve", "bench serve", "check", "inspect", "weights random",
                                 "checkpoint make", "eager"])
def test_every_help_works_without_torch(cmd: str) -> None:
    r = _dsv4(*cmd.split(), "--help", no_torch=True)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and r.stdout.startswith(f"usage: dsv4 {cmd}")


@pytest.mark.parametrize("cmd", [["export", "-o", "/tmp/dsv4-never-written"], ["eager"],
                                 ["checkpoint", "make", "-o", "/tmp/dsv4-never-written"]])
def test_torch_commands_without_torch_name_the_extra(cmd: list[str]) -> None:
    r = _dsv4(*cmd, no_torch=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]  # one line
    assert "needs the 'export' extra" in r.stderr and "pip install 'dsv4-iree[export]'" in r.stderr
    assert not Path("/tmp/dsv4-never-written").exists()


# ---- item 42.7: help texts ----------------------------------------------------------------------

def test_every_option_has_help_and_no_help_names_a_single_model_irpa() -> None:
    parsers = _parsers()
    assert {"export", "serve", "bench serve", "weights random", "checkpoint make", "check"} <= set(parsers)
    for path, p in parsers.items():
        text = p.format_help()
        assert "model.irpa" not in text, path
        assert p.description, path
        for a in p._actions:
            if a.option_strings and not isinstance(a, argparse._HelpAction):
                assert a.help, f"dsv4 {path} {a.option_strings[0]} has no help"


def test_serve_help_shows_its_defaults() -> None:
    p = _parsers()["serve"]
    flat = " ".join(p.format_help().split())
    for flag, default in (("--port", "8000"), ("--max-queue", "64"), ("--drain-timeout", "30.0"),
                          ("--host", "127.0.0.1"), ("--device", "local-task"), ("--log-level", "info")):
        a = next(a for a in p._actions if flag in a.option_strings)
        shown = " ".join(p._get_formatter()._expand_help(a).split())
        assert f"default: {default}" in shown and shown in flat, (flag, shown)
    assert "continuous batching" in flat  # a description, not just the options


def test_defaults_shown_match_the_parsers() -> None:
    """Every "(default: X)" the formatter adds is the option's real default."""
    for path, p in _parsers().items():
        for a in p._actions:
            if not a.option_strings or a.default in (None, False, [], argparse.SUPPRESS) or "default" in a.help:
                continue  # no default to show, or the help says it in its own words
            shown = p._get_formatter()._get_help_string(a)
            m = re.search(r"\(default: ([^)]*)\)$", shown)
            if m:
                d = ",".join(map(str, a.default)) if isinstance(a.default, list) else str(a.default)
                assert m.group(1) == d, (path, a.option_strings, m.group(1), d)


def test_checkpoint_presets_are_the_models() -> None:
    from dsv4.cli.checkpoint import PRESETS as ck
    from dsv4.cli.export import PRESETS as ex
    from dsv4.model.config import PRESETS

    assert set(ck) == set(ex) == set(PRESETS)


# ---- item 42.4: make run serves several requests at once ----------------------------------------

def _make_export_args() -> list[str]:
    mk = (REPO / "Makefile").read_text()
    line = next(ln for ln in mk.splitlines() if "$(BIN)/dsv4 export" in ln)
    targets = re.search(r"^TARGETS \?= (.*)$", mk, re.M).group(1)
    line = line.replace("$(TARGETS)", targets).replace("$(EXPORT_DIR)", "out/default")
    return shlex.split(line.split("$(BIN)/dsv4 ", 1)[1])


def test_make_run_export_has_more_than_one_slot() -> None:
    args = _make_export_args()
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    from dsv4.cli.export import add_parser

    add_parser(sub, "export")
    ns = p.parse_args(args)
    slots = ns.n_slots or max(ns.batch_sizes)  # the exporter's default: the largest batch size
    assert slots >= 4 and max(ns.decode_batch_sizes or ns.batch_sizes) >= 4, args


# ---- item 42.5: the README's Commands, in order after make run ----------------------------------

def _readme_commands() -> list[list[str]]:
    text = (REPO / "README.md").read_text()
    sec = text[text.index("## Commands"):text.index("\n## ", text.index("## Commands") + 5)]
    block = sec.split("```")[1]  # the first block: what runs here after make run
    cmds = []
    for ln in block.splitlines():
        ln = ln.split(" #")[0].strip()
        if ln.startswith("dsv4 "):
            cmds.append(shlex.split(ln)[1:])
    return cmds


def test_readme_commands_parse_and_run_in_order_after_make_run() -> None:
    """Replays the first Commands block against a model of the file system that starts with what
    `make run` leaves (out/default, an export without score_bs1) and applies dsv4's rules: an export
    or checkpoint goes to a new directory (or replaces an export), a directory read must exist, score
    needs an export with score_bs1, weights random an export made with --no-weights."""
    cmds = _readme_commands()
    assert len(cmds) >= 8
    exports = {"out/default": {"score": False, "weights": True}}
    made: set[str] = {"out", "out/default"}
    ckpts: set[str] = set()
    norm = lambda d: d.rstrip("/")  # noqa: E731
    parsers = _parsers()
    for argv in cmds:
        parsers[argv[0]].parse_args(argv[1:])  # each line parses (SystemExit otherwise)
        cmd = argv[0]
        if cmd == "export":
            out = norm(argv[argv.index("-o") + 1])
            inside = sorted(m for m in made if m.startswith(out + "/"))
            assert out in exports or (out not in made and not inside), \
                f"{argv}: {out} is not empty ({inside}) and not an export: refused"
            if "--checkpoint" in argv:
                assert norm(argv[argv.index("--checkpoint") + 1]) in ckpts, argv
            exports[out] = {"score": "--no-score" not in argv, "weights": "--no-weights" not in argv}
            made |= {out, *[str(Path(out).parents[i]) for i in range(len(Path(out).parts) - 1)]}
        elif cmd == "checkpoint":
            out = norm(argv[argv.index("-o") + 1])
            assert out not in made, argv
            ckpts.add(out)
            made.add(out)
        elif cmd in ("generate", "score", "check", "weights"):
            d = norm(argv[2] if cmd == "weights" else argv[1])
            assert d in exports, f"{argv}: {d} is not an export yet"
            if cmd == "score":
                assert exports[d]["score"], f"{argv}: {d} has no score_bs1"
            if cmd == "weights":
                assert not exports[d]["weights"], f"{argv}: {d} has weights already"
                exports[d]["weights"] = True
            if cmd in ("generate", "score"):
                assert exports[d]["weights"], f"{argv}: {d} has no weights"
        elif cmd == "eager":
            if "--checkpoint" in argv:
                assert norm(argv[argv.index("--checkpoint") + 1]) in ckpts, argv


# ---- item 42.9: refusals before work, SIGTERM ----------------------------------------------------

def test_export_of_a_missing_checkpoint_fails_first_and_without_torch(tmp_path: Path) -> None:
    """The checkpoint is checked before torch loads (no "needs the export extra" even where torch is
    missing) and before any progress line is printed."""
    t0 = time.perf_counter()
    r = _dsv4("export", "--checkpoint", "/nonexistent", "--target", "llvm-cpu", "-o", str(tmp_path / "o"),
              no_torch=True)
    assert time.perf_counter() - t0 < 20
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.strip() == "dsv4 export: error: --checkpoint /nonexistent: no such directory"
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args,says", [
    (["--devices", "0"], "devices must be an integer >= 1, got 0"),
    (["--pipeline"], "--pipeline needs --devices N"),
    (["--layers", "0"], "layers must be a positive integer, got 0"),
    (["--batch-sizes", "0,4"], "batch sizes must be integers >= 1"),
])
def test_export_config_errors_come_before_torch(tmp_path: Path, args: list[str], says: str) -> None:
    r = _dsv4("export", "--preset", "tiny", "--target", "llvm-cpu", *args, "-o", str(tmp_path / "o"), no_torch=True)
    assert r.returncode == 2 and says in r.stderr and r.stdout == "", r.stderr


def test_export_kernel_option_syntax_is_checked_by_the_parser(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["export", "--kernel", "attention", "-o", "/tmp/dsv4-never-written"])
    assert e.value.code == 2 and "expected OP=IMPL, got 'attention'" in capsys.readouterr().err


def test_sigterm_inside_staged_export_cleans_up_like_ctrl_c(tmp_path: Path) -> None:
    """SIGTERM while an export is being built: KeyboardInterrupt (rc 130 in the CLI), no OUT, no
    .OUT.building-*, SIGTERM's handler as it was (in a child: without the fix SIGTERM kills it)."""
    code = textwrap.dedent(f"""
        import os, signal, threading, time
        from pathlib import Path
        from dsv4.contract.artifact import staged_export
        try:
            with staged_export(Path({str(tmp_path)!r}) / "out") as stage:
                (stage / "model.llvm-cpu.vmfb").write_bytes(b"half")
                threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
                time.sleep(30)
        except KeyboardInterrupt:
            print("interrupted", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "interrupted True", (r.returncode, r.stderr)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_sigterm_during_an_export_exits_130_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "dsv4.cli", "export", "--preset", "tiny", "--dtype", "fp32",
                          "--target", "llvm-cpu", "-o", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=REPO)
    deadline, line = time.time() + 180, ""
    while "exporting" not in line and time.time() < deadline:  # the staging directory exists by then
        line = p.stdout.readline()
        if not line and p.poll() is not None:
            break
    assert list(tmp_path.glob(".out.building-*"))
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=180)
    assert p.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    assert not out.exists() and not list(tmp_path.glob(".out.building-*"))


# ---- item 42.10: one rule for oversized requests; --prompt-ids -----------------------------------

@pytest.mark.parametrize("text,says", [("5,,7", "empty entry 2 in '5,,7'"), ("5,7,", "empty entry 3"),
                                       ("5,x", "entry 2 of '5,x' is 'x'"), ("5,-1", "is '-1'")])
def test_prompt_ids_with_a_bad_entry_is_an_error(capsys, text: str, says: str) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "/nonexistent", "--prompt-ids", text])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_prompt_ids_parse() -> None:
    from dsv4.cli.generate import token_ids

    assert token_ids("5, 6,7") == [5, 6, 7]


class _FakeEngine:
    """An Engine on a 32-position context that would generate forever: what the CLI does with a
    request longer than the context is decided before any token is made."""

    real: type  # the Engine class, saved before the test patches it

    def __new__(cls, *a, **kw):
        # the real Engine's checks, no export behind it (no __init__), no tokenizer
        eng = object.__new__(type("E", (_FakeEngine.real,), {"tokenizer": None}))
        eng.config = type("C", (), {"max_seq_len": 32, "vocab_size": 100})()
        eng.made = []

        def stream(ids, params, add_bos=True):
            for i in range(params.max_new_tokens):
                eng.made.append(i)
                yield type("Chunk", (), {"request_id": 0, "token": 1, "text": ""})()

        eng.stream = stream
        eng.result = lambda rid: type("R", (), {"tokens": eng.made, "stop_reason": "length", "ttft_s": 0.0,
                                                "tpot_s": 0.0, "seed": 0})()
        _FakeEngine.last = eng
        return eng


def test_generate_beyond_the_context_is_refused_with_the_engines_rule(monkeypatch, capsys) -> None:
    import dsv4.runtime.engine as engine_mod
    from dsv4.contract.errors import RequestError

    _FakeEngine.real = engine_mod.Engine
    monkeypatch.setattr(engine_mod, "Engine", _FakeEngine)
    assert main(["generate", "x", "--prompt-ids", "1,2,3", "--max-new-tokens", "100"]) == 2
    err = capsys.readouterr().err.strip()
    assert _FakeEngine.last.made == []  # refused before generating
    with pytest.raises(RequestError) as e:
        _FakeEngine.last.check_length(3, 100)
    assert err == f"dsv4 generate: error: {e.value}"
    assert "context is 32 tokens, but 103 were requested (3 in the prompt, 100 to generate)" in err
    assert main(["generate", "x", "--prompt-ids", "1,2,3", "--max-new-tokens", "29"]) == 0  # 32: fits
    assert len(_FakeEngine.last.made) == 29


# ---- item 42.11: sha256 of each shard, dsv4 check -----------------------------------------------

_SPECS = [("model.embed.weight", [33, 16], "bfloat16"), ("model.norm.weight", [16], "float32"),
          ("model.head.weight", [33, 16], "bfloat16"), ("model.layers.0.w", [40, 8], "float32")]


def _export_without_weights(d: Path, shard_bytes: int = 1500) -> Path:
    """A config.json with a weights inventory (as `dsv4 export --no-weights` writes it) and a
    structurally complete vmfb; no .irpa yet."""
    from dsv4.contract.artifact import TensorSpec, build_config
    from dsv4.contract.weights import planned_names

    specs = [TensorSpec(n, tuple(s), t) for n, s, t in _SPECS]
    names = ["kv"]
    cfg = build_config(model={"vocab_size": 33, "max_seq_len": 48}, activation_dtype="float32", n_slots=2,
                       max_seq_len=48, prefill_batch_sizes=[1], min_tokens=2, max_tokens=16, decode_batch_sizes=[1],
                       score_batch_sizes=[], state=[{"name": "kv", "shape": [2, 49, 16], "dtype": "float32"}],
                       targets={"llvm-cpu": {"vmfb": "model.llvm-cpu.vmfb", "flags": []}},
                       parameters=planned_names(specs, "model", shard_bytes), tokenizer=None, bos_token_id=0,
                       eos_token_ids=[1], export_id="t",
                       weights={"tensors": [s.to_json() for s in specs], "shard_bytes": shard_bytes})
    assert names and len(cfg["parameters"]) >= 2
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    with zipfile.ZipFile(d / "model.llvm-cpu.vmfb", "w") as z:
        z.writestr("module.fb", b"\0" * 256)
    return d


def test_write_shards_hashes_as_it_writes_the_same_bytes(tmp_path: Path) -> None:
    import numpy as np

    from dsv4.contract.artifact import TensorSpec
    from dsv4.contract.weights import write_shards

    rng = np.random.default_rng(0)
    ts = [(n, rng.standard_normal(s).astype(np.float32), "float32") for n, s, _ in _SPECS]
    specs = [TensorSpec(n, tuple(a.shape), t) for n, a, t in ts]
    plain = write_shards(tmp_path / "a", iter(ts), shard_bytes=3000)
    digests: dict[str, str] = {}
    hashed = write_shards(tmp_path / "b", iter(ts), shard_bytes=3000, inventory=specs, digests=digests)
    assert plain == hashed and len(hashed) >= 2 and set(digests) == set(hashed)
    for f in hashed:
        data = (tmp_path / "b" / f).read_bytes()
        assert data == (tmp_path / "a" / f).read_bytes()  # the header computed up front is the same
        assert digests[f] == hashlib.sha256(data).hexdigest()
    with pytest.raises(ValueError, match="out of the inventory's order"):
        write_shards(tmp_path / "c", iter(ts[::-1]), shard_bytes=3000, inventory=specs)
    assert not list((tmp_path / "c").iterdir())


def test_weights_random_records_sha256_and_check_verifies_every_file(tmp_path: Path, capsys) -> None:
    d = _export_without_weights(tmp_path / "out")
    assert main(["weights", "random", str(d), "--seed", "1"]) == 0
    cfg = json.loads((d / "config.json").read_text())
    assert set(cfg["sha256"]) == set(cfg["parameters"])
    for f in cfg["parameters"]:
        assert cfg["sha256"][f] == hashlib.sha256((d / f).read_bytes()).hexdigest()
    capsys.readouterr()

    assert main(["check", str(d)]) == 0
    out = capsys.readouterr()
    assert "all good" in out.out and out.err == ""
    assert all(f"{f} (" in out.out for f in cfg["parameters"])  # a progress line per shard

    # 64 flipped bytes inside the first shard's data: its structure is fine, its digest is not
    f0 = d / cfg["parameters"][0]
    raw = bytearray(f0.read_bytes())
    for i in range(4100, 4164):
        raw[i] ^= 0xFF
    f0.write_bytes(bytes(raw))
    vm = d / "model.llvm-cpu.vmfb"
    vm.write_bytes(vm.read_bytes()[:40])  # and a truncated vmfb
    assert main(["check", str(d)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert f0.name in err[0] and "sha256 differs" in err[0]
    assert "model.llvm-cpu.vmfb" in err[1] and "not a complete IREE module" in err[1]


def test_check_says_when_no_sha256_is_recorded(tmp_path: Path, capsys) -> None:
    d = _export_without_weights(tmp_path / "out")
    assert main(["weights", "random", str(d)]) == 0
    cfg = json.loads((d / "config.json").read_text())
    del cfg["sha256"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert main(["check", str(d), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == len(cfg["parameters"]) and all("no sha256 recorded" in ln for ln in err)


def test_check_is_torch_free_and_names_missing_weights(tmp_path: Path) -> None:
    d = _export_without_weights(tmp_path / "out")
    r = _dsv4("check", str(d), no_torch=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == len(json.loads((d / "config.json").read_text())["parameters"])
    assert all("missing" in ln and "dsv4 weights random" in ln for ln in lines)


def test_export_records_each_shards_sha256(tiny_q_export: Path) -> None:
    """An export's weight files (written by the exporter: conftest's shared quantized tiny export, slow)
    carry their sha256 in config.json, and `dsv4 check` verifies them."""
    out = tiny_q_export
    cfg = json.loads((out / "config.json").read_text())
    files = {*cfg["parameters"], *(f for t in cfg["targets"].values() for f in t.get("parameters", ()))}
    assert cfg["parameters"] and len(files) > len(cfg["parameters"]) and set(cfg["sha256"]) == files  # gfx942's own
    for f in files:
        assert cfg["sha256"][f] == hashlib.sha256((out / f).read_bytes()).hexdigest()
    assert main(["check", str(out)]) == 0
