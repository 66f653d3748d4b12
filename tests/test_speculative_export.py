"""The compiled MTP speculative entry points (mtp_prefill_bs1, verify_bs3_k2) against the eager
reference (model/speculative.py), and the torch-free loop (runtime/speculative.py) against plain
greedy decoding. One small llvm-cpu export of the tiny preset in fp32 (slow: it compiles)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import cached_export
from dsv4.contract.artifact import ExportConfig
from dsv4.model.config import ModelConfig
from dsv4.model.generate import greedy
from dsv4.model.model import Transformer, init_random
from dsv4.model.speculative import mtp_prefill, verify
from dsv4.model.state import new_state
from dsv4.runtime.module import IreeModule, ensure_runtime_flags
from dsv4.runtime.speculative import speculative_greedy

ensure_runtime_flags()
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

K = 2
SPEC_ARGS = dict(targets=("llvm-cpu",), batch_sizes=(1,), decode_batch_sizes=(3,), n_slots=3, max_chunk=32,
                 score=False, draft_tokens=K)
ATOL = RTOL = 2e-4


def _model() -> Transformer:
    cfg = ModelConfig.preset("tiny").replace(quant_sim=False)
    return init_random(Transformer(cfg, dtype=torch.float32), seed=0).eval()


@pytest.fixture(scope="module")
def spec_export() -> Path:
    from dsv4.export.exporter import ExportSpec, export_model

    def build(out: Path) -> None:
        export_model(_model(), ExportSpec(**SPEC_ARGS), out, progress=print)

    return cached_export("tiny-spec", build, [_model().cfg.to_dict(), sorted(SPEC_ARGS.items())])


@pytest.fixture(scope="module")
def art(spec_export: Path) -> tuple[IreeModule, ExportConfig]:
    cfg = ExportConfig.load(spec_export)
    return IreeModule(cfg.vmfb_path("llvm-cpu"), cfg.parameters_for("llvm-cpu")), cfg


def _t(*a) -> list[torch.Tensor]:
    return [torch.as_tensor(np.asarray(x), dtype=torch.int64) for x in a]


def _check_state(dev, st) -> None:
    for (name, ref), d in zip(st.items(), dev):
        host, ref = d.to_host(), ref.numpy()
        if name.startswith(("kv_r", "idx_kv_r")):  # the scratch row (model/state.py)
            host, ref = host[:, :, :-1], ref[:, :, :-1]
        np.testing.assert_allclose(host, ref, atol=ATOL, rtol=RTOL, err_msg=f"state {name}")


def test_config_records_the_speculative_entry_points(art):
    mod, cfg = art
    assert cfg.speculative == {"method": "mtp", "draft_tokens": K, "prefill_batch_sizes": [1],
                               "verify_batch_sizes": [3]}
    assert {"mtp_prefill_bs1", "verify_bs3_k2"} <= set(mod.function_names)
    assert cfg.functions["mtp_prefill_bs1"]["args"][:5] == ["tokens", "start_pos", "lengths", "slots", "next_tokens"]


def test_compiled_draft_and_verify_match_eager(art):
    """Three prompts prefilled (one in two chunks), then verify calls whose rows accept 0, 1 and 2
    drafts in turn (drafts made from the eager greedy path, one replaced): logits, chosen tokens,
    accepted counts, drafts and the state against eager after every call."""
    mod, cfg = art
    model = _model()
    st = new_state(model.cfg, 3, torch.float32)
    dev = [mod.zeros(s) for s in cfg.state]
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 512, n) for n in (17, 30, 45)]
    nxt, pos, dr = [], [], []
    for r, p in enumerate(prompts):
        for s in range(0, len(p), 32):
            piece = p[s:s + 32]
            toks = np.zeros((1, max(len(piece), 16)), np.int64)
            toks[0, :len(piece)] = piece
            follow = int(p[s + 32]) if s + 32 < len(p) else -1
            args = (toks, [s], [len(piece)], [r], [follow])
            lg, am, d = mod("mtp_prefill_bs1", *[np.asarray(a, np.int64) for a in args], *dev)
            with torch.no_grad():
                t, st_, ln, sl, nx = _t(*args)
                lg_e, am_e, d_e = mtp_prefill(model, t, st_, ln, sl, st, nx, K)
            np.testing.assert_allclose(lg, lg_e.numpy(), atol=ATOL, rtol=RTOL)
            assert am.tolist() == am_e.tolist() and d.tolist() == d_e.tolist()
        _check_state(dev, st)
        nxt.append(int(am[0]))
        pos.append(len(p))
        dr.append(d[0])
    for step in range(4):
        want = [(step + r) % (K + 1) for r in range(3)]
        toks = np.zeros((3, 1 + K), np.int64)
        for r in range(3):  # the eager greedy path from this row's next token, then replace draft want[r]
            toks[r, 0] = nxt[r]
            for i in range(K):
                probe = {n: v.clone() for n, v in st.items()}
                with torch.no_grad():
                    _, ch, _, _ = verify(model, torch.tensor(toks[r:r + 1]), torch.tensor([pos[r]]),
                                         torch.tensor([1 + K]), torch.tensor([r]), probe)
                toks[r, 1 + i] = int(ch[0, i]) if i < want[r] else (int(ch[0, i]) + 1) % 512
        args = (toks, pos, [1 + K] * 3, [0, 1, 2])
        lg, ch, acc, d = mod("verify_bs3_k2", *[np.asarray(a, np.int64) for a in args], *dev)
        with torch.no_grad():
            lg_e, ch_e, acc_e, d_e = verify(model, *_t(*args), st)
        assert acc_e.tolist() == want and acc.tolist() == want
        np.testing.assert_allclose(lg, lg_e.numpy(), atol=ATOL, rtol=RTOL)
        assert ch.tolist() == ch_e.tolist() and d.tolist() == d_e.tolist()
        _check_state(dev, st)
        for r in range(3):
            nxt[r], pos[r] = int(ch[r, want[r]]), pos[r] + want[r] + 1


def test_runtime_loop_gives_plain_greedy_tokens(art):
    mod, cfg = art
    model = _model()
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 512, n).tolist() for n in (20, 40)]
    got, stats = speculative_greedy(mod, cfg, prompts, 8)
    assert got == [greedy(model, p, 8) for p in prompts]
    assert stats["prefill_calls"] == 3 and stats["verify_calls"] >= 1


def test_engine_and_cli_speculative_give_plain_greedy_tokens(spec_export, capsys):
    """`Engine` with SamplingParams(speculative=True), alone and batched (one verify_bs3_k2 call per
    step for rows accepting different counts), and `dsv4 generate --speculative mtp --json`: the tokens
    of plain greedy decoding (prefill_bs1 / decode_bs3 on the same export) and consistent counts."""
    import json

    from dsv4.cli import main
    from dsv4.runtime.engine import Engine
    from dsv4.runtime.sampling import SamplingParams

    eng = Engine(spec_export)
    assert eng.draft_tokens == K
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 512, n).tolist() for n in (9, 40, 23)]
    n_new = [12, 10, 7]
    plain = eng.generate_batch(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in n_new])
    spec = eng.generate_batch(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True, speculative=True)
                                        for n in n_new])
    alone = [eng.generate(p, SamplingParams(max_new_tokens=n, ignore_eos=True, speculative=True))
             for p, n in zip(prompts, n_new)]
    assert [r.tokens for r in spec] == [r.tokens for r in alone] == [r.tokens for r in plain]
    for r in spec + alone:
        assert len(r.tokens) == 1 + r.decode_calls + r.accepted and 0 <= r.accepted <= r.drafted
    assert [r.decode_calls for r in plain] == [n - 1 for n in n_new]
    ids = ",".join(map(str, prompts[1]))
    argv = ["generate", str(spec_export), "--prompt-ids", ids, "--max-new-tokens", "10", "--ignore-eos", "--json"]
    assert main([*argv, "--speculative", "mtp", "--draft-tokens", str(K)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == plain[1].tokens
    assert out["decode_calls"] == 9 - out["accepted"] and out["acceptance_rate"] == out["accepted"] / out["drafted"]
