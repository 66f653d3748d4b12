"""Random weights for an export, torch-free (numpy + iree.runtime): `dsv4 weights random OUT`.

Reads OUT/config.json (its ``weights`` inventory and ``model`` config) and writes every weight file
it names, one tensor at a time (`write_random_weights`), so a GPU host makes its own 100 GB of
weights instead of receiving them. Values follow the init's rules (`init_rule`, the one definition,
which the torch `model.init_random` uses too):

* float weights ~ N(0, 0.02) (float32, or bfloat16 rounded to nearest even); RMSNorm weights and
  ``hc_*_scale`` = 1; ``*_base``, ``attn_sink``, ``ape``, ``bias`` = 0; hash routing ``tid2eid``:
  per token, `num_experts_per_tok` distinct experts drawn uniformly;
* FP8 weights: codes drawn from N(0, 0.02) rounded to the e4m3fn grid at block scale 2^-12 (what
  quantizing N(0, 0.02) per 128x128 block gives: amax ~0.09, /448 -> 2^-12), so codes reach ~350
  of 448. Never a NaN code, never 0x80 (-0 in e4m3fn, NaN in e4m3fnuz): the e4m3fnuz flavour has
  the same bytes with the scale doubled (formats.fp8_fn_to_fnuz), so both hold the same values;
* MXFP4 experts: E2M1 nibbles drawn from N(0, 0.02) rounded to the E2M1 grid at scale 2^-7 per 32
  (amax ~0.045, /6 -> 2^-7), packed two per byte (low nibble first), never -0.
The code distributions are sampled through 65536-entry byte tables, tuned so weight x scale has
std 0.02 (FP8 0.0200, MXFP4 0.0200), which keeps ~150 GB of Flash within minutes.

Each tensor draws from its own generator, seeded by (seed, tensor name): the same seed gives the
same values in every flavour, in any shard split, on any host.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .artifact import FP8_DTYPES, ExportConfig, TensorSpec, shard_tensors, whole_inventory, write_config
from .errors import ArtifactError
from .weights import Tensor, checked, plan_shards, storage_dtype, write_shards

__all__ = ["INIT_STD", "bf16_bits", "init_rule", "weight_of_scale", "random_tensors", "write_random_weights", "fp8_values", "E2M1",
           "FP8_SCALE_EXP", "MXFP4_SCALE_EXP"]

INIT_STD = 0.02
FP8_SCALE_EXP = -12  # e4m3fn block scale 2^-12 (e4m3fnuz: 2^-11)
MXFP4_SCALE_EXP = -7  # MXFP4 per-32 scale 2^-7
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)
_CHUNK = 1 << 20  # elements generated at a time (bounds the temporaries)


def init_rule(name: str) -> str:
    """How a parameter is initialized, from its name alone: "tid2eid", "ones", "zeros" or "normal"
    (the block scales of low-bit weights are the generator's business, not a rule's)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":
        return "tid2eid"
    if name.endswith("norm.weight") or (leaf.startswith("hc_") and leaf.endswith("_scale")):
        return "ones"
    if leaf.endswith("_base") or leaf in ("attn_sink", "ape", "bias"):
        return "zeros"
    return "normal"


def weight_of_scale(name: str) -> str | None:
    """The low-bit weight a block-scale parameter belongs to (``X.scale`` -> ``X.weight``,
    ``experts.w1_scale`` -> ``experts.w1``), or None."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "scale":
        return name[: -len("scale")] + "weight"
    if leaf.endswith("_scale") and not leaf.startswith("hc_"):
        return name[: -len("_scale")]
    return None


# ------------------------------------------------------------------------------------------------
# code tables: uniform uint16 -> a byte with the wanted distribution
# ------------------------------------------------------------------------------------------------


def fp8_values(fnuz: bool = False) -> np.ndarray:
    """float64 value of each of the 256 e4m3fn (or e4m3fnuz) codes; NaN codes are NaN."""
    b = np.arange(256)
    e, m = (b >> 3) & 15, b & 7
    bias = 8 if fnuz else 7
    mag = np.where(e == 0, m * 2.0 ** (1 - bias - 3), (1 + m / 8) * 2.0 ** (e - bias))
    v = np.where(b & 0x80, -mag, mag)
    nan = (b == 0x80) if fnuz else ((b & 0x7F) == 0x7F)
    return np.where(nan, np.nan, v)


def _rounded_normal(values: np.ndarray, allowed: np.ndarray, sigma: float) -> np.ndarray:
    """P(code) for N(0, sigma) rounded to the nearest allowed code value (saturating at the ends)."""
    idx = np.flatnonzero(allowed)
    order = idx[np.argsort(values[idx], kind="stable")]
    v = values[order]
    edges = np.concatenate([[-np.inf], (v[1:] + v[:-1]) / 2, [np.inf]])
    cdf = np.array([0.5 * (1 + math.erf(x / (sigma * math.sqrt(2)))) for x in edges])
    p = np.zeros(len(values))
    p[order] = np.diff(cdf)
    return p


def _byte_table(p: np.ndarray) -> np.ndarray:
    """65536-entry uint8 table whose entries follow the byte distribution p (256 probabilities)."""
    counts = np.diff(np.round(np.cumsum(p) / p.sum() * 65536).astype(np.int64), prepend=0)
    return np.repeat(np.arange(256, dtype=np.uint8), counts)


def _tuned(make: Callable[[float], np.ndarray], std_of: Callable[[np.ndarray], float], target: float) -> np.ndarray:
    """The table make(sigma) whose realized std is `target` (bisection on sigma)."""
    lo, hi = target / 4, target * 4
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if std_of(make(mid)) < target else (lo, mid)
    return make((lo + hi) / 2)


@lru_cache(maxsize=None)
def _fp8_table() -> np.ndarray:
    """e4m3fn codes of N(0, INIT_STD / 2^FP8_SCALE_EXP); no NaN, no 0x80."""
    vals = fp8_values()
    allowed = ~np.isnan(vals) & (np.arange(256) != 0x80)
    return _tuned(lambda s: _byte_table(_rounded_normal(vals, allowed, s)), lambda t: float(vals[t].std()),
                  INIT_STD / 2.0**FP8_SCALE_EXP)


@lru_cache(maxsize=None)
def _mxfp4_table() -> np.ndarray:
    """Bytes of two independent E2M1 codes of N(0, INIT_STD / 2^MXFP4_SCALE_EXP); no -0."""
    allowed = np.arange(16) != 8

    def make(s: float) -> np.ndarray:
        p = _rounded_normal(E2M1, allowed, s)
        return _byte_table(np.outer(p, p).reshape(-1))  # byte hi * 16 + lo: P = p[hi] p[lo]

    def std(t: np.ndarray) -> float:
        return float(np.concatenate([E2M1[t & 15], E2M1[t >> 4]]).std())

    return _tuned(make, std, INIT_STD / 2.0**MXFP4_SCALE_EXP)


# ------------------------------------------------------------------------------------------------
# tensors
# ------------------------------------------------------------------------------------------------


def _rng(seed: int, name: str) -> np.random.Generator:
    h = hashlib.sha256(name.encode()).digest()
    return np.random.default_rng([int(seed), *np.frombuffer(h[:16], dtype=np.uint32).tolist()])


def _fill(out: np.ndarray, step: Callable[[int], np.ndarray]) -> np.ndarray:
    """Fill `out` (any shape) in chunks of _CHUNK elements: step(n) -> n values."""
    flat = out.reshape(-1)
    for i in range(0, flat.size, _CHUNK):
        flat[i:i + _CHUNK] = step(min(_CHUNK, flat.size - i))
    return out


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest even), as the uint16 bits bf16 storage holds."""
    b = np.asarray(x, np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def _from_table(table: np.ndarray, rng: np.random.Generator) -> Callable[[int], np.ndarray]:
    return lambda n: np.take(table, rng.integers(0, 65536, n, dtype=np.uint16))


def _normal(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    out = np.empty(spec.shape, storage_dtype(spec.dtype))
    if spec.dtype == "bfloat16":
        def step(n: int) -> np.ndarray:
            return bf16_bits(rng.standard_normal(n, dtype=np.float32) * np.float32(INIT_STD))
    elif spec.dtype in ("float32", "float16", "float64"):
        def step(n: int) -> np.ndarray:
            return rng.standard_normal(n, dtype=np.float32) * np.float32(INIT_STD)
    else:
        raise ValueError(f"{spec.name}: no random init for a {spec.dtype} tensor (rule: normal)")
    return _fill(out, step)


def _tid2eid(spec: TensorSpec, n_experts: int, rng: np.random.Generator) -> np.ndarray:
    if len(spec.shape) != 2 or spec.dtype not in ("int64", "int32") or not 0 < spec.shape[1] <= n_experts:
        raise ValueError(f"{spec.name}: expected [vocab, k <= {n_experts}] int64/int32, got {spec.dtype} {list(spec.shape)}")
    out = np.empty(spec.shape, storage_dtype(spec.dtype))
    rows = max(1, _CHUNK // n_experts)
    for r in range(0, spec.shape[0], rows):
        n = min(rows, spec.shape[0] - r)
        out[r:r + n] = np.argsort(rng.random((n, n_experts)), axis=1)[:, : spec.shape[1]]
    return out


def _scale(spec: TensorSpec, weight: TensorSpec) -> np.ndarray:
    if weight.dtype in FP8_DTYPES:
        exp = FP8_SCALE_EXP + (weight.dtype == "float8_e4m3fnuz")  # fnuz: same bytes, half the value
    elif weight.dtype == "uint8":
        exp = MXFP4_SCALE_EXP
    else:
        raise ValueError(f"{spec.name}: the scale of a {weight.dtype} weight ({weight.name})")
    if spec.dtype == "uint8":
        return np.full(spec.shape, 127 + exp, np.uint8)  # E8M0
    if spec.dtype == "float32":
        return np.full(spec.shape, 2.0**exp, np.float32)
    raise ValueError(f"{spec.name}: block scales must be uint8 (E8M0) or float32, got {spec.dtype}")


def random_tensors(specs: Sequence[TensorSpec], model: Mapping[str, Any], seed: int = 0) -> Iterator[Tensor]:
    """(name, array, dtype) for every tensor of the inventory, in its order; `model` is the HF config
    (its n_routed_experts sizes the hash-routing tables)."""
    by_name = {s.name: s for s in specs}
    for spec in specs:
        rng = _rng(seed, spec.name)
        partner = weight_of_scale(spec.name)
        if spec.dtype in FP8_DTYPES:
            arr = _fill(np.empty(spec.shape, np.uint8), _from_table(_fp8_table(), rng))
        elif partner in by_name:
            arr = _scale(spec, by_name[partner])
        elif spec.dtype == "uint8":  # packed MXFP4, with its per-32 scale beside it
            if f"{spec.name}_scale" not in by_name:
                raise ValueError(f"{spec.name}: a uint8 tensor without a {spec.name}_scale is not a known format")
            arr = _fill(np.empty(spec.shape, np.uint8), _from_table(_mxfp4_table(), rng))
        else:
            rule = init_rule(spec.name)
            if rule == "tid2eid":
                arr = _tid2eid(spec, int(model.get("n_routed_experts", 0)), rng)
            elif rule == "normal":
                arr = _normal(spec, rng)
            else:
                if spec.dtype not in ("float32", "bfloat16", "float16"):
                    raise ValueError(f"{spec.name}: rule {rule} for a {spec.dtype} tensor")
                value = float(rule == "ones")
                arr = (np.full(spec.shape, np.float32(value).view(np.uint32) >> 16, np.uint16)  # bf16 bits
                       if spec.dtype == "bfloat16" else np.full(spec.shape, value, storage_dtype(spec.dtype)))
        yield spec.name, arr, spec.dtype
        del arr  # freed before the next tensor is made


def write_random_weights(export_dir: str | os.PathLike, seed: int = 0, *, force: bool = False,
                         progress: Callable[[str], None] | None = None, jobs: int = 1) -> list[Path]:
    """Write every weight file config.json names (each flavour's), with random weights; returns the
    paths. ArtifactError when the directory is not an export with a weights inventory, or when weight
    files exist already (unless `force`). `jobs` > 1 writes that many files at once, one process
    each (every tensor has its own generator, so the bytes do not depend on it; Flash's 163 GB on a
    many-core GPU host); exports cut per device are written by one process."""
    d = Path(export_dir)
    cfg = ExportConfig.load(d, weights=False)
    if cfg.weights is None or cfg.shard_bytes is None:
        raise ArtifactError(f"{d / 'config.json'} has no weights inventory (field 'weights'): it comes from an "
                            "exporter that predates sharded weights; re-export it")
    groups = cfg.weight_groups()
    present = [f for g in groups for f in g.files if f.exists()]
    if present and not force:
        raise ArtifactError(f"{present[0]} exists: {d} has weights already (pass --force to replace them)")
    log = progress or (lambda s: None)
    written = []
    digests: dict[str, str] = {}
    for g in groups:
        n = len(plan_shards([s.nbytes for s in g.specs], cfg.shard_bytes))
        if n != len(g.files):
            raise ArtifactError(f"{d / 'config.json'}: {len(g.files)} weight file(s) listed for "
                                f"{', '.join(g.targets)}, but its inventory cut at {cfg.shard_bytes} bytes makes {n}")
        total = sum(s.nbytes for s in g.specs)
        log(f"random weights (seed {seed}) for {', '.join(g.targets)}: {len(g.specs)} tensors, {total / 1e9:.2f} GB "
            f"-> {len(g.files)} file(s){' (' + g.fp8_dtype + ')' if g.fp8_dtype else ''}")
        if jobs > 1 and cfg.weight_devices == 1:
            digests.update(_write_parallel(d, g.specs, [f.name for f in g.files], cfg.model, seed, cfg.shard_bytes,
                                           jobs, log))
            written += g.files
            continue
        # a multi-device export gets the whole tensors cut per device: the same weights as one device's
        whole = whole_inventory(g.specs, cfg.weight_devices)
        source = shard_tensors(random_tensors(whole, cfg.model, seed), cfg.weight_devices)
        write_shards(d, checked(source, g.specs), shard_bytes=cfg.shard_bytes,
                     names=[f.name for f in g.files], progress=log, total_bytes=total, inventory=g.specs,
                     digests=digests)
        written += g.files
    # the digests made while writing go into config.json, for `dsv4 check` after a copy; "source" says
    # what the weights are, for `dsv4 audit` (which draws the same tensors again as its reference)
    write_config(d, {**cfg.raw, "sha256": dict(sorted({**cfg.sha256, **digests}.items())),
                     "source": {"random_weights": True, "seed": int(seed)}})
    return written


def _write_one_file(d: Path, specs: Sequence[TensorSpec], name: str, model: Mapping[str, Any], seed: int,
                    shard_bytes: int) -> tuple[str, str]:
    # a prefix of its own per file: write_shards names its temporary file after the prefix
    digests: dict[str, str] = {}
    write_shards(d, checked(random_tensors(specs, model, seed), specs), prefix=f".{name}", shard_bytes=shard_bytes,
                 names=[name], inventory=specs, digests=digests)
    return name, digests[name]


def _write_parallel(d: Path, specs: Sequence[TensorSpec], names: Sequence[str], model: Mapping[str, Any], seed: int,
                    shard_bytes: int, jobs: int, log: Callable[[str], None]) -> dict[str, str]:
    """The files of `names` (the shards `plan_shards` cuts `specs` into), `jobs` processes at a time;
    returns their sha256 digests."""
    import time
    from concurrent.futures import ProcessPoolExecutor, as_completed

    counts = plan_shards([s.nbytes for s in specs], shard_bytes)
    starts = np.cumsum([0, *counts])
    t0, done = time.perf_counter(), 0
    with ProcessPoolExecutor(max_workers=min(jobs, len(names))) as pool:
        futs = {pool.submit(_write_one_file, d, list(specs[starts[i]:starts[i + 1]]), names[i], model, seed,
                            shard_bytes): sum(s.nbytes for s in specs[starts[i]:starts[i + 1]])
                for i in range(len(names))}
        digests = {}
        for f in as_completed(futs):
            name, digests[name] = f.result()
            done += futs[f]
            log(f"  {name} written; {done / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s")
    return digests
