"""Real sizes without real memory (issue 11): --layers, the empty model, --no-weights exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import cached_export

from dsv4.model.config import ConfigError, ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # eager torch on tiny models


def test_first_layers_keeps_ratios_hash_layers_and_mtp() -> None:
    flash = ModelConfig.preset("flash")
    two = flash.first_layers(2)
    assert (two.num_hidden_layers, two.compress_ratios, two.num_hash_layers) == (2, (0, 0, 0), 2)
    five = flash.first_layers(5)
    assert five.compress_ratios == (0, 0, 4, 128, 4, 0) and five.num_hash_layers == 3
    assert five.n_mtp == flash.n_mtp == 1 and five.hidden_size == 4096 and five.index_topk == 512
    pro = ModelConfig.preset("pro").first_layers(3)
    assert pro.compress_ratios == (128, 128, 4, 0)
    assert flash.first_layers(43) == flash
    for bad in (0, 44, "2"):
        with pytest.raises(ConfigError, match="layers: expected 1..43"):
            flash.first_layers(bad)


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def test_empty_model_of_full_flash_costs_address_space_not_memory() -> None:
    from dsv4.model.model import empty_model

    cfg = ModelConfig.preset("flash")
    before = _rss()
    m = empty_model(cfg)
    grown = _rss() - before
    total = sum(p.nbytes for p in m.parameters())
    # routed experts alone: layers+MTP x 256 experts x 3 matrices x 4096 x 2048 / 2 (MXFP4) bytes
    experts = (cfg.n_layers + cfg.n_mtp) * 256 * 3 * 4096 * 2048 // 2
    assert experts > 140e9 and total > experts
    assert grown < 1.5e9, f"building the empty Flash model touched {grown / 1e9:.1f} GB"
    assert m.layers[2].attn.wq_a.weight.dtype == torch.float8_e4m3fn
    from dsv4.model.model import rope_table

    cos, _ = rope_table(cfg.qk_rope_head_dim, cfg.max_seq_len, cfg.rope_theta, None)
    assert torch.equal(m.rope_window_cos, cos)  # the buffers are real, not left empty


@pytest.fixture(scope="module")
def noweights_export() -> Path:
    """tiny in the release format (FP8 + MXFP4), fp32, --quant-sim off, exported from an empty model
    with weights=None and every quantized linear as its `weight_only` alternative (one export for both
    tests below: the no-weights artifact, and the GPU-host flow that makes its weights afterwards)."""
    from dsv4.export.exporter import ExportSpec, export_model
    from dsv4.model.model import empty_model

    cfg = ModelConfig.preset("tiny", quant_sim=False)

    def build(d: Path) -> None:
        export_model(empty_model(cfg, torch.float32), ExportSpec(targets=["llvm-cpu"], batch_sizes=[1], score=False, keep_mlir=True, kernels={"*": "weight_only"}), d, weights=None)

    return cached_export("noweights-tiny", build, ["noweights", "weight_only", cfg.to_dict()])


def test_no_weights_export_has_config_and_vmfb_and_a_full_inventory(noweights_export: Path) -> None:
    d = noweights_export
    raw = json.loads((d / "config.json").read_text())
    assert (d / "model.llvm-cpu.vmfb").is_file() and not list(d.glob("*.irpa"))
    inv = raw["weights"]["tensors"]
    # the inventory names every parameter the compiled graph reads from the archive, plus the MTP
    # blocks' (kept in the weights, not called by the exported entry points)
    mlir = (d / "model.mlir").read_text()
    in_graph = set(re.findall(r'#(?:flow|stream)\.parameter\.named<"model"::"([^"]+)">', mlir))
    listed = {k for k, _, _ in inv}
    assert in_graph and in_graph <= listed
    assert listed - in_graph and all(k.startswith("model.mtp.") for k in listed - in_graph)
    dtypes = {k: dt for k, _, dt in inv}
    assert dtypes["model.layers.1.attn.wq_a.weight"] == "float8_e4m3fn"
    assert dtypes["model.layers.1.attn.wq_a.scale"] == "uint8"
    shapes = {k: s for k, s, _ in inv}
    cfg = ModelConfig.preset("tiny")
    assert shapes["model.embed.weight"] == [cfg.vocab_size, cfg.hidden_size]


@pytest.fixture
def weight_only_export(noweights_export: Path, tmp_path: Path) -> Path:
    """The no-weights export with weights made by `dsv4 weights random` (the GPU-host flow), in a copy."""
    import shutil

    from dsv4.cli import main

    d = tmp_path / "wo"
    shutil.copytree(noweights_export, d, ignore=shutil.ignore_patterns("*.mlir"))
    assert main(["weights", "random", str(d), "--seed", "5"]) == 0
    return d


def test_weight_only_export_equals_eager_to_fp32_rounding(weight_only_export: Path, tmp_path: Path) -> None:
    """Issue 11's check in its continuous form: with no rounding to FP8/FP4 left in the model, the
    compiled module and eager torch (`dsv4 audit`, whose eager side runs the alternatives the export
    chose, on the weights `dsv4 weights random` wrote, drawn again) agree to fp32 summation order at
    every step, so greedy decoding is the same; every weight equal, no layer divergent."""
    from dsv4.bench.audit import run_audit

    raw = json.loads((weight_only_export / "config.json").read_text())
    chosen = raw["targets"]["llvm-cpu"]["kernels"]
    assert {op for op, impl in chosen.items() if impl == "weight_only"} == {
        "fp8_block_linear", "mxfp4_linear", "fp8_block_linear_stacked", "fp8_block_linear_shared",
        "mxfp4_linear_stacked"}
    prompt = np.random.default_rng(0).integers(2, 512, size=40).tolist()
    rep = run_audit(weight_only_export, prompt_ids=prompt, steps=12, work_dir=tmp_path)
    assert rep.consistent and rep.greedy_agree == "13/13" and rep.weights_mismatch == [], rep.table()
    assert rep.logits.error < 1e-5, rep.table()
