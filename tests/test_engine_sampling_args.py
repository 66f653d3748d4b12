"""What the Engine hands the export's device sampler (runtime/engine.py `_sample_on_device`), with a
fake module object in place of the compiled one (the seam: engine.IreeModule): for each call of
``sample_bs{N}``, row k carries the request's temperature, top_k and top_p, and a key that is the
next 32-bit draw of the request's own seeded generator; padding rows and greedy requests sample
nothing (temperature 0, top_k 0, top_p 1); the ids the sampler returns are the tokens generated.
The reference draws are numpy's PCG64 seeded by the request's seed, independent of the Engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dsv4.contract.artifact import build_config, write_config
from dsv4.runtime import engine as engine_mod
from dsv4.runtime.sampling import SamplingParams

V = 32  # vocab
PREFILL_BS, DECODE_BS = 1, 4


class _Host:
    """A device array stand-in: `.to_host()` is what the Engine reads."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def to_host(self) -> np.ndarray:
        return self.a


class FakeModule:
    """The compiled module's interface as the Engine uses it; records every sampler call. The
    model's logits favour token 1 (greedy requests generate 1s); the sampler answers
    3 + key % (V - 3), so a sampled token shows which key it came from."""

    instances: list["FakeModule"] = []

    def __init__(self, vmfb, parameters=None, **kw) -> None:
        self.function_names = [f"prefill_bs{PREFILL_BS}", f"decode_bs{DECODE_BS}", f"sample_bs{PREFILL_BS}",
                               f"sample_bs{DECODE_BS}"]
        self.sample_calls: list[tuple[int, dict[str, np.ndarray]]] = []
        FakeModule.instances.append(self)

    def read_export_id(self) -> None:
        return None

    def zeros(self, spec) -> _Host:
        return _Host(np.zeros(spec.shape, np.float32))

    def function(self, name: str):
        bs = int(name.rsplit("bs", 1)[1])
        if name.startswith("sample_"):
            def sample(logits, temperature, top_k, top_p, key):
                assert isinstance(logits, _Host) and logits.a.shape == (bs, V)  # still the device logits
                self.sample_calls.append((bs, {"temperature": temperature.copy(), "top_k": top_k.copy(),
                                               "top_p": top_p.copy(), "key": key.copy()}))
                return _Host(np.where(temperature > 0, 3 + key % (V - 3), 0).astype(np.int64))
            return sample

        def step(tokens, start_pos, lengths, slots, *state):
            logits = np.zeros((bs, V), np.float32)
            logits[:, 1] = 5.0
            return _Host(logits), _Host(np.ones(bs, np.int64))
        return step


@pytest.fixture
def engine(tmp_path: Path, monkeypatch):
    state = [{"name": "kv", "shape": [4, 8], "dtype": "float32"}]
    raw = build_config(model={"vocab_size": V}, activation_dtype="float32", n_slots=4, max_seq_len=64,
                       prefill_batch_sizes=[PREFILL_BS], min_tokens=1, max_tokens=16,
                       decode_batch_sizes=[DECODE_BS], score_batch_sizes=[], state=state,
                       targets={"llvm-cpu": {"vmfb": "model.llvm-cpu.vmfb"}}, parameters="model.irpa",
                       tokenizer=None, bos_token_id=None, eos_token_ids=[], export_id="fake",
                       extra_functions={f"sample_bs{n}": {"args": ["logits", "temperature", "top_k", "top_p", "key"],
                                                          "results": ["ids"]} for n in (PREFILL_BS, DECODE_BS)})
    write_config(tmp_path, raw)
    (tmp_path / "model.llvm-cpu.vmfb").write_bytes(b"")
    (tmp_path / "model.irpa").write_bytes(b"")
    FakeModule.instances.clear()
    monkeypatch.setattr(engine_mod, "IreeModule", FakeModule)
    eng = engine_mod.Engine(tmp_path)
    assert FakeModule.instances and eng.module is FakeModule.instances[-1]
    return eng


REQUESTS = [
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=11, max_new_tokens=4),
    SamplingParams(temperature=0.0, max_new_tokens=4),  # greedy: never sampled on the device
    SamplingParams(temperature=1.3, top_k=0, top_p=0.35, seed=12, max_new_tokens=4),
]


def test_engine_passes_each_requests_sampling_arguments_to_the_device_sampler(engine) -> None:
    ids = [engine.submit([5, 6, 7], p) for p in REQUESTS]
    while engine.has_work:
        engine.step()
    results = {i: engine.result(i) for i in ids}
    calls = engine.module.sample_calls
    # prefill: one sample call per sampled request (prefill_bs1); decode: 3 steps, each one
    # decode_bs4 call holding the three requests (row = admission order) and a padding row
    assert [bs for bs, _ in calls] == [1, 1, 4, 4, 4]
    keys = {i: np.random.Generator(np.random.PCG64(p.seed)).integers(0, 2**32, 4) if p.seed else None
            for i, p in zip(ids, REQUESTS)}
    got_keys: dict[int, list[int]] = {ids[0]: [], ids[2]: []}
    for (bs, a), rows in zip(calls, ([ids[0]], [ids[2]], ids, ids, ids)):
        for k in range(bs):
            rid = rows[k] if k < len(rows) else None
            p = REQUESTS[ids.index(rid)] if rid is not None else None
            if p is None or p.temperature == 0:  # padding row or greedy request: no sampling
                assert (a["temperature"][k], a["top_k"][k], a["top_p"][k], a["key"][k]) == (0, 0, 1, 0), (bs, k)
                continue
            assert a["temperature"][k] == np.float32(p.temperature), (bs, k)
            assert a["top_k"][k] == p.top_k, (bs, k)
            assert a["top_p"][k] == np.float32(p.top_p), (bs, k)
            got_keys[rid].append(int(a["key"][k]))
        assert a["temperature"].dtype == np.float32 and a["top_p"].dtype == np.float32
        assert a["top_k"].dtype == np.int64 and a["key"].dtype == np.int64
    for rid in (ids[0], ids[2]):
        assert got_keys[rid] == [int(x) for x in keys[rid]], rid
        # the tokens are the ones the device sampler chose
        assert results[rid].tokens == [3 + int(x) % (V - 3) for x in keys[rid]]
        assert results[rid].seed == REQUESTS[ids.index(rid)].seed
    assert results[ids[1]].tokens == [1, 1, 1, 1]
    assert engine.stats["device_samples"] == 8


def test_without_device_sampling_the_sampler_is_never_called(tmp_path: Path, engine) -> None:
    engine.device_sampling = False
    i = engine.submit([5, 6], REQUESTS[0])
    while engine.has_work:
        engine.step()
    assert engine.module.sample_calls == [] and len(engine.result(i).tokens) == 4
