"""`dsv4 audit` (bench/audit.py): the weights comparison and the verdict against independent references
(fast), the layer-local eager runner against the model's own forward (fast), and end to end on an
export of the tiny preset's first two layers (slow): clean, a checkpoint with one tensor changed,
a deliberately wrong kernel."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dsv4.bench import audit
from dsv4.bench.audit import PartVerdict, choice_disagreement, compare_weights, value_error, verdict
from dsv4.contract.random_weights import weight_of_scale
from dsv4.model.quant import formats

REPO = Path(__file__).resolve().parents[1]


# ---- weights ------------------------------------------------------------------------------------


def _reference_state() -> dict[str, torch.Tensor]:
    """A few tensors in the release formats: an FP8 linear (2x2 grid of 128x128 blocks, E8M0 scales),
    stacked MXFP4 experts, bf16, f32 and int64."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=g) * 0.05
    codes = torch.randn(256, 384, generator=g).clamp(-400, 400).to(torch.float8_e4m3fn)
    scale = torch.randint(120, 130, (2, 3), dtype=torch.uint8, generator=g)
    packed = torch.randint(0, 256, (3, 64, 32), dtype=torch.uint8, generator=g)
    escale = torch.randint(118, 128, (3, 64, 2), dtype=torch.uint8, generator=g)
    del w
    return {"lin.weight": codes, "lin.scale": scale, "experts.w1": packed, "experts.w1_scale": escale,
            "norm.weight": torch.randn(64, generator=g).to(torch.bfloat16),
            "hc_fn": torch.randn(4, 8, generator=g), "tid2eid": torch.randint(0, 8, (16, 2), generator=g)}


def _arrays(state: dict[str, torch.Tensor], fp8: str = "float8_e4m3fn") -> dict[str, tuple[np.ndarray, str]]:
    from dsv4.model.checkpoint.irpa import archive_tensors

    return {k: (a, dt) for k, a, dt in archive_tensors({k: v.clone() for k, v in state.items()}, fp8)}


def test_decoded_pairs_equal_the_model_formats_dequantization() -> None:
    """The audit's numpy decoding of an FP8 block pair and an MXFP4 pair equals formats.dequant_fp8_block
    and formats.dequant_mxfp4 (torch, the kernels' reference), e4m3fnuz included."""
    s = _reference_state()
    for fp8 in ("float8_e4m3fn", "float8_e4m3fnuz"):
        a = _arrays(s, fp8)
        _, _, lin = audit._pair_values(*a["lin.weight"], *a["lin.scale"])
        np.testing.assert_array_equal(lin, formats.dequant_fp8_block(s["lin.weight"], s["lin.scale"]).double().numpy())
    _, _, ex = audit._pair_values(*_arrays(s)["experts.w1"], *_arrays(s)["experts.w1_scale"])
    np.testing.assert_array_equal(ex, formats.dequant_mxfp4(s["experts.w1"], s["experts.w1_scale"]).double().numpy())


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e4m3fnuz"])
def test_weights_equal_in_either_fp8_format(fp8: str) -> None:
    s = _reference_state()
    bad, n = compare_weights(_arrays(s, fp8), _arrays(s), weight_of_scale)
    assert bad == [] and n == len(s)


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e4m3fnuz"])
@pytest.mark.parametrize("name, change, index", [
    ("lin.weight", lambda t: (t.view(torch.uint8) ^ 0x80).view(t.dtype), []),  # every code's sign
    ("lin.scale", lambda t: t + 1, []),  # every block twice as large
    ("experts.w1", lambda t: torch.cat([t[:1], t[1:2] ^ 0x08, t[2:]]), [1]),  # one expert's nibble signs
    ("norm.weight", lambda t: t * 2, []),
    ("hc_fn", lambda t: t.index_put((torch.tensor([1]), torch.tensor([2])), torch.tensor(9.0)), []),
    ("tid2eid", lambda t: (t + 1) % 8, []),
])
def test_one_changed_tensor_is_named(fp8: str, name: str, change, index: list[int]) -> None:
    """The archive as exported (e4m3fn or e4m3fnuz, whose codes read half and scales twice as large)
    against a reference with one tensor changed: exactly that tensor is named, with the dequantized
    values' largest difference computed here independently."""
    s = _reference_state()
    changed = dict(s, **{name: change(s[name].clone())})
    bad, _ = compare_weights(_arrays(s, fp8), _arrays(changed), weight_of_scale)
    assert [m.name for m in bad] == [name] and bad[0].problem == "values" and bad[0].index == index
    owner = weight_of_scale(name) or name
    if owner == "lin.weight":
        want = (formats.dequant_fp8_block(s["lin.weight"], s["lin.scale"])
                - formats.dequant_fp8_block(changed["lin.weight"], changed["lin.scale"])).abs().max().item()
    elif owner == "experts.w1":
        want = (formats.dequant_mxfp4(s["experts.w1"], s["experts.w1_scale"])
                - formats.dequant_mxfp4(changed["experts.w1"], changed["experts.w1_scale"])).abs().max().item()
    else:
        want = (s[name].double() - changed[name].double()).abs().max().item()
    assert bad[0].max_abs == pytest.approx(want, rel=1e-12)


def test_missing_extra_and_reshaped_tensors_are_named() -> None:
    s = _reference_state()
    archive = _arrays(s)
    archive["stray"] = archive.pop("norm.weight")
    archive["hc_fn"] = (archive["hc_fn"][0].reshape(8, 4), "float32")
    bad, _ = compare_weights(archive, _arrays(s), weight_of_scale)
    assert sorted((m.name, m.problem) for m in bad) == [("hc_fn", "shape"), ("norm.weight", "missing"),
                                                         ("stray", "extra")]


def test_nan_equals_nan_and_e8m0_nan_byte() -> None:
    """An NaN in both (a NaN E8M0 byte 0xFF, a NaN float) is equal; NaN against a number is not."""
    s = _reference_state()
    s["hc_fn"][0, 0] = float("nan")
    s["lin.scale"][0, 0] = 0xFF
    assert compare_weights(_arrays(s), _arrays(s), weight_of_scale)[0] == []
    other = dict(s, hc_fn=s["hc_fn"].nan_to_num(0.0))
    assert [m.name for m in compare_weights(_arrays(s), _arrays(other), weight_of_scale)[0]] == ["hc_fn"]


# ---- the yardstick and the verdict ---------------------------------------------------------------


def test_pooled_errors_match_the_formula() -> None:
    """A value part pools its calls: ||c - e|| / ||e|| over all calls' values together (float64 here)."""
    g = np.random.default_rng(0)
    e = [g.normal(size=(3, 5)), g.normal(size=(1, 5))]
    c = [x + g.normal(scale=0.01, size=x.shape) for x in e]
    w = [x + g.normal(scale=0.02, size=x.shape) for x in e]
    p = PartVerdict()
    for ci, ei, wi in zip(c, e, w):
        p.add(ci.astype(np.float32), ei, wi)
    cat = lambda xs: np.concatenate([x.reshape(-1) for x in xs])  # noqa: E731
    assert p.error == pytest.approx(np.linalg.norm(cat(c).astype(np.float32) - cat(e)) / np.linalg.norm(cat(e)), rel=1e-12)
    assert p.noise == pytest.approx(np.linalg.norm(cat(w) - cat(e)) / np.linalg.norm(cat(e)), rel=1e-12)
    assert value_error(c[0], e[0]) == pytest.approx(np.linalg.norm(c[0] - e[0]) / np.linalg.norm(e[0]))
    bad = PartVerdict()
    bad.add(np.full((2, 2), np.nan), np.ones((2, 2)), np.ones((2, 2)))
    assert bad.error == float("inf")


def test_choice_disagreement_counts_missed_choices() -> None:
    ref = np.array([[[3, 1, -1], [0, 2, 5], [-1, -1, -1]]])  # row 2 has no choices
    got = np.array([[[1, 3, -1], [0, 7, 6], [4, 4, 4]]])
    # row 0: all made; row 1: 1 of 3 made
    assert choice_disagreement(got, ref) == pytest.approx((0 + 2 / 3) / 2)
    p = PartVerdict(choice=True)
    p.add(got, ref, ref)
    p.add(ref, ref, got)  # a second call: the compiled side agrees, the wide side does not
    assert p.error == pytest.approx((2 / 3) / 4) and p.noise == pytest.approx((2 / 3) / 4)


def _part(error: float, noise: float, choice: bool = False) -> PartVerdict:
    p = PartVerdict(choice=choice)
    if choice:
        p._err, p._noise, p._den = error, noise, 1.0
    else:
        p._err, p._noise, p._den = error ** 2, noise ** 2, 1.0
    return p


def test_verdict_names_the_first_layer_and_its_first_part() -> None:
    f = audit.NOISE_FACTOR
    order = ("hc_attn", "indexer", "attn", "hc_ffn", "router", "moe", "out")
    parts = {"0.attn": _part(0.01, 0.02), "0.moe": _part(0.05, 0.05),
             "1.attn": _part(0.3, 0.3 / f * 0.99),  # just above the factor
             "1.indexer": _part(0.5, 0.1, choice=True),  # earlier in the layer than attn
             "2.hc_attn": _part(1.0, 0.01),
             "1.router": _part(0.2, 0.0, choice=True),  # below CHOICE_FLOOR: a few flipped near ties
             "head": _part(1.0, 0.0)}
    assert verdict(parts, 2.0 ** -8, order) == (1, "indexer")
    assert parts["1.attn"].divergent and not parts["0.moe"].divergent and not parts["1.router"].divergent
    assert parts["head"].divergent  # judged, but not a layer
    # below the dtype's rounding nothing diverges, however small the noise
    quiet = {"0.attn": _part(2.0 ** -10, 0.0)}
    assert verdict(quiet, 2.0 ** -8, order) == (None, None)


def test_prompt_chunks_respect_the_exported_range() -> None:
    ids = list(range(150))
    chunks = audit._chunks(ids, 16, 64)
    assert [len(c) for c, _ in chunks] == [64, 64, 22] and [p for _, p in chunks] == [0, 64, 128]
    assert sum((c for c, _ in chunks), []) == ids
    chunks = audit._chunks(list(range(70)), 16, 64)  # 64 + 6 would leave a piece below 16
    assert [len(c) for c, _ in chunks] == [54, 16]


# ---- the eager runner --------------------------------------------------------------------------------


def test_taps_and_the_layer_local_runner_reproduce_the_forward() -> None:
    """record_taps collects tap_names' values, the last block's output is the model's own hidden
    streams, and running each block on the recorded input to it (what the audit feeds the compiled
    side's streams to) gives the same values and logits bit for bit."""
    from dsv4.model.config import ModelConfig
    from dsv4.model.model import Transformer, init_random
    from dsv4.model.state import new_state
    from dsv4.model.taps import record_taps, tap_names

    cfg = ModelConfig.preset("tiny").first_layers(2)
    model = init_random(Transformer(cfg, dtype=torch.float32), seed=1).eval()

    class Exp:
        n_slots = 1

    ids = torch.randint(0, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    z = torch.zeros(1, dtype=torch.int64)
    with torch.no_grad(), record_taps(model) as taps:
        h = model.hidden(ids, z, z + 24, z, new_state(cfg, 1, torch.float32))
    assert list(taps) == tap_names(cfg) == ["0.hc_attn", "0.attn", "0.hc_ffn", "0.router", "0.moe", "0.out",
                                             "1.hc_attn", "1.indexer", "1.attn", "1.hc_ffn", "1.router", "1.moe",
                                             "1.out"]
    assert torch.equal(taps["1.out"], h)
    with torch.no_grad():
        logits = model.logits(h, z + 24, False)
    runner = audit._Eager(model, Exp, {}, "cpu")
    inputs = [None, taps["0.out"].numpy(), taps["1.out"].numpy()]
    got_logits, got = runner.layers(ids[0].tolist(), 0, inputs)
    assert got.keys() == taps.keys()
    for k, v in taps.items():
        np.testing.assert_array_equal(got[k], v.double().numpy() if v.is_floating_point() else v.numpy(), err_msg=k)
    np.testing.assert_array_equal(got_logits, logits[0].double().numpy())


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    from dsv4.cli import main

    assert main(["audit", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not an export directory" in err[0]
    assert main(["audit", str(tmp_path), "--steps", "-1"]) == 2


# ---- end to end (slow) ----------------------------------------------------------------------------------

LAYERS = 2  # the tiny preset's layers 0 (sliding window, hash routing) and 1 (CSA: indexer, compressor)
PROMPT = np.random.default_rng(3).integers(2, 512, size=48).tolist()
STEPS = 2


def _checkpoint() -> Path:
    """The tiny preset's random checkpoint (seed 0), made once under .cache/ (the exports record its path)."""
    from dsv4.model.checkpoint import make_random_checkpoint

    d = REPO / ".cache" / "audit-tiny-checkpoint"
    if not (d / "config.json").is_file():
        tmp = d.with_name(d.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        make_random_checkpoint("tiny", tmp, seed=0)
        tmp.rename(d)
    return d


@pytest.fixture(scope="module")
def audited_export() -> Path:
    """`dsv4 export --checkpoint <tiny> --layers 2 --target llvm-cpu --batch-sizes 1 --no-score`."""
    from conftest import cached_export

    from dsv4.cli import main

    ck = _checkpoint()
    argv = ["--layers", str(LAYERS), "--target", "llvm-cpu", "--batch-sizes", "1", "--no-score", "--max-chunk", "64"]

    def build(out: Path) -> None:
        assert main(["export", "--checkpoint", str(ck), *argv, "-o", str(out), "--force"]) == 0

    return cached_export("audit-tiny2", build, [*sorted(ck.glob("*")), argv])


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("audit-probe")


def _changed_checkpoint(dst: Path, name: str, change) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(_checkpoint(), dst)
    f = dst / "model.safetensors"
    tensors = load_file(f)
    tensors[name] = change(tensors[name]).contiguous()
    save_file(tensors, f, metadata={"format": "pt"})
    return dst


@pytest.mark.slow
def test_clean_export_is_consistent(audited_export: Path, probe_dir: Path, capsys) -> None:
    """The export against its own checkpoint (config.json's source): exit 0, every weight equal, no
    layer divergent; the last line is one JSON object."""
    from dsv4.cli import main

    rc = main(["audit", str(audited_export), "--prompt-ids", ",".join(map(str, PROMPT)), "--steps", str(STEPS),
               "--work-dir", str(probe_dir), "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    rep = json.loads(out[-1])
    assert rc == 0, "\n".join(out)
    assert rep["first_divergent_layer"] is None and rep["weights_mismatch"] == [] and rep["consistent"]
    assert rep["weights_compared"] > 100 and len(rep["layers"]) == LAYERS
    assert rep["reference"] == str(_checkpoint()) and rep["prompt_tokens"] == len(PROMPT)
    for layer in rep["layers"]:
        for part, v in layer["parts"].items():
            assert v["error"] <= audit.NOISE_FACTOR * v["noise"] or v["error"] <= 2.0 ** -8, (layer["layer"], part)


def _negate_fp8(t: torch.Tensor) -> torch.Tensor:
    return (t.view(torch.uint8) ^ 0x80).view(t.dtype)


@pytest.mark.slow
@pytest.mark.parametrize("tensor, change, where, named", [
    # one routed expert's MXFP4 nibbles change sign: only the tokens routed there, found in the MoE
    ("layers.0.ffn.experts.5.w2.weight", lambda t: t ^ 0x88, (0, "moe"), ("layers.0.ffn.experts.w2", [5])),
    ("layers.0.hc_ffn_base", lambda t: t + 2, (0, "hc_ffn"), ("layers.0.hc_ffn_base", [])),  # f32 mHC
    ("layers.1.attn.wo_b.weight", _negate_fp8, (1, "attn"), ("layers.1.attn.wo_b.weight", [])),  # FP8 codes
    ("layers.1.ffn.shared_experts.w2.weight", _negate_fp8, (1, "moe"), ("layers.1.ffn.shared_experts.w2.weight", [])),
])
def test_a_changed_tensor_names_its_layer_and_itself(audited_export: Path, probe_dir: Path, tmp_path: Path,
                                                     tensor: str, change, where, named) -> None:
    """The export against a copy of its checkpoint with one tensor changed: exit 1, the tensor named
    (a stacked tensor with the expert), and the first divergent layer and part are the tensor's."""
    ck = _changed_checkpoint(tmp_path / "ck", tensor, change)
    rep = audit.run_audit(audited_export, checkpoint=ck, prompt_ids=PROMPT, steps=STEPS, work_dir=probe_dir)
    assert not rep.consistent
    assert [(m.name, m.index) for m in rep.weights_mismatch] == [named]
    assert (rep.first_divergent_layer, rep.first_divergent_part) == where, rep.table()


@pytest.mark.slow
def test_a_change_the_activations_cannot_see_is_still_named(audited_export: Path, probe_dir: Path,
                                                            tmp_path: Path) -> None:
    """wq_a's block scale x2: q_norm right after it takes the factor out, so every activation is as
    before (no divergent layer), and the weights check alone names the scale."""
    ck = _changed_checkpoint(tmp_path / "ck", "layers.1.attn.wq_a.scale", lambda t: (t.view(torch.uint8) + 1).view(t.dtype))
    rep = audit.run_audit(audited_export, checkpoint=ck, prompt_ids=PROMPT, steps=STEPS, work_dir=probe_dir)
    assert [m.name for m in rep.weights_mismatch] == ["layers.1.attn.wq_a.scale"]
    assert rep.first_divergent_layer is None and not rep.consistent


@pytest.mark.slow
def test_a_wrong_kernel_is_located_to_its_layer_and_op(audited_export: Path, tmp_path: Path, monkeypatch) -> None:
    """A lowering of the indexer's scores that reads the keys shifted by one entry (an off-by-one),
    registered only here and compiled into the probe: the audit finds layer 1 (the first CSA layer;
    layer 0 has no indexer) and names the indexer's selection, with every weight equal."""
    from dsv4.model import kernels as mk

    k = mk.KERNELS["indexer_scores"]

    def shifted_keys(q, w, keys):
        return k.reference(q, w, keys.roll(1, dims=1))

    monkeypatch.setitem(mk.KERNELS, "indexer_scores",
                        dataclasses.replace(k, alternatives={**k.alternatives, "shifted_keys": shifted_keys}))
    rep = audit.run_audit(audited_export, prompt_ids=PROMPT, steps=STEPS, work_dir=tmp_path,
                          probe_kernels={"indexer_scores": "shifted_keys"})
    assert rep.weights_mismatch == [], rep.table()
    assert (rep.first_divergent_layer, rep.first_divergent_part) == (1, "indexer"), rep.table()
