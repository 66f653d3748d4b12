"""MXFP4 routed experts re-encoded as FP8 (`load_checkpoint(expert_dtype="fp8")`, `dsv4 export
--expert-dtype fp8`): the weights keep their values exactly (formats.mxfp4_to_fp8, strict), so the
model computes the same function (both expert forms quantize the activation to e4m3 per 128-block and
dequantize the weight exactly; only fp32 summation order differs), and a block that cannot be
re-encoded exactly is refused by name. The re-encoded llvm-cpu export runs against the export of the
checkpoint as stored."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dsv4.model.checkpoint import CheckpointError, checkpoint_tensors, load_checkpoint
from dsv4.model.checkpoint.write import write_checkpoint
from dsv4.model.config import ModelConfig
from dsv4.model.quant.formats import dequant_fp8_block, dequant_mxfp4
from dsv4.model.model import Transformer, init_random
from dsv4.model.state import new_state


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    cfg = ModelConfig.preset("tiny").replace(quant_sim=False)
    out = tmp_path_factory.mktemp("fp8x") / "ck"
    write_checkpoint(init_random(Transformer(cfg, dtype=torch.float32), seed=3), cfg, out, "official")
    return out


def _experts(model: Transformer):
    return [layer.ffn.experts for layer in [*model.layers, *model.mtp]]


def test_mxfp4_experts_load_as_fp8_with_the_same_values(ckpt: Path) -> None:
    fp4 = load_checkpoint(ckpt, dtype=torch.float32)
    fp8 = load_checkpoint(ckpt, dtype=torch.float32, expert_dtype="fp8")
    assert fp4.cfg.expert_dtype == "fp4" and fp8.cfg.expert_dtype == "fp8"
    n = 0
    for a, b in zip(_experts(fp4), _experts(fp8)):
        for w in ("w1", "w2", "w3"):
            pa, pb = getattr(a, w), getattr(b, w)
            assert pa.dtype == torch.uint8 and pb.dtype == torch.float8_e4m3fn
            for e in range(pa.shape[0]):
                want = dequant_mxfp4(pa[e], getattr(a, f"{w}_scale")[e]).double()
                got = dequant_fp8_block(pb[e], getattr(b, f"{w}_scale")[e]).double()
                assert torch.equal(got, want), f"{w}[{e}]"
                n += 1
    assert n == 3 * fp4.cfg.n_routed_experts * (fp4.cfg.n_layers + fp4.cfg.n_mtp)
    # the streamed form an export writes holds the same bytes as the loaded model
    streamed = {k: (a, dt) for k, a, dt in checkpoint_tensors(ckpt, fp8, prefix="")}
    arr, dt = streamed["layers.1.ffn.experts.w2"]
    assert dt == "float8_e4m3fn" and np.array_equal(arr, fp8.layers[1].ffn.experts.w2.view(torch.uint8).numpy())
    # same function: logits within fp32 summation order of each other
    tokens = torch.randint(3, fp4.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    args = (tokens, torch.zeros(1, dtype=torch.int64), torch.tensor([24]), torch.zeros(1, dtype=torch.int64))
    with torch.no_grad():
        la = fp4(*args, new_state(fp4.cfg, 1, torch.float32))
        lb = fp8(*args, new_state(fp8.cfg, 1, torch.float32))
    torch.testing.assert_close(lb, la, atol=1e-5, rtol=1e-5)


def test_a_block_that_would_round_is_refused(ckpt: Path, tmp_path: Path) -> None:
    model = load_checkpoint(ckpt, dtype=torch.float32)
    ex = model.layers[1].ffn.experts
    with torch.no_grad():
        # expert 2's w3, first 128x128 block: one 32-group scaled 2^8, another 2^-12 holding the
        # smallest code (0.5): 0.5 * 2^-12 is 2^-13 of the block scale 2^(8-6), below e4m3fn's 2^-9
        ex.w3_scale[2, 0, 0], ex.w3_scale[2, 1, 0] = 127 + 8, 127 - 12
        ex.w3[2, 1, :16] = 0x11
    write_checkpoint(model, model.cfg, tmp_path / "bad", "official")
    load_checkpoint(tmp_path / "bad")  # as MXFP4 it is a valid checkpoint
    with pytest.raises(CheckpointError, match=r"layers\.1\.ffn\.experts\.2\.w3\.weight cannot be re-encoded"):
        load_checkpoint(tmp_path / "bad", expert_dtype="fp8")
    with pytest.raises(ValueError, match="only 'fp8'"):
        load_checkpoint(ckpt, expert_dtype="bf16")


def _run_export(out: Path, steps: int = 4) -> list[np.ndarray]:
    """Logits of a 40-token prefill and `steps` greedy decode steps of one llvm-cpu export."""
    from dsv4.contract.artifact import ExportConfig
    from dsv4.runtime.module import IreeModule, ensure_runtime_flags

    ensure_runtime_flags()
    cfg = ExportConfig.load(out)
    mod = IreeModule(out / "model.llvm-cpu.vmfb", [out / f for f in json.loads((out / "config.json").read_text())["parameters"]])
    dev = [mod.zeros(s) for s in cfg.state]
    tokens = np.random.default_rng(1).integers(3, cfg.model["vocab_size"], (1, 40), dtype=np.int64)
    one, slot = np.ones(1, np.int64), np.zeros(1, np.int64)
    outs = [np.array(mod("prefill_bs1", tokens, slot, np.array([40]), slot, *dev)[0])]
    for s in range(steps):
        tok = np.array([[int(outs[-1].argmax(-1)[0])]])
        outs.append(np.array(mod("decode_bs1", tok, np.array([40 + s]), one, slot, *dev)[0]))
    return outs


def test_export_with_fp8_experts_computes_what_the_mxfp4_export_does(ckpt: Path, tmp_path: Path) -> None:
    """The re-encoded export against the export of the checkpoint as stored (itself held to eager by
    tests/test_embedded.py and tests/test_export_model.py): the same logits up to fp32 summation order
    (llvm-cpu gave them bit for bit: both expert kernels decode the weight exactly and sum in f32)."""
    from dsv4.cli import main

    base = ["export", "--checkpoint", str(ckpt), "--target", "llvm-cpu", "--dtype", "fp32", "--batch-sizes", "1",
            "--no-score"]
    assert main([*base, "-o", str(tmp_path / "fp4")]) == 0
    assert main([*base, "--expert-dtype", "fp8", "-o", str(tmp_path / "fp8")]) == 0
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert cfg["model"]["expert_dtype"] == "fp8"
    assert {t[2] for t in cfg["weights"]["tensors"] if ".experts.w" in t[0] and "scale" not in t[0]} == {"float8_e4m3fn"}
    for k, (a, b) in enumerate(zip(_run_export(tmp_path / "fp4"), _run_export(tmp_path / "fp8"))):
        np.testing.assert_allclose(b, a, atol=1e-5 * float(np.abs(a).max()), rtol=0, err_msg=f"call {k}")
