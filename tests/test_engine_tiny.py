"""The Engine end to end on the real tiny DeepSeek-V4 preset, exported through
``dsv4.export.exporter.export_model`` (slow; cached by tests/conftest.py): compiled greedy == eager
``dsv4.model.generate.greedy``, batching, sampling on the device, scoring, errors."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dsv4.runtime import ArtifactError, EngineError, ExportConfig, RequestError, SamplingParams
from conftest import NO_TORCH_PRELUDE, TINY_FP32_ARGS, TINY_FP32_SEED, cached_export, tiny_fp32_cfg, tiny_fp32_model

REPO = Path(__file__).resolve().parents[1]
# the eager references: torch's two threads on a busy 2-core box made the greedy reference take 93 s
# instead of 5 s
pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------
# the real model: tiny preset (random weights, fp32) through dsv4.export.exporter, llvm-cpu: conftest's
# tiny_fp32_export (prefill and decode bs 1 and 4, so requests admitted together prefill in one call)
# ------------------------------------------------------------------------------------------------

TINY_SLOTS = TINY_FP32_ARGS["n_slots"]  # 4
TINY_CHUNK = TINY_FP32_ARGS["max_chunk"]  # 32: small prefill chunk so long prompts take several calls
TINY_NEW = 64


def _tiny_model():
    model = tiny_fp32_model()
    return model.cfg, model


@pytest.fixture(scope="session")
def tiny_export(tiny_fp32_export: Path) -> Path:
    """The tiny preset exported for llvm-cpu (minutes on 2 cores, so cached under .cache/ by
    tests/conftest.py). The exporter is imported, not import-skipped: a broken exporter must fail these tests."""
    return tiny_fp32_export


@pytest.fixture(scope="session")
def tiny_eager():
    return _tiny_model()[1]


@pytest.fixture(scope="session")
def tiny_engine(tiny_export: Path):
    from dsv4.runtime.engine import Engine

    return Engine(tiny_export)


TINY_PROMPTS = [
    [0, 17, 42, 7, 99, 3, 256, 12],
    [0] + [(31 * i + 5) % 500 + 2 for i in range(40)],  # two prefill chunks
    [0, 5],
    [0] + [(7 * i + 1) % 480 + 3 for i in range(70)],  # three chunks
    [0, 400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411, 412, 413, 414, 415, 416, 417],
]


@pytest.fixture(scope="module")  # module scope: after the module's one_thread
def tiny_reference(tiny_eager) -> list[list[int]]:
    """Eager greedy. The model's top-k breaks exact ties by the lowest index in eager and export
    alike (model/kernels/topk.py); with torch.topk's unspecified tie order a tied indexer/router
    score of the random weights flipped the token stream within 64 steps (prompt 5, step 15)."""
    from dsv4.model.generate import greedy

    return [greedy(tiny_eager, p, TINY_NEW, chunk=TINY_CHUNK) for p in TINY_PROMPTS]


def test_tiny_export_abi(tiny_engine) -> None:
    c = tiny_engine.config
    assert c.prefill_max_tokens == TINY_CHUNK and c.n_slots == TINY_SLOTS
    assert tiny_engine.module_export_id == c.export_id  # the vmfb's baked-in id was read and matched


def test_tiny_greedy_matches_eager(tiny_engine, tiny_reference) -> None:
    for p, ref in zip(TINY_PROMPTS, tiny_reference):
        got = tiny_engine.generate(p, max_new_tokens=TINY_NEW, ignore_eos=True)
        assert got.tokens == ref, f"prompt of {len(p)} tokens"


@pytest.fixture(scope="module")
def tiny_static_engine():
    """The tiny preset exported with --static-prefill (prefill_bs1/bs4 of exactly TINY_CHUNK tokens a row)."""
    from dsv4.export.exporter import ExportSpec, export_model
    from dsv4.runtime.engine import Engine

    args = dict(TINY_FP32_ARGS, targets=("llvm-cpu",), probe_topk=False, keep_mlir=False, static_prefill=True)

    def build(out: Path) -> None:
        export_model(tiny_fp32_model(), ExportSpec(**args), out, progress=print)

    return Engine(cached_export("tiny-fp32-static", build, [tiny_fp32_cfg().to_dict(), TINY_FP32_SEED,
                                                             sorted(args.items())]))


def test_static_prefill_matches_eager(tiny_static_engine, tiny_reference) -> None:
    """A --static-prefill export: every chunk padded to the one exported length (prompts of 2 to 71 tokens:
    shorter than a chunk, one chunk and a part, three chunks), batched too, greedy equal to eager."""
    c = tiny_static_engine.config
    assert c.prefill_min_tokens == c.prefill_max_tokens == TINY_CHUNK
    for p, ref in zip(TINY_PROMPTS, tiny_reference):
        assert tiny_static_engine.generate(p, max_new_tokens=TINY_NEW, ignore_eos=True).tokens == ref, len(p)
    res = tiny_static_engine.generate_batch(TINY_PROMPTS[:4], [SamplingParams(max_new_tokens=12, ignore_eos=True)] * 4)
    assert [r.tokens for r in res] == [ref[:12] for ref in tiny_reference[:4]]


def test_tiny_batched_matches_eager(tiny_engine, tiny_reference) -> None:
    """Five prompts of different lengths on four slots: batched decode (padded bs4 calls), a queued
    request joining when a slot frees up, and every sequence equal to eager greedy."""
    lens = [TINY_NEW, 20, TINY_NEW, 33, 50]
    res = tiny_engine.generate_batch(TINY_PROMPTS, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lens])
    for r, ref, n in zip(res, tiny_reference, lens):
        assert r.tokens == ref[:n]
    assert tiny_engine.slots.n_free == TINY_SLOTS


def test_tiny_sampling_seeds(tiny_engine) -> None:
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.95, seed=42, ignore_eos=True)
    a = tiny_engine.generate(TINY_PROMPTS[0], sp)
    assert tiny_engine.generate(TINY_PROMPTS[0], sp).tokens == a.tokens
    assert tiny_engine.generate(TINY_PROMPTS[0], replace(sp, seed=43)).tokens != a.tokens
    res = tiny_engine.generate_batch([TINY_PROMPTS[1], TINY_PROMPTS[0], TINY_PROMPTS[2]],
                                     [replace(sp, seed=1), sp, SamplingParams(max_new_tokens=5, ignore_eos=True)])
    assert res[1].tokens == a.tokens


def test_tiny_sample_function_equals_torch(tiny_engine) -> None:
    """sample_bs{N} compiled (model/device_sampling.py) picks the ids the torch function picks."""
    import torch

    from dsv4.model.device_sampling import sample

    v = tiny_engine.config.model["vocab_size"]
    g = np.random.default_rng(1)
    for n in (1, 4):
        fn = tiny_engine.module.function(f"sample_bs{n}")
        for _ in range(6):
            a = ((g.standard_normal((n, v)) * 3).astype(np.float32), g.choice([0.0, 0.8, 1.3], n).astype(np.float32),
                 g.choice([0, 1, 7, 100], n), g.choice([1.0, 0.9, 0.5], n).astype(np.float32),
                 g.integers(0, 2**32, n))
            got = np.asarray(fn(*a).to_host()).reshape(-1)
            assert got.tolist() == sample(*(torch.as_tensor(x) for x in a)).tolist()


def test_tiny_device_sampled_tokens_match_an_eager_replay(tiny_engine, tiny_eager) -> None:
    """The engine's device-sampled stream equals an eager loop that takes the same per-token keys
    from the request's seed and samples with the float64 reference."""
    import torch
    from test_device_sampling import ref_sample

    from dsv4.model.state import new_state

    sp = SamplingParams(max_new_tokens=20, temperature=0.9, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
    before = tiny_engine.stats["device_samples"]
    got = tiny_engine.generate(TINY_PROMPTS[1], sp).tokens
    assert tiny_engine.stats["device_samples"] - before == 20  # every token chosen on the device

    rng = np.random.Generator(np.random.PCG64(7))
    cfg = tiny_eager.cfg
    state = new_state(cfg, 1, tiny_eager.dtype)
    one = lambda v: torch.tensor([v])
    prompt = TINY_PROMPTS[1]
    with torch.no_grad():
        for s in range(0, len(prompt), TINY_CHUNK):
            piece = prompt[s:s + TINY_CHUNK]
            logits = tiny_eager(torch.tensor([piece]), one(s), one(len(piece)), one(0), state)
        ref, pos = [], len(prompt)
        for _ in range(20):
            ref.append(ref_sample(logits[0].numpy(), 0.9, 50, 0.9, int(rng.integers(0, 2**32))))
            logits = tiny_eager(torch.tensor([[ref[-1]]]), one(pos), one(1), one(0), state)
            pos += 1
    assert got == ref


def test_tiny_nonfinite_logits_are_an_error(tiny_export: Path, tmp_path: Path) -> None:
    """A NaN in the weights (the final norm) makes every row's logits NaN: the step marks the rows
    (argmax -1) and the engine raises, greedy and device-sampled alike, instead of emitting a token."""
    import shutil

    from dsv4.runtime.engine import Engine
    from dsv4.contract.weights import open_weights, write_shards

    d = tmp_path / "nan"
    shutil.copytree(tiny_export, d)
    cfg = ExportConfig.load(d)
    w = open_weights([d / p for p in cfg.raw["parameters"]])
    tensors = []
    for key, _, dtype in cfg.raw["weights"]["tensors"]:
        a = np.array(w.tensor(key))
        if key == "model.norm.weight":
            a[0] = np.nan
        tensors.append((key, a, dtype))
    del w
    write_shards(d, iter(tensors))
    eng = Engine(d)
    for sp in (SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=4, temperature=0.8, seed=1)):
        with pytest.raises(EngineError, match="non-finite logits"):
            eng.generate(TINY_PROMPTS[0], sp)


def test_tiny_slot_reuse_leaks_nothing(tiny_engine, tiny_reference) -> None:
    tiny_engine.generate_batch([TINY_PROMPTS[3]] * TINY_SLOTS, SamplingParams(max_new_tokens=40, ignore_eos=True))
    for i in (2, 0):
        assert tiny_engine.generate(TINY_PROMPTS[i], max_new_tokens=TINY_NEW, ignore_eos=True).tokens == \
            tiny_reference[i]


def test_tiny_score_matches_eager(tiny_engine, tiny_eager) -> None:
    import torch

    from dsv4.model.state import new_state

    ids = TINY_PROMPTS[1][:TINY_CHUNK]
    with torch.no_grad():
        st = new_state(tiny_eager.cfg, 1, torch.float32)
        lg = tiny_eager(torch.tensor([ids]), torch.tensor([0]), torch.tensor([len(ids)]), torch.tensor([0]), st,
                        all_logits=True)
        ref = lg[0].double().log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    res = tiny_engine.score(ids)
    # derived from the compiled-vs-eager fp32 logit bound of test_export_model (2e-4 + 2e-4 |logit|):
    # a log-softmax moves by at most twice the largest logit change
    tol = 2 * (2e-4 + 2e-4 * float(lg.abs().max()))
    np.testing.assert_allclose(res.logprobs[1:], ref, rtol=0, atol=tol)
    assert res.perplexity == pytest.approx(math.exp(-ref.mean()), rel=1e-3)
    long = TINY_PROMPTS[3]  # longer than one call: overlapping chunks
    whole = tiny_engine.score(long)
    assert len(whole.logprobs) == len(long)
    np.testing.assert_allclose(whole.logprobs[1:len(ids)], tiny_engine.score(long[:len(ids)]).logprobs[1:],
                               atol=1e-4)


def test_tiny_errors(tiny_engine, tiny_export: Path, tmp_path: Path) -> None:
    import shutil

    from dsv4.runtime.engine import Engine

    with pytest.raises(RequestError, match="longer than max_seq_len"):
        tiny_engine.generate([0] * (tiny_engine.config.max_seq_len + 1))
    with pytest.raises(RequestError, match="invalid token id"):
        tiny_engine.generate([0, tiny_engine.config.vocab_size])
    with pytest.raises(RequestError, match="no tokenizer"):
        tiny_engine.generate("text prompt")
    d = tmp_path / "mixed"
    shutil.copytree(tiny_export, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["export_id"] = "0" * 32
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ArtifactError, match="mixes artifacts of two exports"):
        Engine(d)


def test_tiny_generate_without_torch(tiny_export: Path, tiny_reference) -> None:
    code = NO_TORCH_PRELUDE + textwrap.dedent(f"""
        from dsv4.cli import main
        main(['generate', {str(tiny_export)!r}, '--prompt-ids', {','.join(map(str, TINY_PROMPTS[0]))!r},
              '--max-new-tokens', '16', '--ignore-eos', '--json'])
        bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(('iree.compiler', 'iree.turbine'))]
        assert not bad, bad
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == tiny_reference[0][:16]
