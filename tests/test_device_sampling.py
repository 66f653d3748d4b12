"""Sampling inside the module (model/device_sampling.py, the `sample_bs{N}` entry points).

References: a numpy uint32 implementation of the counter hash, a float64 sort-based filter + Gumbel
draw, and the host sampler's float64 distribution (runtime/sampling.sampling_distribution) for the
frequencies. The compiled function (tiny export, llvm-cpu) is checked in tests/test_engine_tiny.py,
beside the other tests of that export: against this torch function, and the engine's device-sampled
tokens against an eager loop that samples with the float64 reference here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4.model.device_sampling import hash_uniform, sample
from dsv4.runtime.sampling import SamplingParams, sampling_distribution


def _mix32(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def ref_uniform(key: int, n: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = _mix32(_mix32(np.array([key & 0xFFFFFFFF], np.uint64)).astype(np.uint64) + np.arange(n, dtype=np.uint64))
    return ((h >> np.uint32(9)).astype(np.float64) + 0.5) / 2**23


def ref_sample(x: np.ndarray, temperature: float, top_k: int, top_p: float, key: int) -> int:
    """float64: sort, keep the top k, then the smallest prefix whose mass reaches top_p, Gumbel-max."""
    x = np.asarray(x, np.float64)
    if temperature <= 0:
        return int(np.argmax(x))
    xs = x / temperature
    order = np.argsort(-xs, kind="stable")
    if 0 < top_k < x.size:
        order = order[:top_k]
    p = np.exp(xs[order] - xs[order[0]])
    p /= p.sum()
    if top_p < 1.0:
        order = order[:int(np.searchsorted(np.cumsum(p), top_p, side="left")) + 1]
    g = -np.log(-np.log(ref_uniform(key, x.size)))
    return int(order[np.argmax(xs[order] + g[order])])


def _t(*a):
    return [torch.as_tensor(v) for v in a]


@pytest.mark.parametrize("key", [0, 1, 12345, 2**32 - 1, 2**40 + 7])
def test_hash_matches_numpy_uint32(key: int) -> None:
    got = hash_uniform(torch.tensor([key]), 5000)[0].double().numpy()
    np.testing.assert_array_equal(got, ref_uniform(key, 5000))
    assert 0 < got.min() and got.max() < 1


def test_ids_match_the_float64_reference() -> None:
    g = np.random.default_rng(0)
    n, v = 400, 300
    x = (g.standard_normal((n, v)) * 2.5).astype(np.float32)
    temp = g.choice([0.0, 0.5, 1.0, 1.7], n).astype(np.float32)
    top_k = g.choice([0, 1, 5, 40, v, v + 9], n)
    top_p = g.choice([1.0, 0.95, 0.7, 0.3], n).astype(np.float32)
    key = g.integers(0, 2**32, n)
    got = sample(*_t(x, temp, top_k, top_p, key)).numpy()
    ref = [ref_sample(x[i], float(temp[i]), int(top_k[i]), float(top_p[i]), int(key[i])) for i in range(n)]
    assert got.tolist() == ref


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 3, 1.0), (1.4, 0, 0.8), (1.0, 5, 0.6)])
def test_frequencies_follow_the_distribution(temperature: float, top_k: int, top_p: float) -> None:
    n = 40000
    x = torch.tensor([[1.2, -0.3, 2.0, 0.1, -1.5, 0.8, 1.9, -0.7]])
    ids = sample(x.expand(n, -1), torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p),
                 torch.arange(n) * 7919 + 3)
    count = np.bincount(ids.numpy(), minlength=8)
    p = sampling_distribution(x[0].numpy(), temperature, top_k, top_p)
    assert (count[p == 0] == 0).all()
    e = p[p > 0] * n
    chi2 = float(((count[p > 0] - e) ** 2 / e).sum())
    assert chi2 < 30, (chi2, count, e)  # <= 7 degrees of freedom: p ~ 1e-4


def test_greedy_rows_ties_and_thresholds() -> None:
    x = torch.tensor([[0.5, 2.0, 2.0, -1.0], [0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 1.0, 1.0]])
    ids = sample(x, torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0, 1, 0]), torch.tensor([1.0, 1.0, 1.0]),
                 torch.tensor([5, 5, 5]))
    assert ids[:2].tolist() == [1, 1]  # greedy and top_k 1: the first maximum
    # top_k 2 with three tokens tied at the 2nd value: every tied token stays (the documented rule)
    n = 3000
    ids = sample(x[2:].expand(n, -1), torch.full((n,), 1.0), torch.full((n,), 2), torch.ones(n), torch.arange(n))
    assert set(ids.tolist()) == {0, 1, 2, 3}


def test_rows_with_nan_or_inf_give_minus_one() -> None:
    x = torch.randn(4, 50)
    x[1, 7] = float("nan")
    x[2, 3] = float("inf")
    ids = sample(x, torch.tensor([0.0, 0.0, 1.0, 1.0]), torch.zeros(4, dtype=torch.long), torch.ones(4),
                 torch.arange(4))
    assert ids[1] == -1 and ids[2] == -1 and ids[0] == int(x[0].argmax()) and 0 <= ids[3] < 50


def ref_threshold(key: np.ndarray, weight: np.ndarray, need: float, bits: int) -> int:
    """The largest t in [0, 2^bits) with sum(weight[key >= t]) >= need, by brute force over the
    row's own keys (the sum only changes at them): 0 when even t = 0 falls short."""
    best = 0 if weight.sum() < need else None
    for v in np.unique(key):
        if weight[key >= v].sum() >= need:
            best = int(v) if best is None else max(best, int(v))
    if need <= 0:
        best = 2**bits - 1
    return best


def test_threshold_bisection_matches_brute_force() -> None:
    """The top-k / top-p threshold search: counts (top-k: weight 1) and masses (top-p), with tied
    keys, zero weights, and `need` at, between and beyond the steps of the sum; rows of 40 (one
    piece) and of 1,000 (15 pieces of 67, the last one padded)."""
    from dsv4.model.device_sampling import _pieces, _threshold

    assert _pieces(torch.zeros(2, 1000), 0.0).shape == (2, 15, 67)
    g = np.random.default_rng(0)
    for bits, v in ((32, 40), (31, 40), (9, 40), (32, 1000), (31, 1000)):
        key = g.integers(0, 2**bits, (6, v))
        key[:, 20:30] = key[:, :10]  # ties
        key[5] = g.integers(0, 4, v)  # a row of few distinct keys
        # multiples of 1/64: every sum is exact in float32 and float64 alike, so `need` can sit exactly on a step
        weight = (g.integers(1, 64, (6, v)) / 64).astype(np.float32)
        weight[:, ::7] = 0.0
        ones = np.ones_like(weight)
        for w in (ones, weight):
            tot = w.sum(1)
            need = np.stack([np.float32(0.0) * tot, np.float32(1.0) + 0 * tot, np.float32(0.5) * tot,
                             tot, tot + 1]).astype(np.float32).T  # [6, 5]
            for j in range(need.shape[1]):
                got = _threshold(torch.from_numpy(key), torch.from_numpy(w), torch.from_numpy(need[:, j:j + 1]), bits)
                want = [ref_threshold(key[r], w[r].astype(np.float64), float(need[r, j]), bits) for r in range(6)]
                assert got[:, 0].tolist() == want, (bits, j)
