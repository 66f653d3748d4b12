"""The compiled MTP speculative entry points (mtp_prefill_bs1, verify_bs1_k2, verify_bs3_k2) against the
eager reference (model/speculative.py), greedy and sampled; verify's batch invariance (a row's results
bitwise the same beside other rows in one verify function; across verify_bs1_k2 and verify_bs3_k2 they
are not on llvm-cpu, a strict xfail); and the torch-free loop (runtime/speculative.py)
against plain greedy decoding. One small llvm-cpu export of the tiny preset in fp32, made with
--batch-invariant (slow: it compiles)."""

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
SPEC_ARGS = dict(targets=("llvm-cpu",), batch_sizes=(1,), decode_batch_sizes=(1, 3), n_slots=3, max_chunk=32,
                 score=False, draft_tokens=K, batch_invariant=True)
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


def _sampling(n: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, keys=None) -> tuple:
    """The speculative entry points' sampling inputs (numpy): greedy by default."""
    return (np.full(n, temperature, np.float32), np.full(n, top_k, np.int64), np.full(n, top_p, np.float32),
            np.zeros(n, np.int64) if keys is None else np.asarray(keys, np.int64))


def _torch(sampling: tuple) -> tuple:
    return tuple(torch.from_numpy(np.array(a)) for a in sampling)


def _prefill(mod, cfg, prompts) -> tuple[list, list, list, list]:
    """mtp_prefill_bs1 of prompt r into slot r of fresh device state (greedy): (state, chosen tokens,
    positions, drafts)."""
    dev = [mod.zeros(s) for s in cfg.state]
    nxt, pos, dr = [], [], []
    for r, p in enumerate(prompts):
        for s in range(0, len(p), 32):
            piece = p[s:s + 32]
            toks = np.zeros((1, max(len(piece), 16)), np.int64)
            toks[0, :len(piece)] = piece
            follow = int(p[s + 32]) if s + 32 < len(p) else -1
            args = [np.asarray(a, np.int64) for a in (toks, [s], [len(piece)], [r], [follow])]
            _, am, d = mod("mtp_prefill_bs1", *args, *_sampling(1), *dev)
        nxt.append(int(am[0]))
        pos.append(len(p))
        dr.append(np.asarray(d[0]).copy())
    return dev, nxt, pos, dr


def _check_state(dev, st) -> None:
    for (name, ref), d in zip(st.items(), dev):
        host, ref = d.to_host(), ref.numpy()
        if name.startswith(("kv_r", "idx_kv_r")):  # the scratch row (model/state.py)
            host, ref = host[:, :, :-1], ref[:, :, :-1]
        np.testing.assert_allclose(host, ref, atol=ATOL, rtol=RTOL, err_msg=f"state {name}")


def test_config_records_the_speculative_entry_points(art):
    mod, cfg = art
    assert cfg.speculative == {"method": "mtp", "draft_tokens": K, "prefill_batch_sizes": [1],
                               "verify_batch_sizes": [1, 3]}
    assert {"mtp_prefill_bs1", "verify_bs3_k2"} <= set(mod.function_names)
    assert cfg.speculative["verify_batch_sizes"] == [1, 3] and "verify_bs1_k2" in mod.function_names
    assert cfg.functions["mtp_prefill_bs1"]["args"][:9] == ["tokens", "start_pos", "lengths", "slots", "next_tokens",
                                                            "temperature", "top_k", "top_p", "key"]
    assert cfg.functions["verify_bs3_k2"]["args"][:8] == ["tokens", "start_pos", "lengths", "slots",
                                                          "temperature", "top_k", "top_p", "key"]


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
            lg, am, d = mod("mtp_prefill_bs1", *[np.asarray(a, np.int64) for a in args], *_sampling(1), *dev)
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
        lg, ch, acc, d = mod("verify_bs3_k2", *[np.asarray(a, np.int64) for a in args], *_sampling(3), *dev)
        with torch.no_grad():
            lg_e, ch_e, acc_e, d_e = verify(model, *_t(*args), st)
        assert acc_e.tolist() == want and acc.tolist() == want
        np.testing.assert_allclose(lg, lg_e.numpy(), atol=ATOL, rtol=RTOL)
        assert ch.tolist() == ch_e.tolist() and d.tolist() == d_e.tolist()
        _check_state(dev, st)
        for r in range(3):
            nxt[r], pos[r] = int(ch[r, want[r]]), pos[r] + want[r] + 1


def test_compiled_sampled_prefill_and_verify_match_eager(art):
    """The sampled token after each prompt (mtp_prefill_bs1 at temperature 0.9), then sampled rows (temperature 0.8 and 1.2 with top-k 20 / top-p 0.9, one greedy row) in verify_bs3_k2:
    the compiled call applies the speculative-sampling rule as the eager reference does with the same
    keys (chosen tokens, accepted counts, drafts, state), over steps that feed back its own output."""
    mod, cfg = art
    model = _model()
    st = new_state(model.cfg, 3, torch.float32)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 512, n) for n in (17, 30, 45)]
    dev = [mod.zeros(s) for s in cfg.state]
    nxt, pos, dr = [], [], []
    for r, p in enumerate(prompts):  # the chunk that ends a prompt samples its token (temperature 0.9)
        for s in range(0, len(p), 32):
            piece = p[s:s + 32]
            toks = np.zeros((1, max(len(piece), 16)), np.int64)
            toks[0, :len(piece)] = piece
            follow = int(p[s + 32]) if s + 32 < len(p) else -1
            samp = _sampling(1, 0.9 if follow < 0 else 0.0, keys=rng.integers(0, 2**32, 1))
            args = [np.asarray(a, np.int64) for a in (toks, [s], [len(piece)], [r], [follow])]
            lg, am, d = mod("mtp_prefill_bs1", *args, *samp, *dev)
            with torch.no_grad():
                lg_e, am_e, d_e = mtp_prefill(model, *_t(*args[:4]), st, *_t(args[4]), K, _torch(samp))
            np.testing.assert_allclose(lg, lg_e.numpy(), atol=ATOL, rtol=RTOL)
            assert am.tolist() == am_e.tolist() and d.tolist() == d_e.tolist()
        nxt.append(int(am[0]))
        pos.append(len(p))
        dr.append(np.asarray(d[0]).copy())
    _check_state(dev, st)
    for step in range(5):
        toks = np.array([[nxt[r], *dr[r]] for r in range(3)], np.int64)
        samp = (np.array([0.8, 1.2, 0.0], np.float32), np.array([20, 0, 0], np.int64),
                np.array([1.0, 0.9, 1.0], np.float32), rng.integers(0, 2**32, 3))
        args = [np.asarray(a, np.int64) for a in (toks, pos, [1 + K] * 3, [0, 1, 2])]
        lg, ch, acc, d = mod("verify_bs3_k2", *args, *samp, *dev)
        with torch.no_grad():
            lg_e, ch_e, acc_e, d_e = verify(model, *_t(*args), st, sampling=_torch(samp))
        np.testing.assert_allclose(lg, lg_e.numpy(), atol=ATOL, rtol=RTOL)
        assert ch.tolist() == ch_e.tolist() and acc.tolist() == acc_e.tolist() and d.tolist() == d_e.tolist()
        _check_state(dev, st)
        for r in range(3):
            a = int(acc[r])
            nxt[r], pos[r], dr[r] = int(ch[r, a]), pos[r] + a + 1, np.asarray(d[r]).copy()


def _verify_rows(mod, cfg, prompts, temperature: float, batch: bool, steps: int = 2, seed: int = 9) -> tuple:
    """Two verify steps of the three prompts from a fresh prefill: in one verify_bs3_k2 call per step
    (batch), or each row alone in verify_bs3_k2 beside two padding rows (not batch). Returns (per step
    the [logits, chosen, accepted, drafts] of the three rows, the final device state)."""
    rng = np.random.default_rng(seed)
    dev, nxt, pos, dr = _prefill(mod, cfg, prompts)
    out = []
    for _ in range(steps):
        keys = rng.integers(0, 2**32, 3)
        rows = [[nxt[r], *dr[r]] for r in range(3)]
        if batch:
            args = [np.asarray(a, np.int64) for a in (rows, pos, [1 + K] * 3, [0, 1, 2])]
            res = [np.asarray(x).copy() for x in mod("verify_bs3_k2", *args, *_sampling(3, temperature, keys=keys),
                                                     *dev)]
        else:
            per = []
            for r in range(3):
                args = [np.asarray(a, np.int64) for a in ([rows[r], [0] * (1 + K), [0] * (1 + K)], [pos[r], 0, 0],
                                                          [1 + K, 0, 0], [r, *[s for s in range(3) if s != r]])]
                got = mod("verify_bs3_k2", *args, *_sampling(3, temperature, keys=[keys[r], 0, 0]), *dev)
                per.append([np.asarray(x)[0].copy() for x in got])
            res = [np.stack([p[i] for p in per]) for i in range(4)]
        out.append(res)
        for r in range(3):
            a = int(res[2][r])
            nxt[r], pos[r], dr[r] = int(res[1][r, a]), pos[r] + a + 1, res[3][r].copy()
    return out, [d.to_host().copy() for d in dev]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_verify_row_does_not_depend_on_the_other_rows(art, temperature):
    """In one verify function (verify_bs3_k2) a row's results are bitwise the same beside two other
    requests and beside two padding rows, from the same state, for two steps (after different accepted
    counts): logits, chosen tokens, accepted count, drafts (sampled rows with the same keys), and the
    state they leave."""
    mod, cfg = art
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 512, n) for n in (19, 33, 26)]
    batched, st_b = _verify_rows(mod, cfg, prompts, temperature, batch=True)
    alone, st_a = _verify_rows(mod, cfg, prompts, temperature, batch=False)
    for step, (x, y) in enumerate(zip(alone, batched)):
        for name, a, b in zip(("logits", "chosen", "accepted", "drafts"), x, y):
            assert np.array_equal(a, b), f"step {step}: {name} differs"
    for spec, a, b in zip(cfg.state, st_a, st_b):
        assert np.array_equal(a, b), f"state {spec.name} differs"


def _bs1_and_bs3(mod, cfg) -> tuple[list, list]:
    """Row 0's verify results alone in verify_bs1_k2 and beside two other rows in verify_bs3_k2, from
    the same state (greedy)."""
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 512, n) for n in (19, 33, 26)]
    dev_b, nxt, pos, dr = _prefill(mod, cfg, prompts)
    dev_a = _prefill(mod, cfg, prompts)[0]
    rows = [[nxt[r], *dr[r]] for r in range(3)]
    args = [np.asarray(a, np.int64) for a in (rows, pos, [1 + K] * 3, [0, 1, 2])]
    batched = [np.asarray(x)[0].copy() for x in mod("verify_bs3_k2", *args, *_sampling(3), *dev_b)]
    one = [np.asarray(a, np.int64) for a in (rows[:1], pos[:1], [1 + K], [0])]
    alone = [np.asarray(x)[0].copy() for x in mod("verify_bs1_k2", *one, *_sampling(1), *dev_a)]
    return alone, batched


def test_verify_bs1_and_bs3_agree_up_to_rounding(art):
    """verify_bs1_k2 and verify_bs3_k2 compute the same thing for a row: logits within rounding, the
    same tokens, accepted count and drafts."""
    alone, batched = _bs1_and_bs3(*art)
    np.testing.assert_allclose(alone[0], batched[0], rtol=0, atol=1e-5)
    for name, a, b in zip(("chosen", "accepted", "drafts"), alone[1:], batched[1:]):
        assert np.array_equal(a, b), name


def test_verify_is_batch_invariant_across_batch_sizes(art):
    """A row verified alone in verify_bs1_k2 and beside two others in verify_bs3_k2: bitwise the same
    logits."""
    alone, batched = _bs1_and_bs3(*art)
    assert np.array_equal(alone[0], batched[0])


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
    packed = Engine(spec_export, batch_invariant=False)  # the default Engine verifies one request per call
    spec = packed.generate_batch(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True, speculative=True)
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


def test_verify_cost_profiles_a_decode_and_a_verify_call(spec_export):
    """`python -m dsv4.bench.verify_cost --profile`: IREE's HAL profiling (host-execution on local-task)
    of decode_bs{N} and verify_bs{N}_k{K}, fed the verify's sampling arguments; a verify call of 1 + K
    tokens runs more dispatches than a decode call of one."""
    from dsv4.bench.verify_cost import open_export, profile

    got = profile(open_export(str(spec_export), "local-task"), [1, 3], context=8)
    assert [k for k, _ in got] == ["decode", "verify", "decode", "verify"]
    for (kind, p), n in zip(got, (1, 1, 3, 3)):
        assert p["available"], p
        assert p["function"] == (f"decode_bs{n}" if kind == "decode" else f"verify_bs{n}_k{K}")
        assert p["tokens"] == (1 if kind == "decode" else 1 + K) and p["calls"] >= 1 and p["top"]
    assert got[1][1]["dispatches_per_step"] > got[0][1]["dispatches_per_step"]
