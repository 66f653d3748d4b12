"""Training (dsv4.train, train/): the loss goes down, the indexer learns from its own loss only, the
training hooks change nothing when off, gradients through the in-place state writes are right,
runs are deterministic, and the shipped small model is actually trained."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from dsv4 import train as T
from dsv4.model.quant import sim as quant_sim
from dsv4.model.checkpoint import EMBEDDED_CHECKPOINT
from dsv4.model.config import ModelConfig
from dsv4.model.generate import greedy
from dsv4.model.kernels import overrides
from dsv4.model.kernels.topk import record_topk
from dsv4.model.model import Transformer, init_random
from dsv4.model.state import new_state

ASSETS = EMBEDDED_CHECKPOINT.parent
SEQ = 32  # crosses the tiny window (8) 4x, 8 ratio-4 entries (top-4 selects), 2 ratio-16 entries


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def micro(quant_sim_on: bool = True, dtype: torch.dtype = torch.float32, seed: int = 0) -> Transformer:
    cfg = ModelConfig.preset("tiny", quant_sim=quant_sim_on, max_seq_len=64)
    return init_random(Transformer(cfg, dtype=dtype), seed=seed, std=0.05)


def stream(n: int = 4000, vocab: int = 512) -> torch.Tensor:
    """A learnable synthetic token stream: a fixed 37-token phrase repeated with random fillers."""
    g = torch.Generator().manual_seed(3)
    phrase = torch.randint(2, vocab, (37,), generator=g)
    parts = []
    while sum(len(p) for p in parts) < n:
        parts += [phrase, torch.randint(2, vocab, (5,), generator=g)]
    return torch.cat(parts)[:n]


def tcfg(**kw) -> T.TrainConfig:
    base = dict(preset="tiny", seq_len=SEQ, batch_size=2, steps=8, lr=1e-2, min_lr=1e-3, warmup_steps=2,
                log_every=1000, threads=1)
    return T.TrainConfig(**{**base, **kw})


def batch(seed: int = 0, B: int = 2) -> torch.Tensor:
    return T.BatchSampler(stream(), SEQ, B, seed).batch(0)


# ---------------------------------------------------------------------------------------------


def test_a_few_steps_reduce_the_loss():
    torch.manual_seed(0)
    model = micro()
    c = tcfg()
    hist = T.train_steps(model, T.BatchSampler(stream(), SEQ, 2, 0), c, log=None)
    first, last = hist[0], hist[-1]
    assert all(math.isfinite(h["loss"]) for h in hist)
    assert last["lm"] < first["lm"] - 0.5, [round(h["lm"], 3) for h in hist]
    assert last["mtp"] < first["mtp"], [round(h["mtp"], 3) for h in hist]


def test_same_seed_same_losses():
    def run():
        torch.manual_seed(0)
        model = micro(seed=5)
        return [h["loss"] for h in T.train_steps(model, T.BatchSampler(stream(), SEQ, 2, 7), tcfg(steps=4), log=None)]

    assert run() == run()


def _indexer_params(model):
    return {n for n, _ in model.named_parameters() if ".indexer." in n}


def test_indexer_aux_loss_trains_the_indexer_only():
    model = micro()
    with quant_sim.straight_through():
        out = T.compute_losses(model, batch(), mtp_weight=0.3, indexer_weight=1.0)
    assert out["indexer_kl"] > 0 and 0 <= out["indexer_captured"] <= 1

    aux = torch.autograd.grad(out["indexer_kl"], [p for p in model.parameters() if p.requires_grad],
                              allow_unused=True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    got = {n: g for n, g in zip(names, aux)}
    idx = _indexer_params(model)
    for n in idx:  # wq_b, weights_proj, compressor.{wkv, wgate, ape, norm} of both CSA layers
        assert got[n] is not None and got[n].abs().sum() > 0, n
    leaked = [n for n, g in got.items() if n not in idx and g is not None and g.abs().sum() > 0]
    assert not leaked, leaked

    lm = torch.autograd.grad(out["lm"] + 0.3 * out["mtp"], [p for n, p in model.named_parameters() if n in idx],
                             allow_unused=True)
    assert all(g is None or g.abs().sum() == 0 for g in lm)  # the top-k stops the LM gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_hooks_leave_logits_bit_identical(dtype):
    model = micro(dtype=dtype).eval()
    toks = batch()[:, :SEQ]
    B = toks.shape[0]
    args = (torch.zeros(B, dtype=torch.long), torch.full((B,), SEQ), torch.arange(B))

    def logits():
        return model(toks, *args, new_state(model.cfg, B, dtype), all_logits=True)

    with torch.no_grad():
        ref = logits()
    with torch.enable_grad(), quant_sim.straight_through():  # STE on, gradients on
        ste = logits()
    ixs = [layer.attn.indexer for layer in model.layers if hasattr(layer.attn, "indexer")]
    for ix in ixs:
        ix.aux = {}
    try:
        with torch.no_grad():
            hooked = logits()
        assert all({"q", "w", "keys", "n_vis", "attn_q", "attn_kv", "sel"} <= set(ix.aux) for ix in ixs)
    finally:
        for ix in ixs:
            ix.aux = None
    assert torch.equal(ref, ste.detach())
    assert torch.equal(ref, hooked)


def test_straight_through_estimator():
    x = torch.randn(4, 128, requires_grad=True)
    for qdq, block in ((quant_sim.fp8_qdq, 64), (quant_sim.fp4_qdq, 32)):
        plain = qdq(x, block)
        (g0,) = torch.autograd.grad(plain.sum(), x, allow_unused=True)
        assert g0 is None or g0.abs().sum() == 0  # rounding: zero gradient a.e.
        with quant_sim.straight_through():
            ste = qdq(x, block)
        assert torch.equal(ste, plain)
        (g,) = torch.autograd.grad(ste.sum(), x)
        assert torch.equal(g, torch.ones_like(x))


@pytest.mark.parametrize("name,indexer_weight", [
    ("layers.1.attn.compressor.wkv.weight", 0.0),  # CSA: entries go to state kv_r4, then are read back
    ("layers.2.attn.compressor.wgate.weight", 0.0),  # HCA: state kv_r16
    ("layers.0.attn.wkv.weight", 0.0),  # window KV, and everything downstream
    ("layers.1.attn.indexer.compressor.wkv.weight", 1.0),  # indexer keys via state idx_kv_r4 (aux loss)
])
def test_gradients_through_state_writes_match_finite_differences(name, indexer_weight):
    """Autograd through the in-place state writes against a central difference (fp32, sims off).

    Backbone weights are checked on LM + MTP only: the indexer loss's target (the attention
    distribution) is detached on purpose, so its true derivative differs from the one trained with.
    A step that flips any top-k (MoE routing, indexer selection) makes the loss jump: shrink it."""
    torch.manual_seed(0)
    model = micro(quant_sim_on=False)
    b = batch()
    p = dict(model.named_parameters())[name]

    def loss():
        with record_topk() as picks:
            out = T.compute_losses(model, b, mtp_weight=0.3, indexer_weight=indexer_weight)
        # the selected sets, ignoring picks among -inf (invisible entries, masked by position anyway)
        sets = [torch.where(s.gather(-1, i) > float("-inf"), i, -1).sort(-1).values for s, i in picks]
        return out["loss"], sets

    l0, picks0 = loss()
    (gr,) = torch.autograd.grad(l0, [p])
    # along the gradient itself: the largest directional derivative, so the best signal over fp32
    # rounding of the loss; a wrong gradient (in direction or size) changes the loss at another rate
    v = gr / gr.norm()
    an = float(gr.norm())
    assert an > 0
    for eps in (3e-3, 1e-3, 3e-4):
        with torch.no_grad():
            p += eps * v
            lp, pp = loss()
            p -= 2 * eps * v
            lm, pm = loss()
            p += eps * v
        if all(torch.equal(a, c) and torch.equal(a, d) for a, c, d in zip(picks0, pp, pm)):
            break
    else:
        pytest.fail(f"{name}: every step flips a top-k")
    fd = float(lp - lm) / (2 * eps)
    print(f"[fd] {name}: eps {eps:g} finite difference {fd:.6g} autograd {an:.6g}")
    assert abs(fd - an) <= 2e-6 / eps + 5e-3 * an, (eps, fd, an)


def test_routed_moe_kernel_matches_the_reference():
    """In float64: in float32 the two expert forms' summation orders differ by an ulp, enough to flip a
    near-tied indexer top-k in a later layer and move that layer's indexer gradients by a few %."""
    model = micro(dtype=torch.float64)
    b = batch()
    ps = [p for p in model.parameters() if p.requires_grad]

    def run(kernels):
        with quant_sim.straight_through(), overrides(kernels):
            out = T.compute_losses(model, b)
            return out["loss"].detach(), torch.autograd.grad(out["loss"], ps, allow_unused=True)

    l0, g0 = run({})
    l1, g1 = run({"moe_experts": T.routed_moe_experts})
    assert torch.allclose(l0, l1, rtol=1e-5, atol=1e-6)
    for a, c in zip(g0, g1):
        if a is None:
            assert c is None or c.abs().sum() == 0
        else:
            assert torch.allclose(a, c, rtol=1e-3, atol=1e-6)


def test_batches_are_a_function_of_the_seed():
    s = stream()
    a, b = T.BatchSampler(s, SEQ, 2, 1), T.BatchSampler(s, SEQ, 2, 1)
    assert all(torch.equal(a.batch(i), b.batch(i)) for i in (0, 5, 300, 3))
    assert not torch.equal(T.BatchSampler(s, SEQ, 2, 2).batch(0), a.batch(0))
    assert a.batch(0).shape == (2, SEQ + 2)


def test_train_steps_evaluates_every_n_steps():
    torch.manual_seed(0)
    model = micro()
    seen = []

    def on_eval(step):
        seen.append((step, model.training, torch.is_grad_enabled()))
        return float(step)

    hist = T.train_steps(model, T.BatchSampler(stream(), SEQ, 2, 0), tcfg(steps=5, eval_every=2), log=None,
                         on_eval=on_eval)
    assert seen == [(2, False, False), (4, False, False), (5, False, False)]  # every 2nd and the last
    assert [h.get("eval_ppl") for h in hist] == [None, 2.0, None, 4.0, 5.0]


def test_prepared_data_early_stopping_and_finishing_from_a_master(tmp_path):
    """--save-data/--data give the same streams and tokenizer as building them here; keep_best returns
    the weights of the best periodic evaluation; --from-master + finish rebuild the run's result."""
    c = tcfg(steps=4, eval_every=2, eval_windows_during=2, keep_best=True, eval_batch=2)
    data = T.save_data(c, tmp_path / "data")
    built, loaded = T.prepare_data(c), T.prepare_data(c, data)
    assert loaded[0].sha256 == built[0].sha256 and loaded[0].matches_reference == built[0].matches_reference
    assert loaded[2].to_str() == built[2].to_str()
    assert torch.equal(loaded[3], built[3]) and torch.equal(loaded[4], built[4])

    bests = []
    res = T.train(c, log=None, eval_windows=1, sample_tokens=2, data=data,
                  on_best=lambda model, info: bests.append(info))
    evals = res.record["eval_during_training"]
    assert [e["step"] for e in evals] == [2, 4]
    best = min(evals, key=lambda e: e["ppl"])
    assert res.record["kept_step"] == best["step"] == bests[-1]["step"]
    assert res.record["kept_tokens"] == best["step"] * c.batch_size * c.seq_len
    again = T.evaluate(res.model, res.eval_ids, c.seq_len, c.eval_batch, c.eval_windows_during)
    assert again["ppl"] == pytest.approx(bests[-1]["ppl"], rel=1e-5)  # the returned weights are the best's

    T.save_master(res.model, res.cfg, tmp_path / "run", res.tokenizer, res.record)
    fin = T.from_master(tmp_path / "run", data=data, eval_windows=1, sample_tokens=2, log=None)
    a, b = T.master_state(res.model), T.master_state(fin.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert fin.record["eval_bf16"] == res.record["eval_bf16"]  # same bytes, same machine
    assert fin.record["run_eval_bf16"] == res.record["eval_bf16"] and "finished_here" in fin.record
    T.finish(fin, tmp_path / "out", eval_windows=1, fp8=False, log=None)
    log = json.loads((tmp_path / "out" / "train_log.json").read_text())
    assert log["kept_step"] == best["step"] and log["train_config"]["keep_best"] is True
    out = T.load_master(tmp_path / "out")
    assert all(torch.equal(v, out.state_dict()[k]) for k, v in b.items())


# ---------------------------------------------------------------------------------------------
# the shipped model

MASTER = ASSETS / "small"
FP8 = MASTER  # the official checkpoint (model.safetensors) lives next to the master


def _eval_stream(tok):
    """The shipped held-out text (what the recorded values were measured on), not a rebuild of the
    corpus: another CPython release rebuilds different docstrings (train/corpus.py)."""
    from dsv4.train.corpus import DOC_SEPARATOR

    return T.token_stream(tok, (MASTER / "eval.txt").read_text().split(DOC_SEPARATOR))


def _log():
    return json.loads((MASTER / "train_log.json").read_text())


# Perplexity of the shipped weights on the first 8 x 256 held-out tokens, against the value the
# training run recorded for exactly that slice (train_log.json run_eval_bf16: 23.3036, on CUDA).
# Run-to-run noise measured here (T.evaluate at 1 and 2 torch threads, batch 8, 3 and 1): 23.293970 +- 4e-6,
# i.e. 2e-7 relative; against the recorded CUDA value: 4.1e-4 relative. SLICE_NOISE = 0.5 % is 12x
# the cross-machine difference. The FP8/MXFP4 checkpoint adds its quantization cost (recorded over
# the whole eval set: +0.14 %, eval_fp8_checkpoint vs eval_bf16; measured on this slice: -0.13 %),
# so FP8_SLICE = 1 %. Planted bugs move it by far more: fn bytes with the fn scale +40 %.
SLICE_NOISE = 0.005
FP8_SLICE = 0.01


@pytest.mark.skipif(not (MASTER / T.MASTER_FILE).exists(), reason="no shipped master")
def test_shipped_master_is_trained():
    from dsv4.contract.tokenizer import load_tokenizer

    log = _log()
    model = T.load_master(MASTER, torch.bfloat16)
    assert model.cfg == ModelConfig.preset("small")
    tok = load_tokenizer(MASTER)
    assert tok.get_vocab_size() == model.cfg.vocab_size
    ev = T.evaluate(model, _eval_stream(tok), 256, batch_size=8, max_windows=8)
    recorded = log["run_eval_bf16"]
    assert ev["tokens"] == recorded["tokens"] == 2048
    assert abs(ev["ppl"] / recorded["ppl"] - 1) < SLICE_NOISE, (ev, recorded)


@pytest.mark.skipif(not (FP8 / "model.safetensors").exists(), reason="no shipped FP8 checkpoint")
def test_shipped_fp8_checkpoint_loads_and_is_trained():
    from dsv4.model.checkpoint import load_checkpoint
    from dsv4.contract.tokenizer import load_tokenizer

    model = load_checkpoint(FP8, dtype=torch.bfloat16, progress=False)
    assert model.embed.weight.shape[0] == 2048
    assert model.layers[1].attn.wq_a.weight.dtype == torch.float8_e4m3fn
    tok = load_tokenizer(FP8)
    ev = T.evaluate(model, _eval_stream(tok), 256, batch_size=8, max_windows=8)
    recorded = _log()["run_eval_bf16"]
    assert ev["tokens"] == recorded["tokens"]
    assert abs(ev["ppl"] / recorded["ppl"] - 1) < FP8_SLICE, (ev, recorded)


@pytest.mark.skipif(not (FP8 / "model.safetensors").exists(), reason="no shipped FP8 checkpoint")
def test_shipped_model_continues_the_prompt_without_looping():
    """The fixed prompt's greedy continuation (what `dsv4 eager` prints) is varied text, not a loop
    over a few words (the first, 512k-token model gave 'The "s" is a "s" is a "s"')."""
    import re

    from dsv4.model.checkpoint import load_checkpoint
    from dsv4.contract.tokenizer import decode, encode, load_tokenizer

    model = load_checkpoint(FP8, dtype=torch.bfloat16, progress=False)
    tok = load_tokenizer(FP8)
    text = decode(tok, greedy(model, encode(tok, T.DEFAULT_PROMPT, bos=True), 40))
    words = [w.lower() for w in re.findall(r"[A-Za-z]+", text)]
    assert len(words) >= 12, text
    assert len(set(words)) >= 0.6 * len(words), text
    assert sum(len(w) >= 4 for w in set(words)) >= 6, text
