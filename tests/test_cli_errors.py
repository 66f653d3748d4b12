"""What a new user hits first (issue 13): refusals before minutes of work, clear one-line errors,
Ctrl-C, help texts, progress, the parameter count. No test here traces or compiles a model."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from dsv4.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_export_refuses_a_folder_that_is_not_an_export(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text('{"mine": 1}')
    t0 = time.perf_counter()
    assert main(["export", "--preset", "tiny", "--target", "llvm-cpu", "-o", str(tmp_path)]) == 2
    assert time.perf_counter() - t0 < 30  # refused before loading/tracing anything
    err = capsys.readouterr().err
    assert "is not empty and is not a dsv4 export" in err and "--force" in err
    assert json.loads((tmp_path / "config.json").read_text()) == {"mine": 1}


@pytest.mark.parametrize("target,says", [
    ("cuda:sm_90", r"cuda arch 'sm_90' is not supported.*sm_89 PTX runs on Hopper"),
    ("llvm-cpu:bogus-cpu", r"target 'llvm-cpu:bogus-cpu' is refused by iree-compile: Unknown CPU"),
    ("gfx942:gfx9999", r"target 'gfx942:gfx9999' is refused by iree-compile: .*Unknown ROCM target 'gfx9999'"),
])
def test_bad_target_arch_is_refused_before_tracing(tmp_path: Path, capsys, target: str, says: str) -> None:
    import re

    t0 = time.perf_counter()
    assert main(["export", "--preset", "tiny", "--target", target, "-o", str(tmp_path / "out")]) == 2
    assert time.perf_counter() - t0 < 60
    err = capsys.readouterr().err
    assert re.search(says, err), err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_compile_failure_without_diagnostic_shows_its_first_line(tmp_path: Path) -> None:
    """An LLVM option error has no 'error:' line; the message shows the compiler's first line."""
    from dsv4.export.compile import CompileError, compile_mlir

    mlir = "func.func @f(%a: tensor<4xf32>) -> tensor<4xf32> {\n  %0 = arith.mulf %a, %a : tensor<4xf32>\n  return %0 : tensor<4xf32>\n}\n"
    with pytest.raises(CompileError) as ei:
        compile_mlir(mlir, "llvm-cpu:bogus-cpu", tmp_path / "f.vmfb")
    lines = str(ei.value).splitlines()
    assert lines[1].strip() == "Unknown CPU for target architecture x86_64."
    assert "no 'error:' line" not in str(ei.value)


def test_eager_preset_with_prompt_text_is_an_error(capsys) -> None:
    assert main(["eager", "--preset", "tiny", "--prompt", "hello"]) == 2
    assert "--prompt needs a tokenizer" in capsys.readouterr().err


def test_ctrl_c_exits_130_without_traceback(tmp_path: Path) -> None:
    """SIGINT in the middle of an export: rc 130, one line, and OUT / the staging dir are not left."""
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "dsv4.cli", "export", "--preset", "tiny", "--dtype", "fp32",
                          "--target", "llvm-cpu", "-o", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=REPO,
                         # a shell's background job (`cmd &`) runs with SIGINT ignored, and an ignored
                         # signal stays ignored across exec: Python then never raises KeyboardInterrupt
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    line = ""
    while "exporting" not in line and time.time() < deadline:  # wait until tracing has begun
        line = p.stdout.readline()
        if not line and p.poll() is not None:
            break
    p.send_signal(signal.SIGINT)
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        # once in a full CI run (2-core box) the first SIGINT did not end the export within 120 s:
        # a user presses Ctrl-C again, and that must still exit cleanly (noted in issue 13)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    assert not out.exists() and not list(tmp_path.glob(".out.building-*"))


def test_help_texts() -> None:
    r = subprocess.run([sys.executable, "-m", "dsv4.cli", "export", "--help"], capture_output=True,
                       text=True, cwd=REPO)
    assert r.returncode == 0
    assert "add_parser" not in r.stdout and "cli/" not in r.stdout  # no developer notes
    assert "--force" in r.stdout and "sm_89" in r.stdout and "default: 1,4" in r.stdout
    r = subprocess.run([sys.executable, "-m", "dsv4.cli", "checkpoint", "--help"], capture_output=True,
                       text=True, cwd=REPO)
    assert "checkpoint make --help" in r.stdout
    r = subprocess.run([sys.executable, "-m", "dsv4.cli", "generate", "--help"], capture_output=True,
                       text=True, cwd=REPO)
    for flag in ("--temperature", "--top-k", "--top-p", "--seed", "--device"):
        assert flag in r.stdout
    assert r.stdout.count("default") >= 6


def test_chat_dependency_is_in_the_base_install() -> None:
    """`generate --chat` renders a jinja2 template at runtime: jinja2 must come with the runtime-only install."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.lower().startswith("jinja2") for d in deps), deps


def test_parameter_count_is_the_trained_count() -> None:
    """The export log's count of the embedded model equals the trainer's (train_log.json), though
    the checkpoint stores fewer elements (MXFP4 packs two weights per byte)."""
    torch = pytest.importorskip("torch")
    from dsv4.export.command import _count, parameter_counts
    from dsv4.model.checkpoint import EMBEDDED_CHECKPOINT, load_checkpoint

    trained = json.loads((EMBEDDED_CHECKPOINT / "train_log.json").read_text())["parameters"]
    model = load_checkpoint(EMBEDDED_CHECKPOINT, dtype=torch.bfloat16)
    weights, scales, stored = parameter_counts(model)
    assert weights == trained and stored < weights
    assert _count(model).startswith(f"{trained / 1e6:.2f} M weights ({stored / 1e6:.2f} M stored tensor elements")


def test_heartbeat_reports_elapsed_time_while_a_stage_runs() -> None:
    pytest.importorskip("torch")
    from dsv4.export.exporter import _heartbeat

    lines: list[str] = []
    with _heartbeat(lines.append, "compiling llvm-cpu", every=0.05):
        time.sleep(0.23)
    assert 3 <= len(lines) <= 5 and all(ln.startswith("  ... compiling llvm-cpu: ") for ln in lines)
    n = len(lines)
    time.sleep(0.1)
    assert len(lines) == n  # stops with the stage


def test_export_silences_known_third_party_warnings_only() -> None:
    """The warnings seen in `dsv4 export` output (torch.export's pytree FutureWarning issued from
    copyreg, turbine's strict_export notice) are filtered; a warning from our code is not."""
    import warnings

    from dsv4.export.command import _QUIET

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("default")
        for cat, mod in _QUIET:
            warnings.filterwarnings("ignore", category=cat, module=mod)
        warnings.warn_explicit("isinstance(treespec, LeafSpec) is deprecated", FutureWarning, "copyreg.py", 105,
                               module="copyreg")
        warnings.warn_explicit("When strict_export == False ...", UserWarning, "exporter.py", 272,
                               module="iree.turbine.aot.exporter")
        warnings.warn_explicit("ours", UserWarning, "model.py", 1, module="dsv4.model.model")
    assert [str(r.message) for r in rec] == ["ours"]
