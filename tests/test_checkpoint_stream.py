"""A release checkpoint streamed into .irpa shards (dsv4.model.checkpoint.irpa.checkpoint_tensors):
the streamed tensors equal load_checkpoint's bit for bit, in both FP8 flavours and for the first N
layers; shards written from the stream load back; problems are named before the first tensor."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4.contract.weights import write_shards


# ------------------------------------------------------------------------------------------------
# the tiny preset as a release checkpoint
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The tiny preset as a release checkpoint (FP8 linears + E8M0 scales, MXFP4 experts), split
    into several safetensors shards so units read across files."""
    import torch

    from dsv4.model.checkpoint import write_checkpoint
    from dsv4.model.config import ModelConfig
    from dsv4.model.model import Transformer, init_random

    cfg = ModelConfig.preset("tiny")
    d = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(init_random(Transformer(cfg, dtype=torch.float32), seed=2), cfg, d, max_shard_bytes=200_000)
    assert len(list(d.glob("*.safetensors"))) > 3
    return d


def _bits(t) -> bytes:
    import torch

    return t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def test_checkpoint_tensors_equal_load_checkpoint_bitwise(tiny_ckpt: Path) -> None:
    """Streaming gives exactly the tensors load_checkpoint puts in the model, in param_inventory
    order (so a streamed export and `dsv4 weights random` cut the same shards), from a meta model."""
    import torch

    from dsv4.model.checkpoint import checkpoint_tensors, load_checkpoint, param_inventory
    from dsv4.model.model import Transformer

    model = load_checkpoint(tiny_ckpt)
    with torch.device("meta"):
        empty = Transformer(model.cfg, dtype=model.dtype, quantized=True)
    got = list(checkpoint_tensors(tiny_ckpt, empty))
    assert [[n, list(a.shape), dt] for n, a, dt in got] == [s.to_json() for s in param_inventory(model)]
    want = model.state_dict()
    for n, a, dt in got:
        assert a.tobytes() == _bits(want[n.removeprefix("model.")]), n
    assert {dt for _, _, dt in got} == {"bfloat16", "float32", "float8_e4m3fn", "uint8", "int64"}


def test_checkpoint_tensors_fnuz_and_first_layers(tiny_ckpt: Path) -> None:
    """The e4m3fnuz flavour is formats.fp8_fn_to_fnuz of each FP8 weight and its scale (everything
    else byte for byte); a model of the first 2 layers (+ MTP) takes just those layers."""
    import torch

    from dsv4.model.checkpoint import checkpoint_tensors, load_checkpoint
    from dsv4.model.quant.formats import fp8_fn_to_fnuz
    from dsv4.model.model import Transformer

    model = load_checkpoint(tiny_ckpt)
    want = model.state_dict()
    fnuz = {n.removeprefix("model."): (a, dt) for n, a, dt in checkpoint_tensors(tiny_ckpt, model, "float8_e4m3fnuz")}
    converted = 0
    for n, t in want.items():
        a, dt = fnuz[n]
        if t.dtype == torch.float8_e4m3fn:
            scale = n.removesuffix("weight") + "scale"
            w2, s2 = fp8_fn_to_fnuz(t, want[scale])
            assert dt == "float8_e4m3fnuz" and a.tobytes() == _bits(w2) and fnuz[scale][0].tobytes() == _bits(s2)
            converted += 1
        elif not n.endswith(".scale"):
            assert dt == fnuz[n][1] and a.tobytes() == _bits(t), n
    assert converted > 20

    cfg2 = model.cfg.replace(num_hidden_layers=2, compress_ratios=model.cfg.compress_ratios[:2] + model.cfg.compress_ratios[-1:])
    with torch.device("meta"):
        two = Transformer(cfg2, dtype=model.dtype, quantized=True)
    got = {n.removeprefix("model."): a for n, a, _ in checkpoint_tensors(tiny_ckpt, two)}
    assert got.keys() == two.state_dict().keys() and not any(k.startswith(("layers.2.", "layers.3.")) for k in got)
    assert all(got[k].tobytes() == _bits(want[k]) for k in got)  # mtp.0 included, layers 0-1


def test_checkpoint_streamed_into_shards_loads_back(tiny_ckpt: Path, tmp_path: Path) -> None:
    """checkpoint_tensors -> write_shards -> load_irpa gives load_checkpoint's model."""
    import torch

    from dsv4.model.checkpoint import checkpoint_tensors, load_checkpoint, load_irpa
    from dsv4.model.model import Transformer

    model = load_checkpoint(tiny_ckpt)
    files = write_shards(tmp_path, checkpoint_tensors(tiny_ckpt, model), shard_bytes=100_000)
    assert len(files) > 3
    back = load_irpa(Transformer(model.cfg, dtype=model.dtype, quantized=True), [tmp_path / f for f in files])
    assert all(_bits(a) == _bits(b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))


def test_checkpoint_tensors_problems_before_the_first_tensor(tiny_ckpt: Path, tmp_path: Path) -> None:
    import torch

    from dsv4.model.checkpoint import CheckpointError, checkpoint_tensors, load_checkpoint
    from dsv4.model.model import Transformer

    cfg = load_checkpoint(tiny_ckpt).cfg
    with torch.device("meta"):
        wide = Transformer(cfg.replace(moe_intermediate_size=256), quantized=True)
    with pytest.raises(CheckpointError, match=r"shape: layers.0.ffn.shared_experts.w1.weight is F8_E4M3 \[128, 128\]"):
        write_shards(tmp_path, checkpoint_tensors(tiny_ckpt, wide))
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a partial shard
    with pytest.raises(ValueError, match="fp8_dtype must be one of"):
        next(checkpoint_tensors(tiny_ckpt, wide, "float8_e5m2"))
