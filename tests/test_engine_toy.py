"""The Engine end to end on a *toy* export built here: a one-layer attention LM following the export
ABI exactly, with a character tokenizer, compiled once for llvm-cpu in a few seconds. It checks the
engine's mechanics (in-place device state, chunked prefill, padded batched decode, slot reuse, score
chunking, export_id) against the same toy module run eagerly."""

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

from dsv4.runtime import ArtifactError, RequestError, SamplingParams
from conftest import NO_TORCH_PRELUDE

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------
# toy export: the ABI on a one-layer attention LM, built and compiled here
# ------------------------------------------------------------------------------------------------

TOY_CHARS = "abcdefghijklmnopqrstuvwxyz .,!?"
TOY_V, TOY_D, TOY_S, TOY_SLOTS = 2 + len(TOY_CHARS), 16, 48, 4
TOY_TMIN, TOY_TMAX = 3, 16
TOY_EXPORT_ID = "toy-0001"


def _toy_tokenizer():
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<s>": 0, "</s>": 1}
    for c in TOY_CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


def _toy_module():
    """A module with the export ABI: state kv f32 [slots, S+1, D] (row S is scratch for padding
    writes) and prev_tab bf16 [slots, S+1, D] (each position's embedding, added to the next
    position's output); attention over the slot's positions <= each token's."""
    import torch
    import torch.nn as nn

    class Toy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.emb = nn.Parameter(torch.randn(TOY_V, TOY_D, generator=g))
            self.wq = nn.Parameter(torch.randn(TOY_D, TOY_D, generator=g) / TOY_D**0.5)
            self.head = nn.Parameter(torch.randn(TOY_D, TOY_V, generator=g) * 2)

        def hidden(self, tokens, start_pos, lengths, slots, kv, prev_tab):
            N, T = tokens.shape
            e = self.emb[tokens]  # N,T,D
            ar = torch.arange(T)
            pos = start_pos[:, None] + ar[None, :]
            valid = ar[None, :] < lengths[:, None]
            rows = torch.where(valid, pos, torch.full_like(pos, TOY_S))
            kv.index_put_((slots[:, None].expand(N, T), rows), e)
            # bf16 state: each position's embedding, read back at the next position (so the state is
            # both written and read, chunk by chunk; positions are idempotent like the kv rows)
            prev_tab.index_put_((slots[:, None].expand(N, T), rows), e.to(prev_tab.dtype))
            prev_rows = torch.where(pos > 0, pos - 1, TOY_S)  # position 0 reads the scratch row: zeros
            prev = torch.where((pos > 0)[..., None], prev_tab[slots[:, None], prev_rows].float(), 0.0)
            ctx = kv[slots][:, :TOY_S]  # N,S,D
            q = e @ self.wq
            sc = torch.einsum("ntd,nsd->nts", q, ctx) / TOY_D**0.5
            p_ar = torch.arange(TOY_S)
            mask = p_ar[None, None, :] <= pos[:, :, None]
            sc = sc.masked_fill(~mask, -1e9)
            att = torch.softmax(sc, -1)
            h = torch.tanh(e + torch.einsum("nts,nsd->ntd", att, ctx) + 0.5 * prev)
            return h @ self.head  # N,T,V

        def forward(self, tokens, start_pos, lengths, slots, kv, prev_tab):
            logits = self.hidden(tokens, start_pos, lengths, slots, kv, prev_tab)
            N = tokens.shape[0]
            lastidx = (lengths - 1).clamp(min=0)
            lg = torch.gather(logits, 1, lastidx.view(N, 1, 1).expand(N, 1, TOY_V))[:, 0]
            return lg, torch.argmax(lg, -1)

        def score(self, tokens, start_pos, lengths, slots, kv, prev_tab):
            logits = self.hidden(tokens, start_pos, lengths, slots, kv, prev_tab)
            lp = torch.log_softmax(logits, -1)
            nxt = torch.cat([tokens[:, 1:], tokens[:, :1]], 1)
            return torch.gather(lp, 2, nxt[:, :, None])[:, :, 0]

    return Toy().eval()


def _toy_state():
    import torch

    return (torch.zeros(TOY_SLOTS, TOY_S + 1, TOY_D), torch.zeros(TOY_SLOTS, TOY_S + 1, TOY_D, dtype=torch.bfloat16))


def _toy_eager_greedy(model, prompt: list[int], n: int, chunk: int = TOY_TMAX) -> list[int]:
    import torch

    kv, prev_tab = _toy_state()
    i64 = lambda *v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    with torch.no_grad():
        for s in range(0, len(prompt), chunk):
            piece = prompt[s:s + chunk]
            padded = piece + [0] * max(0, TOY_TMIN - len(piece))
            lg, am = model(torch.tensor([padded]), i64(s), i64(len(piece)), i64(0), kv, prev_tab)
        out, pos = [], len(prompt)
        for _ in range(n):
            t = int(am[0])
            out.append(t)
            lg, am = model(torch.tensor([[t]]), i64(pos), i64(1), i64(0), kv, prev_tab)
            pos += 1
    return out


def _build_toy_export(out: Path, export_id: str = TOY_EXPORT_ID, with_id_fn: bool = True) -> Path:
    import torch
    from iree.turbine import aot

    from conftest import compile_small

    from dsv4.export import compat

    compat.apply()

    out.mkdir(parents=True, exist_ok=True)
    model = _toy_module()
    aot.externalize_module_parameters(model, external_scope="model")
    aot.save_module_parameters(out / "model.irpa", model)
    fxb = aot.FxProgramsBuilder(model)
    kv, prev_tab = _toy_state()
    Tdim = torch.export.Dim("T", min=TOY_TMIN, max=TOY_TMAX)

    def args(n: int, t: int):
        return (torch.zeros(n, t, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                torch.ones(n, dtype=torch.long), torch.arange(n), kv, prev_tab)

    dyn = {"tokens": {1: Tdim}, "start_pos": None, "lengths": None, "slots": None, "kv": None, "prev_tab": None}
    for n in (1, 2):
        fxb.export_program(lambda m, tokens, start_pos, lengths, slots, kv, prev_tab:
                           m(tokens, start_pos, lengths, slots, kv, prev_tab),
                           name=f"prefill_bs{n}", args=args(n, 4), dynamic_shapes=dyn, strict=False)
    for n in (1, 2, 4):
        fxb.export_program(lambda m, tokens, start_pos, lengths, slots, kv, prev_tab:
                           m(tokens, start_pos, lengths, slots, kv, prev_tab),
                           name=f"decode_bs{n}", args=args(n, 1), strict=False)
    fxb.export_program(lambda m, tokens, start_pos, lengths, slots, kv, prev_tab:
                       m.score(tokens, start_pos, lengths, slots, kv, prev_tab),
                       name="score_bs1", args=args(1, 4), dynamic_shapes=dyn, strict=False)
    if with_id_fn:
        code = torch.tensor(list(export_id.encode()), dtype=torch.int64)
        fxb.export_program(lambda m: code.clone(), name="export_id", args=(), strict=False)
    eo = aot.export(fxb, import_symbolic_shape_expressions=True)
    eo.save_mlir(out / "model.mlir")
    # a toy-sized module (seconds): conftest's small-compile allowance, cached by its MLIR text
    shutil.copyfile(compile_small((out / "model.mlir").read_text(), "toy"), out / "model.llvm-cpu.vmfb")
    tok = _toy_tokenizer()
    (out / "tokenizer.json").write_text(tok.to_str())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['role'] }}, {{ m['content'] }}. "
                         "{% endfor %}{% if add_generation_prompt %}assistant,{% endif %}"}))
    sargs = ["tokens", "start_pos", "lengths", "slots", "kv", "prev_tab"]
    fns = {f"prefill_bs{n}": {"args": sargs, "results": ["logits", "argmax"]} for n in (1, 2)}
    fns.update({f"decode_bs{n}": {"args": sargs, "results": ["logits", "argmax"]} for n in (1, 2, 4)})
    fns["score_bs1"] = {"args": sargs, "results": ["logprobs"]}
    cfg = {
        "format": "dsv4-iree-export", "version": 1,
        "model": {"vocab_size": TOY_V, "max_seq_len": TOY_S, "eos_token_id": 1, "bos_token_id": 0},
        "activation_dtype": "float32", "n_slots": TOY_SLOTS, "max_seq_len": TOY_S,
        "prefill": {"batch_sizes": [1, 2], "min_tokens": TOY_TMIN, "max_tokens": TOY_TMAX},
        "decode": {"batch_sizes": [1, 2, 4]},
        "state": [{"name": "kv", "shape": [TOY_SLOTS, TOY_S + 1, TOY_D], "dtype": "float32"},
                  {"name": "prev_tab", "shape": [TOY_SLOTS, TOY_S + 1, TOY_D], "dtype": "bfloat16"}],
        "functions": fns,
        "targets": {"llvm-cpu": {"vmfb": "model.llvm-cpu.vmfb", "flags": []}},
        "parameters": "model.irpa", "tokenizer": "tokenizer.json", "bos_token_id": 0, "eos_token_ids": [1],
        "export_id": export_id,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


@pytest.fixture(scope="session")
def toy_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_toy_export(tmp_path_factory.mktemp("toy_export"))


@pytest.fixture(scope="session")
def toy_model():
    return _toy_module()


@pytest.fixture(scope="session")
def toy_engine(toy_export: Path):
    """batch_invariant=False: these tests check the batched-prefill bookkeeping (several requests per
    prefill_bs{N} call); the default mode prefills each request alone (tests/test_batch_invariance.py)."""
    from dsv4.runtime.engine import Engine

    return Engine(toy_export, batch_invariant=False)


def _toy_eager_score(model, ids: list[int]) -> np.ndarray:
    import torch

    kv, last = _toy_state()
    i64 = lambda *v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    with torch.no_grad():
        lp = model.score(torch.tensor([ids]), i64(0), i64(len(ids)), i64(0), kv, last)
    return lp[0, :-1].double().numpy()


TOY_PROMPTS = [
    [0, 5, 6, 7, 8, 9, 10],  # one chunk
    [0, 7],  # shorter than min_tokens: padded
    [0] + list(range(2, 33)) + [4, 9, 12],  # 35 tokens: three chunks
    [0, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 2, 3, 4],  # 17: two chunks
    [9],
    [0, 3, 3, 3, 3, 3],
]


def test_toy_greedy_matches_eager(toy_engine, toy_model) -> None:
    for p in TOY_PROMPTS:
        n = min(20, TOY_S - len(p))
        got = toy_engine.generate(p, max_new_tokens=n, ignore_eos=True)
        assert got.tokens == _toy_eager_greedy(toy_model, p, n), p
        assert got.stop_reason == "length"
    assert toy_engine.slots.n_free == TOY_SLOTS  # every slot handed back


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_toy_batched_equals_solo(toy_engine, batch_invariant: bool) -> None:
    """Six requests on four slots: decode batches of 4/2/1 (padded), queued requests join as
    slots free up, slots are reused; every request gets the tokens it gets alone. Prefill: shared
    padded calls (batch_invariant=False) or one request per prefill_bs1 call (the default)."""
    params = [SamplingParams(max_new_tokens=min(12 + 3 * i, TOY_S - len(p)), ignore_eos=True)
              for i, p in enumerate(TOY_PROMPTS)]
    solo = [toy_engine.generate(p, sp).tokens for p, sp in zip(TOY_PROMPTS, params)]
    before = dict(toy_engine.stats)
    saved, toy_engine.batch_invariant = toy_engine.batch_invariant, batch_invariant
    try:
        batched = toy_engine.generate_batch(TOY_PROMPTS, params)
    finally:
        toy_engine.batch_invariant = saved
    assert [r.tokens for r in batched] == solo
    calls = toy_engine.stats["decode_calls"] - before["decode_calls"]
    rows = toy_engine.stats["decode_rows"] - before["decode_rows"]
    assert rows > 2 * calls  # really batched
    assert toy_engine.stats["decode_padded_rows"] > before["decode_padded_rows"]  # and padded
    # the first four were admitted together: prefilled two per prefill_bs2 call, chunk by chunk
    # (batch-invariant: one per call, every chunk of every prompt its own call)
    first = TOY_PROMPTS[:4]
    chunks = sum(max(-(-len(p) // TOY_TMAX) for p in first[k:k + 2]) for k in (0, 2))
    own = [-(-len(p) // TOY_TMAX) for p in TOY_PROMPTS]
    assert toy_engine.stats["prefill_rows"] - before["prefill_rows"] >= sum(own[:4])
    calls = toy_engine.stats["prefill_calls"] - before["prefill_calls"]
    if batch_invariant:
        assert calls == sum(own)
    else:
        assert calls <= chunks + len(TOY_PROMPTS) - 4


def test_toy_continuous_join(toy_engine) -> None:
    """A request that joins while another is mid-decode gets its solo tokens, and so does the other."""
    a, b = TOY_PROMPTS[0], TOY_PROMPTS[2]
    sa, sb = (toy_engine.generate(p, max_new_tokens=10, ignore_eos=True).tokens for p in (a, b))
    ra = toy_engine.submit(a, max_new_tokens=10, ignore_eos=True)
    for _ in range(4):
        toy_engine.step()
    rb = toy_engine.submit(b, max_new_tokens=10, ignore_eos=True)
    while toy_engine.has_work:
        toy_engine.step()
    assert toy_engine.result(ra).tokens == sa
    assert toy_engine.result(rb).tokens == sb


def test_toy_sampling_seeds(toy_engine) -> None:
    p = TOY_PROMPTS[0]
    sp = SamplingParams(max_new_tokens=25, temperature=1.5, top_k=20, top_p=0.95, seed=1234, ignore_eos=True)
    a = toy_engine.generate(p, sp)
    b = toy_engine.generate(p, sp)
    assert a.tokens == b.tokens and a.seed == 1234
    c = toy_engine.generate(p, replace(sp, seed=99))
    assert c.tokens != a.tokens
    # batched with other (greedy and sampled) requests: same tokens
    others = [SamplingParams(max_new_tokens=9, ignore_eos=True), replace(sp, seed=5)]
    res = toy_engine.generate_batch([TOY_PROMPTS[2], p, TOY_PROMPTS[3]], [others[0], sp, others[1]])
    assert res[1].tokens == a.tokens
    # unseeded requests report the seed that reproduces them
    d = toy_engine.generate(p, replace(sp, seed=None))
    assert toy_engine.generate(p, replace(sp, seed=d.seed)).tokens == d.tokens


def test_toy_slot_reuse_leaks_nothing(toy_engine, toy_model) -> None:
    # fill every slot with long histories, then run short prompts in the same slots
    toy_engine.generate_batch([list(range(2, 33)) + [5] * 10] * TOY_SLOTS,
                              SamplingParams(max_new_tokens=5, ignore_eos=True))
    for p in (TOY_PROMPTS[1], TOY_PROMPTS[4]):
        assert toy_engine.generate(p, max_new_tokens=10, ignore_eos=True).tokens == \
            _toy_eager_greedy(toy_model, p, 10)


def test_toy_score(toy_engine, toy_model) -> None:
    ids = TOY_PROMPTS[2]
    ref = _toy_eager_score(toy_model, ids)
    whole = toy_engine.score(ids)
    assert whole.logprobs[0] is None and len(whole.logprobs) == len(ids)
    np.testing.assert_allclose(whole.logprobs[1:], ref, atol=2e-4)
    assert whole.perplexity == pytest.approx(math.exp(-ref.mean()), rel=1e-4)
    for chunk in (3, 5, 7):  # overlapping chunks give the same numbers
        part = toy_engine.score(ids, max_chunk=chunk)
        np.testing.assert_allclose(part.logprobs[1:], whole.logprobs[1:], atol=2e-5)
    with pytest.raises(RequestError, match="at least 2 tokens"):
        toy_engine.score([5])


def test_toy_max_seq_len_stop(toy_engine) -> None:
    r = toy_engine.generate([2] * (TOY_S - 2), max_new_tokens=10, ignore_eos=True)
    assert r.stop_reason == "max_seq_len" and len(r.tokens) == 3
    r = toy_engine.generate([2] * TOY_S, max_new_tokens=10, ignore_eos=True)
    assert r.stop_reason == "max_seq_len" and len(r.tokens) == 1


def test_toy_stop_token_and_strings(toy_engine) -> None:
    p = "hello world"
    full = toy_engine.generate(p, max_new_tokens=30, ignore_eos=True)
    assert full.text == toy_engine.decode(full.tokens)
    t = full.tokens[4]
    r = toy_engine.generate(p, max_new_tokens=30, stop_token_ids=[t], ignore_eos=True)
    assert r.stop_reason == "stop_token" and r.tokens == full.tokens[:full.tokens.index(t) + 1]
    stop = full.text[6:8]
    cut = full.text.find(stop)
    chunks = list(toy_engine.stream(p, max_new_tokens=30, stop=[stop], ignore_eos=True))
    res = toy_engine.result(chunks[-1].request_id)
    assert res.stop_reason == "stop_string" and res.text == full.text[:cut]
    assert "".join(c.text for c in chunks) == res.text
    assert [c.token for c in chunks] == res.tokens
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    # streamed text of an unstopped run is the whole text
    chunks = list(toy_engine.stream(p, max_new_tokens=30, ignore_eos=True))
    assert "".join(c.text for c in chunks) == full.text
    # abandoning a stream releases its slot
    it = toy_engine.stream(p, max_new_tokens=30, ignore_eos=True)
    next(it), next(it)
    it.close()
    assert not toy_engine.has_work and toy_engine.slots.n_free == TOY_SLOTS


def test_toy_text_prompt_and_chat(toy_engine) -> None:
    assert toy_engine.encode("abc") == [0, 2, 3, 4]
    assert toy_engine.encode("abc", add_bos=False) == [2, 3, 4]
    ids = toy_engine.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == 0 and toy_engine.decode(ids) == "user, hi. assistant,"
    r = toy_engine.generate("hello", max_new_tokens=5, ignore_eos=True)
    assert r.prompt_tokens == toy_engine.encode("hello")


@pytest.mark.parametrize("prompt,kw,match", [
    ([], {}, "prompt is empty"),
    ("", {}, "prompt is empty"),
    ([0] * (TOY_S + 1), {}, "longer than max_seq_len 48"),
    ([0, -1], {}, r"invalid token id\(s\) \[-1\]"),
    ([0, TOY_V], {}, "invalid token id"),
    ([0, 1.5], {}, "invalid token id"),
    ([0, 2], {"top_p": 2.0}, "top_p"),
    ([0, 2], {"stop_token_ids": [999]}, "stop token id 999"),
])
def test_toy_request_errors(toy_engine, prompt, kw, match) -> None:
    with pytest.raises(RequestError, match=match):
        toy_engine.generate(prompt, **kw)
    assert not toy_engine.has_work


def test_toy_mismatched_artifacts(toy_export: Path, tmp_path: Path) -> None:
    import shutil

    from dsv4.runtime.engine import Engine

    d = tmp_path / "mixed"
    shutil.copytree(toy_export, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["export_id"] = "toy-9999"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ArtifactError, match="built by export toy-0001 but config.json is from export toy-9999"):
        Engine(d)
    cfg["export_id"] = TOY_EXPORT_ID
    cfg["functions"]["decode_bs8"] = cfg["functions"]["decode_bs1"]
    cfg["decode"]["batch_sizes"] = [1, 2, 4, 8]
    cfg["n_slots"] = 8
    for s in cfg["state"]:
        s["shape"][0] = 8
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ArtifactError, match="lacks function.*decode_bs8"):
        Engine(d)
    (d / "model.llvm-cpu.vmfb").write_bytes(b"not a vmfb")
    with pytest.raises(ArtifactError, match="model.llvm-cpu.vmfb: not a complete IREE module"):
        Engine(d)


def test_toy_cli(toy_export: Path, capsys) -> None:
    from dsv4.cli import main

    assert main(["generate", str(toy_export), "--prompt", "hello", "--max-new-tokens", "6", "--json",
                 "--ignore-eos"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["tokens"]) == 6 and out["stop_reason"] == "length" and isinstance(out["text"], str)
    assert out["ttft_s"] > 0 and out["tpot_s"] > 0
    assert main(["generate", str(toy_export), "--prompt-ids", "0,5,6", "--max-new-tokens", "4",
                 "--temperature", "1.0", "--seed", "3", "--top-k", "5", "--top-p", "0.9"]) == 0
    assert main(["score", str(toy_export), "--prompt-ids", "0,5,6,7", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["logprobs"][0] is None and len(out["logprobs"]) == 4 and out["perplexity"] > 1
    capsys.readouterr()
    assert main(["generate", str(toy_export), "--prompt-ids", "0,999"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid token id" in err[0]
    assert main(["generate", str(toy_export), "--prompt", ""]) == 2
    assert main(["generate", str(toy_export), "--prompt-ids", "1", "--device", "cuda"]) == 2
    assert "no cuda module" in capsys.readouterr().err


def test_toy_engine_runs_without_torch(toy_export: Path, toy_model) -> None:
    """The whole generate path in a process where torch and the IREE compiler cannot be imported."""
    p = TOY_PROMPTS[2]
    code = NO_TORCH_PRELUDE + textwrap.dedent(f"""
        from dsv4.runtime.engine import Engine
        e = Engine({str(toy_export)!r})
        print(e.generate({p!r}, max_new_tokens=10, ignore_eos=True).tokens)
        bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(('iree.compiler', 'iree.turbine'))]
        assert not bad, bad
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(_toy_eager_greedy(toy_model, p, 10))


