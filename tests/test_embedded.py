"""The embedded default model (model/assets/small) end to end: held-out perplexity of the bf16
master, the official FP8/MXFP4 checkpoint in eager, and the compiled llvm-cpu module, each within
a stated bound of the others, and the greedy continuation of the fixed prompt equal in eager and
compiled form.

Why these bounds: quantizing the trained bf16 weights to FP8 (128x128 E8M0 blocks) and MXFP4
experts costs this model 0.1-0.2 % perplexity (train_log.json: 28.91 -> 28.95 over the whole eval text), so 3 %
leaves room for retraining while an encoding bug (a scale off by a power of two, an fn byte read
as fnuz) moves it by far more (checked below by planting exactly that bug). The compiled module
runs the same graph as eager bf16, so it is held to 1 %.

The export (llvm-cpu, max_seq_len 512) is conftest's embedded_bf16_export, which the server and
batch-invariance tests share; it takes minutes on 2 cores and is cached under .cache/ keyed by the
sources and weights. The gfx942 (e4m3fnuz) hand-off is tested on the tiny quantized export
(tests/test_fnuz_export.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import EMBEDDED_BF16_ARGS, embedded_bf16_model

from dsv4.model.checkpoint import EMBEDDED_CHECKPOINT, EMBEDDED_PROMPT, load_checkpoint
from dsv4.model.generate import greedy
from dsv4.model.state import new_state
from dsv4.contract.tokenizer import encode, load_tokenizer
from dsv4.train.corpus import DOC_SEPARATOR

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
WINDOW = 256  # tokens per scored window (the training sequence length)
N_WINDOWS = 4
NEW_TOKENS = 32
FP8_VS_BF16 = 0.03  # relative perplexity bound, FP8/MXFP4 checkpoint vs bf16 master (eager)
COMPILED_VS_EAGER = 0.01  # compiled llvm-cpu vs the same checkpoint in eager
TIE = 0.1  # logits closer than this are a bf16 near-tie (see the greedy test)
assert EMBEDDED_BF16_ARGS["max_chunk"] >= WINDOW  # a window is scored in one call


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_CHECKPOINT)


@pytest.fixture(scope="module")
def windows(tokenizer) -> list[list[int]]:
    """N_WINDOWS windows spread evenly over the held-out text (the first ones alone, grammar
    productions, are far easier than the rest: ppl 9 vs 29), documents framed by bos/eos as in training."""
    from dsv4.train import token_stream

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
    return embedded_bf16_model()  # the model the export was made from (max_seq_len 512)


@pytest.fixture(scope="module")
def ppl_fp8(fp8_model, windows) -> float:
    return eager_ppl(fp8_model, windows)


@pytest.fixture(scope="module")
def export_dir(embedded_bf16_export: Path) -> Path:
    """The embedded checkpoint exported for llvm-cpu (cached)."""
    return embedded_bf16_export


@pytest.fixture(scope="module")
def engine(export_dir):
    from dsv4.runtime.engine import Engine

    return Engine(export_dir)


def test_fp8_checkpoint_perplexity_is_close_to_the_bf16_master(windows, ppl_fp8):
    from dsv4.train import load_master

    master = EMBEDDED_CHECKPOINT / "master-bf16.safetensors"
    if not master.is_file():
        pytest.skip("no bf16 master shipped")
    ppl_bf16 = eager_ppl(load_master(EMBEDDED_CHECKPOINT), windows)
    print(f"[embedded] held-out ppl over {N_WINDOWS}x{WINDOW} tokens: bf16 master {ppl_bf16:.3f}, "
          f"FP8/MXFP4 checkpoint {ppl_fp8:.3f}")
    assert abs(ppl_fp8 / ppl_bf16 - 1) < FP8_VS_BF16
    # The absolute anchor is test_train's: both shipped files within 0.5 % / 1 % of the perplexity
    # the training run recorded (that catches window-only compressed layers, a 1/D attention scale,
    # a halved FP8 scale); this file chains compiled -> eager FP8 -> bf16 master onto it.


def test_a_planted_fp8_encoding_bug_breaks_the_bound(windows, ppl_fp8):
    """The classic MI300X bug: e4m3fn weights re-encoded as e4m3fnuz bytes but the block scale left
    as it was (fnuz values are half the fn values of the same bits, so every weight is halved).
    The bound above must see it. (Reading fn bytes as fnuz outright gives NaN from the 0x80 codes.)"""
    from dsv4.model.quant.formats import fp8_fn_to_fnuz

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
    """Teacher-forced, all NEW_TOKENS steps: under the same prefix (the prompt and eager's greedy
    tokens so far), the compiled module's top token is eager's, or eager rates it within TIE of its
    best (a bf16 near-tie: both run bf16 activations, but IREE fuses elementwise chains where torch
    rounds after every op; eager's own prefill and decode paths split such a tie at step 31 of this
    prompt, margin 0.048). Steps after a split are still checked, on eager's continuation."""
    from dsv4.runtime.sampling import SamplingParams

    prompt = encode(tokenizer, EMBEDDED_PROMPT, bos=True)
    want = greedy(fp8_model, prompt, NEW_TOKENS)  # same top-k tie rule as the export (topk.py)
    seq = torch.tensor([prompt + want])
    with torch.no_grad():
        logits = fp8_model(seq, torch.tensor([0]), torch.tensor([seq.shape[1]]), torch.tensor([0]),
                           new_state(fp8_model.cfg, 1, fp8_model.dtype), all_logits=True)[0].float()
    assert len(want) == NEW_TOKENS
    got, gaps = [], []
    for i in range(NEW_TOKENS):
        res = engine.generate(prompt + want[:i], SamplingParams(max_new_tokens=1, ignore_eos=True))
        got.append(res.tokens[0])
        step = logits[len(prompt) + i - 1]  # eager's logits for the token after prompt + want[:i]
        gaps.append(float(step.max() - step[got[-1]]))
    text = engine.decode(want)
    agree = sum(a == b for a, b in zip(got, want))
    print(f"[embedded] greedy {EMBEDDED_PROMPT!r} -> {text!r}; compiled top token == eager's at {agree}/{NEW_TOKENS} "
          f"teacher-forced steps; largest eager gap to the compiled pick {max(gaps):.3f}")
    bad = [(i, got[i], want[i], round(g, 3)) for i, g in enumerate(gaps) if got[i] != want[i] and g > TIE]
    assert not bad, f"(step, compiled, eager, eager's gap) beyond the bf16 near-tie {TIE}: {bad}"
    assert agree >= NEW_TOKENS - 2  # near-ties are rare: measured 31-32 of 32
    assert "\ufffd" not in text  # whole UTF-8 characters, i.e. real text pieces


def test_export_cli_defaults_to_the_embedded_model(monkeypatch, tmp_path):
    """`dsv4 export` with neither --checkpoint nor --preset loads the embedded checkpoint."""
    import dsv4.export.exporter as exporter
    from dsv4.cli import main

    seen = {}

    def fake_export(model, spec, out, **kw):  # stop before the minutes of tracing
        seen.update(cfg=model.cfg, tokenizer=kw.get("tokenizer"))
        raise exporter.ExportError("trace:test", "stopped by the test")

    monkeypatch.setattr(exporter, "export_model", fake_export)
    assert main(["export", "--target", "llvm-cpu", "-o", str(tmp_path)]) == 1
    assert seen["cfg"].hidden_size == 256 and seen["cfg"].n_routed_experts == 8
    assert Path(seen["tokenizer"]) == EMBEDDED_CHECKPOINT / "tokenizer.json"
