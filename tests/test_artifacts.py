"""The export directory's contract (dsv4.contract.artifact): config writer/reader, the staged build
that replaces OUT only on success, structural checks of .irpa / .vmfb, corrupt artifacts through
the `dsv4` command (one line naming the file, rc 2), incremental detokenization, public imports.

Torch-free except the toy export (built once per session with the toy module of test_engine_toy).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dsv4.runtime import ArtifactError, ExportConfig
from dsv4.contract.artifact import (FORMAT, build_config, check_out_dir, check_vmfb, is_export_dir, staged_export,
                                   write_config)
from dsv4.contract.weights import check_irpa
from dsv4.runtime.text import IncrementalDecoder, StopMatcher

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------
# public imports
# ------------------------------------------------------------------------------------------------


def test_public_imports_are_lazy_and_torch_free() -> None:
    code = (
        "import sys\n"
        "import dsv4.runtime\n"
        "assert 'numpy' not in sys.modules and 'iree.runtime' not in sys.modules, 'import dsv4.runtime is not lazy'\n"
        "from dsv4.runtime import Engine, SamplingParams, GenerationResult, StreamChunk, ScoreResult\n"
        "from dsv4.runtime import EngineError, ArtifactError, RequestError, ExportConfig\n"
        "assert issubclass(ArtifactError, EngineError) and issubclass(RequestError, EngineError)\n"
        "assert Engine.__init__.__doc__ and Engine.generate.__doc__ and Engine.stream.__doc__\n"
        "assert 'torch' not in sys.modules\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------------------------------------
# config writer / reader
# ------------------------------------------------------------------------------------------------


def _contract(**over) -> dict:
    kw = dict(model={"vocab_size": 40, "max_seq_len": 32}, activation_dtype="float32", n_slots=2, max_seq_len=32,
              prefill_batch_sizes=[1, 2], min_tokens=4, max_tokens=16, decode_batch_sizes=[1, 2],
              score_batch_sizes=[1], state=[{"name": "kv", "shape": [2, 33, 8], "dtype": "bfloat16"}],
              targets={"llvm-cpu": {"vmfb": "model.llvm-cpu.vmfb", "driver": "local-task"}},
              parameters="model.irpa", tokenizer=None, bos_token_id=0, eos_token_ids=[1], export_id="e1")
    kw.update(over)
    return build_config(**kw)


def test_written_config_is_what_the_reader_reads(tmp_path: Path) -> None:
    cfg = _contract()
    for f in ("model.irpa", "model.llvm-cpu.vmfb"):
        (tmp_path / f).write_bytes(b"")
    write_config(tmp_path, cfg)
    got = ExportConfig.load(tmp_path)
    assert got.prefill_batch_sizes == (1, 2) and got.decode_batch_sizes == (1, 2)
    assert got.functions["score_bs1"] == {"args": ["tokens", "start_pos", "lengths", "slots", "kv"],
                                          "results": ["logprobs"]}
    assert [s.name for s in got.state] == ["kv"] and got.state[0].nbytes == 2 * 33 * 8 * 2
    assert got.export_id == "e1" and is_export_dir(tmp_path)


def test_writer_refuses_a_config_the_reader_would_refuse(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="expected n_slots = 2"):
        write_config(tmp_path, _contract(state=[{"name": "kv", "shape": [3, 33, 8], "dtype": "float32"}]))
    assert not (tmp_path / "config.json").exists()


def test_speculative_entry_points_round_trip_and_are_checked(tmp_path: Path) -> None:
    from dsv4.contract.artifact import speculative_functions

    spec, fns = speculative_functions(2, [1], [1, 2], ["kv"])
    got = ExportConfig.from_dict(_contract(speculative=spec, extra_functions=fns), tmp_path)
    assert got.speculative == {"method": "mtp", "draft_tokens": 2, "prefill_batch_sizes": [1],
                               "verify_batch_sizes": [1, 2]}
    sampling = ["temperature", "top_k", "top_p", "key"]
    assert got.functions["mtp_prefill_bs1"]["args"] == ["tokens", "start_pos", "lengths", "slots", "next_tokens",
                                                        *sampling, "kv"]
    assert got.functions["verify_bs2_k2"]["args"] == ["tokens", "start_pos", "lengths", "slots", *sampling, "kv"]
    assert got.functions["verify_bs2_k2"]["results"] == ["logits", "chosen", "accepted", "drafts"]
    assert ExportConfig.from_dict(_contract(), tmp_path).speculative is None
    with pytest.raises(ArtifactError, match="speculative: functions missing: verify_bs2_k2"):
        ExportConfig.from_dict(_contract(speculative=spec, extra_functions={k: v for k, v in fns.items()
                                                                            if k != "verify_bs2_k2"}), tmp_path)
    with pytest.raises(ArtifactError, match="speculative: must be"):
        ExportConfig.from_dict(_contract(speculative={**spec, "draft_tokens": 0}, extra_functions=fns), tmp_path)
    bad = {**fns, "mtp_prefill_bs1": {**fns["mtp_prefill_bs1"],
                                      "args": ["tokens", "start_pos", "lengths", "slots", "kv"]}}
    with pytest.raises(ArtifactError, match=r"functions.mtp_prefill_bs1: args must be"):
        ExportConfig.from_dict(_contract(speculative=spec, extra_functions=bad), tmp_path)
    # an export from before sampled speculation (verify without the sampling inputs) is refused by name
    old = {**fns, "verify_bs1_k2": {**fns["verify_bs1_k2"], "args": ["tokens", "start_pos", "lengths", "slots", "kv"]}}
    with pytest.raises(ArtifactError, match=r"functions.verify_bs1_k2: args must be .*re-export"):
        ExportConfig.from_dict(_contract(speculative=spec, extra_functions=old), tmp_path)


# ------------------------------------------------------------------------------------------------
# staged build: OUT is replaced only when the new export is complete
# ------------------------------------------------------------------------------------------------


def _fake_export(d: Path, marker: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"format": FORMAT, "version": 1, "marker": marker}))
    (d / "model.irpa").write_text(marker)
    return d


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_staged_export_replaces_out_on_success(tmp_path: Path) -> None:
    out = _fake_export(tmp_path / "out", "old")
    (out / "stale.vmfb").write_text("from the old export")
    mask = os.umask(0o022)
    try:
        with staged_export(out) as stage:
            assert stage.parent == out.parent and stage != out and not any(stage.iterdir())
            _fake_export(stage, "new")
            (stage / "model.irpa").chmod(0o600)  # IREE writes archives owner-only
    finally:
        os.umask(mask)
    assert json.loads((out / "config.json").read_text())["marker"] == "new"
    assert not (out / "stale.vmfb").exists()
    assert (out / "model.irpa").stat().st_mode & 0o777 == 0o644  # readable by a service user
    assert out.stat().st_mode & 0o777 == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging/old directory left


def test_staged_export_failure_leaves_out_as_it_was(tmp_path: Path) -> None:
    out = _fake_export(tmp_path / "out", "old")
    before = _snapshot(out)
    with pytest.raises(RuntimeError, match="compile failed"):
        with staged_export(out) as stage:
            _fake_export(stage, "half")
            raise RuntimeError("compile failed")
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_out_dir_that_is_not_an_export_is_refused(tmp_path: Path) -> None:
    user = tmp_path / "mine"
    user.mkdir()
    (user / "config.json").write_text('{"my": "settings"}')
    with pytest.raises(ValueError, match="not empty and is not a dsv4 export.*--force"):
        check_out_dir(user)
    with pytest.raises(ValueError, match="not a directory"):
        check_out_dir(user / "config.json")
    check_out_dir(tmp_path / "new")  # absent: fine
    (tmp_path / "empty").mkdir()
    check_out_dir(tmp_path / "empty")
    check_out_dir(_fake_export(tmp_path / "old", "x"))  # an export: replaced
    with staged_export(user, force=True) as stage:
        _fake_export(stage, "forced")
    assert json.loads((user / "config.json").read_text())["marker"] == "forced"


def test_failed_export_model_leaves_a_working_export_alone(tmp_path: Path, monkeypatch) -> None:
    """export_model end to end with the minutes-long stages replaced: the compile of the second
    target fails after the first one wrote its vmfb; OUT keeps every byte of the old export."""
    pytest.importorskip("torch")
    import torch

    from dsv4.export import exporter
    from dsv4.export.compile import CompileError, CompileResult
    from dsv4.model.config import ModelConfig
    from dsv4.model.model import Transformer

    out = _fake_export(tmp_path / "out", "working")
    (out / "model.llvm-cpu.vmfb").write_text("old module")
    before = _snapshot(out)

    def fake_build(run, model, state_spec, mlir, tag):
        mlir.write_text("module {}")  # the weights stage then writes new shards into the stage

    def fake_compile(mlir, target, vmfb, extra=(), log_path=None):
        if target.name == "cuda":
            Path(log_path).write_text("error: boom")
            raise CompileError("cuda", "iree-compile failed for target 'cuda': boom", log_path=Path(log_path))
        Path(vmfb).write_text("new module")
        return CompileResult(Path(vmfb), 0.0, ())

    monkeypatch.setattr(exporter, "_build_mlir", fake_build)
    monkeypatch.setattr(exporter, "compile_mlir", fake_compile)
    cfg = ModelConfig.preset("tiny")
    model = Transformer(cfg, dtype=torch.float32)
    with pytest.raises(exporter.ExportError, match="compile:cuda"):
        exporter.export_model(model, exporter.ExportSpec(targets=["llvm-cpu", "cuda"], batch_sizes=[1]), out)
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out.cuda.log"]  # the log is kept beside OUT
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(exporter.ExportError, match="not a dsv4 export"):
        exporter.export_model(model, exporter.ExportSpec(targets=["llvm-cpu"], batch_sizes=[1]), user)
    assert (user / "notes.txt").read_text() == "mine"


# ------------------------------------------------------------------------------------------------
# structural checks: .irpa and .vmfb
# ------------------------------------------------------------------------------------------------


def _irpa(path: Path) -> Path:
    import iree.runtime as rt

    idx = rt.ParameterIndex()
    idx.add_buffer("a", np.arange(1000, dtype=np.float32).tobytes())
    idx.add_buffer("b", np.ones(300, dtype=np.int8).tobytes())
    idx.create_archive_file(str(path))
    return path


def test_check_irpa_accepts_a_real_archive_and_names_a_broken_one(tmp_path: Path) -> None:
    good = _irpa(tmp_path / "good.irpa")
    assert check_irpa(good) == 2
    data = good.read_bytes()
    for n, match in [(0, "too short for its header"), (40, "too short"), (200, "truncated"),
                     (3000, "truncated: the storage segment ends at byte")]:
        bad = tmp_path / f"cut{n}.irpa"
        bad.write_bytes(data[:n])
        with pytest.raises(ArtifactError, match=rf"cut{n}\.irpa: .*{match}"):
            check_irpa(bad)
    junk = tmp_path / "junk.irpa"
    junk.write_bytes(b"PK" + bytes(200))
    with pytest.raises(ArtifactError, match="no IRPA magic"):
        check_irpa(junk)


# ------------------------------------------------------------------------------------------------
# corrupt artifacts through the command: one line naming the file, rc 2
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    from test_engine_toy import _build_toy_export

    return _build_toy_export(tmp_path_factory.mktemp("toy"))


def _break(d: Path, name: str, how: str) -> None:
    p = d / name
    data = p.read_bytes()
    p.write_bytes({"truncate": data[: len(data) // 2], "empty": b"", "garbage": b"\x00garbage" * 64}[how])


@pytest.mark.parametrize("name,how", [("model.irpa", "truncate"), ("model.irpa", "empty"), ("model.irpa", "garbage"),
                                      ("model.llvm-cpu.vmfb", "truncate"), ("model.llvm-cpu.vmfb", "empty"),
                                      ("model.llvm-cpu.vmfb", "garbage"), ("config.json", "truncate"),
                                      ("config.json", "empty"), ("tokenizer.json", "truncate")])
def test_corrupt_artifact_gives_one_line_naming_the_file(toy: Path, tmp_path: Path, capsys, name: str,
                                                         how: str) -> None:
    from dsv4.cli import main

    d = tmp_path / "export"
    shutil.copytree(toy, d)
    _break(d, name, how)
    assert main(["generate", str(d), "--prompt-ids", "0,5,6", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and name in err[0] and "Traceback" not in err[0], err


def test_vmfb_check_accepts_the_compiled_module(toy: Path) -> None:
    check_vmfb(toy / "model.llvm-cpu.vmfb")


def test_score_without_score_function_says_how_to_get_it(toy: Path, tmp_path: Path, capsys) -> None:
    from dsv4.cli import main

    d = tmp_path / "export"
    shutil.copytree(toy, d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["functions"]["score_bs1"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert main(["score", str(d), "--prompt-ids", "0,5,6"]) == 2
    err = capsys.readouterr().err
    assert "no score_bs1" in err and "without --no-score" in err


# ------------------------------------------------------------------------------------------------
# text: incremental detokenization and stop strings
# ------------------------------------------------------------------------------------------------


def test_incremental_decode_equals_full_decode_and_stays_short() -> None:
    """Pieces of the embedded tokenizer's byte-level BPE (multi-byte UTF-8 split across tokens
    included) add up to the full decode; every decode call sees a short window, not the reply."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(REPO / "model" / "assets" / "small" / "tokenizer.json"))
    text = "Grüße — naïve 日本語 text: list.append(x) → 3½ ✓ and more words " * 12
    rng = np.random.default_rng(0)
    streams = [tok.encode(text).ids, rng.integers(0, tok.get_vocab_size(), 400).tolist()]
    for ids in streams:
        windows: list[int] = []

        def dec(x):
            windows.append(len(x))
            return tok.decode(list(x), skip_special_tokens=True)

        inc = IncrementalDecoder(dec)
        pieces = "".join(inc.push(t) for t in ids) + inc.flush()
        assert pieces == tok.decode(ids, skip_special_tokens=True)
        assert max(windows) <= 8, max(windows)


def test_stop_matcher_find_new_searches_only_the_tail() -> None:
    m = StopMatcher(["STOP", "ab"])
    assert m.find_new("xxxxSTO", 0) is None
    assert m.find_new("xxxxSTOP", 7) == 4  # the stop string straddles the old end
    assert m.find_new("abxxxx", 6) is None  # an earlier hit is not searched again
    assert StopMatcher([]).find_new("anything", 0) is None


def test_seed_is_printed_only_when_it_matters(toy: Path, capsys) -> None:
    from dsv4.cli import main

    assert main(["generate", str(toy), "--prompt", "hello", "--max-new-tokens", "3", "--ignore-eos"]) == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert "stop: length" in summary and "seed" not in summary  # greedy draws nothing
    assert main(["generate", str(toy), "--prompt", "hello", "--max-new-tokens", "3", "--ignore-eos",
                 "--temperature", "0.8", "--seed", "3"]) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("seed 3]")


def test_ctrl_c_while_generating_exits_130_and_frees_the_slot(toy: Path, capsys, monkeypatch) -> None:
    from dsv4.cli import main
    from dsv4.runtime.engine import Engine

    real_step, calls, engines = Engine.step, [], []

    def step(self):
        engines.append(self)
        calls.append(1)
        if len(calls) == 3:  # the user presses Ctrl-C after two tokens
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(Engine, "step", step)
    assert main(["generate", str(toy), "--prompt", "hello", "--max-new-tokens", "20", "--ignore-eos"]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err
    assert engines[0].slots.n_free == engines[0].config.n_slots and not engines[0].has_work


@pytest.mark.parametrize("order", [["gfx942", "llvm-cpu"], ["llvm-cpu", "gfx942"]])
def test_each_weight_group_is_labelled_with_the_fp8_flavour_its_files_hold(order, tmp_path: Path, monkeypatch) -> None:
    """Targets of both FP8 flavours in either order (the minutes-long stages replaced): every target's
    weight group says the FP8 dtype its files really hold (gfx942: e4m3fnuz, llvm-cpu: e4m3fn), and
    the bytes are the fn->fnuz conversion of each other. A gfx942-first order used to label the
    llvm-cpu group e4m3fnuz over e4m3fn files (a wrong-format read on MI300X's side of the bug)."""
    pytest.importorskip("torch")
    import numpy as np
    import torch

    from dsv4.export import exporter
    from dsv4.export.compile import CompileResult
    from dsv4.model.config import ModelConfig
    from dsv4.model.quant.formats import fp8_fn_to_fnuz
    from dsv4.model.model import Transformer
    from dsv4.contract.weights import open_weights

    monkeypatch.setattr(exporter, "_build_mlir", lambda run, model, state_spec, mlir, tag: mlir.write_text("module {}"))
    monkeypatch.setattr(exporter, "compile_mlir", lambda mlir, target, vmfb, extra=(), log_path=None: (
        Path(vmfb).write_text("module"), CompileResult(Path(vmfb), 0.0, ()))[1])
    cfg = ModelConfig.preset("tiny")
    model = Transformer(cfg, dtype=torch.float32, quantized=True)
    with torch.no_grad():
        for p in model.parameters():  # finite FP8 codes, E8M0 scales of 2^-7, anything else 0
            if p.dtype == torch.float8_e4m3fn:
                p.copy_((torch.randn(p.shape) * 0.05).to(torch.float8_e4m3fn))
            else:
                p.copy_(torch.full(p.shape, 120, dtype=p.dtype) if p.dtype == torch.uint8 else torch.zeros(p.shape))
    model.layers[0].attn.wq_a.weight.data.view(torch.uint8)[0, 0] = 0x80  # -0: the code the formats disagree on
    exporter.export_model(model, exporter.ExportSpec(targets=order, batch_sizes=[1], score=False), tmp_path / "out")
    exp = ExportConfig.load(tmp_path / "out")
    held = {}
    for g in exp.weight_groups():
        got = open_weights(g.files)
        dtypes = {got.spec(k)[1] for k in got} & {"float8_e4m3fn", "float8_e4m3fnuz"}
        assert {s.dtype for s in g.specs} & dtypes == dtypes and len(dtypes) == 1, (g.targets, dtypes)
        for t in g.targets:
            held[t] = (dtypes.pop(), got)
    assert held["gfx942"][0] == "float8_e4m3fnuz" and held["llvm-cpu"][0] == "float8_e4m3fn"
    key = "model.layers.0.attn.wq_a"
    fn_w, fn_s = torch.from_numpy(np.array(held["llvm-cpu"][1].tensor(f"{key}.weight"))), \
        torch.from_numpy(np.array(held["llvm-cpu"][1].tensor(f"{key}.scale")))
    nz_w, nz_s = fp8_fn_to_fnuz(fn_w.view(torch.float8_e4m3fn), fn_s)
    assert np.array_equal(held["gfx942"][1].tensor(f"{key}.weight").view(np.uint8), nz_w.view(torch.uint8).numpy())
    assert np.array_equal(held["gfx942"][1].tensor(f"{key}.scale").view(np.uint8), nz_s.view(torch.uint8).numpy())
