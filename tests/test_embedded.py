"""The embedded default model (model/assets/small) end to end: held-out perplexity of the bf16
master, the official FP8/MXFP4 checkpoint in eager, and the compiled llvm-cpu module, each within
a stated bound of the others, and the greedy continuation of the fixed prompt equal in eager and
compiled form.

Why these bounds: quantizing the trained bf16 weights to FP8 (128x128 E8M0 blocks) and MXFP4
experts costs this model 0.1-0.2 % perplexity (train_log.json: 28.91 -> 28.95 over the whole eval text), so 3 %
leaves room for retraining while an encoding bug (a scale off by a power of two, an fn byte read
as fnuz) moves it by far more (checked below by planting exactly that bug). The compiled module
runs the same graph as eager bf16, so it is held to 1 %.

The export (llvm-cpu for running, gfx942 so CI also compiles the e4m3fnuz flavour of the FP8
weights) takes minutes on 2 cores: it is cached under .cache/ keyed by the sources and weights.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from dsv4.model.checkpoint import EMBEDDED_CHECKPOINT, EMBEDDED_PROMPT, load_checkpoint
from dsv4.model.corpus import DOC_SEPARATOR
from dsv4.model.generate import greedy
from dsv4.model.state import new_state
from dsv4.model.tokenizer import encode, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
WINDOW = 256  # tokens per scored window (the training sequence length)
N_WINDOWS = 4
NEW_TOKENS = 32
FP8_VS_BF16 = 0.03  # relative perplexity bound, FP8/MXFP4 checkpoint vs bf16 master (eager)
COMPILED_VS_EAGER = 0.01  # compiled llvm-cpu vs the same checkpoint in eager
TIE = 0.1  # logits closer than this are a bf16 near-tie (see the greedy test)
EXPORT_ARGS = dict(targets=("llvm-cpu", "gfx942"), batch_sizes=(1,), max_chunk=WINDOW)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_CHECKPOINT)


@pytest.fixture(scope="module")
def windows(tokenizer) -> list[list[int]]:
    """N_WINDOWS windows spread evenly over the held-out text (the first ones alone, grammar
    productions, are far easier than the rest: ppl 9 vs 29), documents framed by bos/eos as in training."""
    from dsv4.model.train import token_stream

    docs = (EMBEDDED_CHECKPOINT / "eval.txt").read_text().split(DOC_SEPARATOR)
    stream = token_stream(tokenizer, docs).tolist()
    stride = len(stream) // WINDOW // N_WINDOWS
    assert stride >= 1
    return [stream[i * stride * WINDOW:(i * stride + 1) * WINDOW] for i in range(N_WINDOWS)]


@torch.no_grad()
def eager_ppl(model, windows: list[list[int]]) -> float:
    nll, n = 0.0, 0
    for w in windows:
        t = torch.tensor([w])
        one = torch.tensor([0])
        logits = model(t, one * 0, torch.tensor([len(w)]), one * 0, new_state(model.cfg, 1, model.dtype),
                       all_logits=True)
        lp = logits[0, :-1].double().log_softmax(-1).gather(-1, t[0, 1:, None])
        nll -= float(lp.sum())
        n += len(w) - 1
    return math.exp(nll / n)


@pytest.fixture(scope="module")
def fp8_model():
    return load_checkpoint(EMBEDDED_CHECKPOINT, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def ppl_fp8(fp8_model, windows) -> float:
    return eager_ppl(fp8_model, windows)


def _export_key() -> str:
    import iree.compiler

    h = hashlib.sha256()
    graph = ("model.py", "config.py", "state.py", "quant_sim.py", "formats.py", "checkpoint.py")
    for f in sorted([*(REPO / "model" / g for g in graph), *(REPO / "model" / "kernels").glob("*.py"),
                     *(REPO / "export").glob("*.py"), EMBEDDED_CHECKPOINT / "model.safetensors",
                     EMBEDDED_CHECKPOINT / "config.json", EMBEDDED_CHECKPOINT / "tokenizer.json"]):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(repr(sorted(EXPORT_ARGS.items())).encode())
    h.update(str(getattr(iree.compiler, "__version__", "")).encode())
    return h.hexdigest()[:16]


@pytest.fixture(scope="module")
def engine(fp8_model, tmp_path_factory):
    """The embedded checkpoint exported as `dsv4 export` does by default (cached)."""
    from dsv4.export.exporter import export_model
    from dsv4.runtime.engine import Engine

    cache = REPO / ".cache" / f"embedded-{_export_key()}"
    if not (cache / "config.json").is_file():
        tmp = tmp_path_factory.mktemp("embedded")
        export_model(fp8_model, fp8_model.cfg, tmp, **EXPORT_ARGS, tokenizer=EMBEDDED_CHECKPOINT, progress=print)
        if cache.exists():
            shutil.rmtree(cache)
        cache.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(tmp, cache)
    return Engine(cache)


def test_fp8_checkpoint_perplexity_is_close_to_the_bf16_master(windows, ppl_fp8):
    from dsv4.model.train import load_master

    master = EMBEDDED_CHECKPOINT / "master-bf16.safetensors"
    if not master.is_file():
        pytest.skip("no bf16 master shipped")
    ppl_bf16 = eager_ppl(load_master(EMBEDDED_CHECKPOINT), windows)
    print(f"[embedded] held-out ppl over {N_WINDOWS}x{WINDOW} tokens: bf16 master {ppl_bf16:.3f}, "
          f"FP8/MXFP4 checkpoint {ppl_fp8:.3f}")
    assert abs(ppl_fp8 / ppl_bf16 - 1) < FP8_VS_BF16
    # a trained model, not noise: far below uniform over the vocabulary
    assert ppl_bf16 < 0.1 * 2048


def test_a_planted_fp8_encoding_bug_breaks_the_bound(windows, ppl_fp8):
    """The classic MI300X bug: e4m3fn weights re-encoded as e4m3fnuz bytes but the block scale left
    as it was (fnuz values are half the fn values of the same bits, so every weight is halved).
    The bound above must see it. (Reading fn bytes as fnuz outright gives NaN from the 0x80 codes.)"""
    from dsv4.model.formats import fp8_fn_to_fnuz

    bad = load_checkpoint(EMBEDDED_CHECKPOINT, dtype=torch.bfloat16)
    n = 0
    for mod in bad.modules():
        w = getattr(mod, "weight", None)
        if isinstance(w, torch.Tensor) and w.dtype == torch.float8_e4m3fn:
            mod.weight = torch.nn.Parameter(fp8_fn_to_fnuz(w.data, mod.scale.data)[0], requires_grad=False)
            n += 1
    assert n > 10
    ppl_bad = eager_ppl(bad, windows)
    print(f"[embedded] fnuz bytes with the fn scale: ppl {ppl_bad:.2f} (correct {ppl_fp8:.2f})")
    assert ppl_bad / ppl_fp8 - 1 > 3 * FP8_VS_BF16


def test_compiled_perplexity_matches_eager(engine, windows, ppl_fp8):
    nll, n = 0.0, 0
    for w in windows:
        res = engine.score(w, add_bos=False)
        assert res.logprobs[0] is None and len(res.logprobs) == len(w)
        nll -= sum(res.logprobs[1:])
        n += len(w) - 1
    ppl_compiled = math.exp(nll / n)
    print(f"[embedded] held-out ppl: compiled llvm-cpu {ppl_compiled:.3f}, eager {ppl_fp8:.3f}")
    assert abs(ppl_compiled / ppl_fp8 - 1) < COMPILED_VS_EAGER


def test_greedy_continuation_of_the_fixed_prompt_is_the_same_compiled(engine, fp8_model, tokenizer):
    """Token for token, except at a bf16 near-tie: both run bf16 activations, but IREE fuses
    elementwise chains where torch rounds after every op, so where eager's two best logits are
    within TIE the pick may differ (eager's own prefill and decode paths split such a tie: step 31
    of this prompt, margin 0.048). At the first difference, eager must rate the compiled token
    within TIE of its own; after it the texts legitimately part."""
    from dsv4.runtime.sampling import SamplingParams

    prompt = encode(tokenizer, EMBEDDED_PROMPT, bos=True)
    want = greedy(fp8_model, prompt, NEW_TOKENS)  # same top-k tie rule as the export (topk.py)
    res = engine.generate(prompt, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    got = res.tokens
    text = engine.decode(got)
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), NEW_TOKENS)
    print(f"[embedded] compiled greedy {EMBEDDED_PROMPT!r} -> {text!r}; equal to eager for {same}/{NEW_TOKENS} tokens")
    assert len(got) == NEW_TOKENS
    if same < NEW_TOKENS:
        seq = torch.tensor([prompt + want[:same]])
        with torch.no_grad():
            logits = fp8_model(seq, torch.tensor([0]), torch.tensor([seq.shape[1]]), torch.tensor([0]),
                               new_state(fp8_model.cfg, 1, fp8_model.dtype))[0].float()
        gap = float(logits.max() - logits[got[same]])
        print(f"[embedded] first difference at token {same}: eager rates the compiled pick {gap:.3f} below its best")
        assert gap <= TIE
    assert "\ufffd" not in text  # whole UTF-8 characters, i.e. real text pieces


def test_export_cli_defaults_to_the_embedded_model(monkeypatch, tmp_path):
    """`dsv4 export` with neither --checkpoint nor --preset loads the embedded checkpoint."""
    import dsv4.export.exporter as exporter
    from dsv4.runtime.cli import main

    seen = {}

    def fake_export(model, cfg, out, **kw):  # stop before the minutes of tracing
        seen.update(cfg=cfg, tokenizer=kw.get("tokenizer"))
        raise exporter.ExportError("trace:test", "stopped by the test")

    monkeypatch.setattr(exporter, "export_model", fake_export)
    assert main(["export", "--target", "llvm-cpu", "-o", str(tmp_path)]) == 1
    assert seen["cfg"].hidden_size == 256 and seen["cfg"].n_routed_experts == 8
    assert Path(seen["tokenizer"]) == EMBEDDED_CHECKPOINT / "tokenizer.json"
