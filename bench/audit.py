"""`dsv4 audit OUT`: where a compiled export leaves its eager reference, layer by layer (docs/numerics.md).

Two checks, one verdict:

1. **Weights.** Every tensor of the export's parameter archive, decoded to its values (FP8 e4m3fn or
   e4m3fnuz codes times their block scales, MXFP4 nibbles times E8M0 scales, bf16/f32, integers), is
   compared with the reference model's tensor loaded from the checkpoint (config.json's ``source``,
   or ``--checkpoint DIR``). The formats convert exactly (fn -> fnuz: same bits, scale x2), so the
   comparison is exact; a mismatching FP8 or MXFP4 pair names its codes or its scale, whichever differs.
2. **Activations.** A probe of the export (export/exporter.py `probe_module`: the export's graph
   for its target, same lowering plan and flags, with every block's intermediate values as extra
   results, model/taps.py) runs on the export's own .irpa; the eager reference runs on the
   checkpoint's weights at the export's activation dtype, and once more at a wider dtype (float32,
   or float64 for a float32 export). Prefill, then N greedy decode steps, every side fed the
   export's tokens. For each layer and part (mHC collapse, indexer selection, attention, router
   choices, MoE, block output) the compiled-vs-eager error is judged against the reference's own
   noise at the same place in the same run: the eager model against its wider self. A value part
   diverges when its error exceeds NOISE_FACTOR times that noise and the activation dtype's
   rounding (a floor for places where the two eager runs agree exactly); a choice part (indexer,
   router) when the share of choices that differ exceeds NOISE_FACTOR times the reference's own
   share and CHOICE_FLOOR (a near tie flips on any rounding). The export's own vmfb runs beside the
   probe: its logits are judged the same way, and their distance to the probe's is reported.

Exit status 0 when everything is consistent, 1 when a weight or a layer diverges, 2 on an error.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from dsv4.contract.random_weights import E2M1  # the E2M1 code values (torch-free)

__all__ = ["NOISE_FACTOR", "CHOICE_FLOOR", "WeightMismatch", "compare_weights", "decode_values", "value_error",
           "choice_disagreement", "PartVerdict", "judge_part", "verdict", "run_audit", "add_arguments", "run",
           "DEFAULT_PROMPT", "Report"]

# A part diverges when compiled-vs-eager exceeds this many times the eager model's own noise
# (bf16 against float32 at the same place in the same run); why 2: the embedded default's and the
# tiny preset's clean exports stay below 1x at every part (docs/numerics.md), while a wrong weight or
# kernel of consequence lands at 2.5x and far above.
NOISE_FACTOR = 2.0
# a choice part (indexer selection, routed experts) diverges only when at least this share of its
# choices differs: a near tie flips on any rounding, even where the reference's two runs agreed
CHOICE_FLOOR = 0.25
# a part's floor, what two correct runs may differ by whatever the noise says: one step of a 16-bit
# activation dtype; for float32, the summation-order difference of a 4096-long float32 dot product
# (eps * sqrt(4096) = 2^-17): the model computes norms, mHC and logits in float32 at every activation
# dtype, so there a float64 run equals the float32 one and measures no noise at all
DTYPE_FLOOR = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -17}

# a prompt for exports with a tokenizer (the embedded default was trained on the CPython docs)
DEFAULT_PROMPT = ("The for statement in Python differs a bit from what you may be used to in C. Rather than "
                  "always iterating over an arithmetic progression of numbers, it iterates over the items of "
                  "any sequence, in the order that they appear in the sequence. For example:")
RANDOM_PROMPT_LEN = 96


# ---------------------------------------------------------------------------------------------
# weights


def _fp8_values(codes: np.ndarray, dtype: str) -> np.ndarray:
    import ml_dtypes

    return codes.view(getattr(ml_dtypes, dtype)).astype(np.float64)


def _e8m0(b: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> 2^(b-127), NaN for 0xFF."""
    v = np.ldexp(1.0, b.astype(np.int64) - 127)
    return np.where(b == 0xFF, np.nan, v)


def _expand(scale: np.ndarray, shape: tuple[int, ...], block: tuple[int, int]) -> np.ndarray:
    """A block scale [..., ceil(o/bo), ceil(i/bi)] repeated to the weight's [..., o, i]."""
    s = np.repeat(np.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return s[..., :shape[-2], :shape[-1]]


def decode_values(arr: np.ndarray, dtype: str) -> np.ndarray:
    """One archive tensor's values as float64 (integers as int64): FP8 codes as their format reads
    them, bf16/f16/f32 widened, others as they are. `arr` is in the dtype's storage type."""
    import ml_dtypes

    if dtype.startswith("float8"):
        return _fp8_values(arr, dtype)
    if dtype == "bfloat16":
        return arr.view(ml_dtypes.bfloat16).astype(np.float64)
    if dtype in ("float16", "float32", "float64"):
        return arr.view(dtype).astype(np.float64)
    return arr.astype(np.int64)


def _scale_values(arr: np.ndarray, dtype: str) -> np.ndarray:
    return _e8m0(arr) if dtype == "uint8" else decode_values(arr, dtype)


def _pair_values(w: np.ndarray, wdt: str, s: np.ndarray, sdt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(code values, scale values, dequantized weight) of an FP8 (128x128 blocks) or MXFP4 (packed
    nibbles, low first, per-32 scales along the input dim) weight and its block scale."""
    sv = _scale_values(s, sdt)
    if wdt.startswith("float8"):
        cv = _fp8_values(w, wdt)
        return cv, sv, cv * _expand(sv, cv.shape, (128, 128))
    nib = np.stack([w & 0xF, w >> 4], axis=-1).reshape(*w.shape[:-1], 2 * w.shape[-1])
    cv = E2M1[nib]
    return cv, sv, cv * np.repeat(sv, 32, axis=-1)


@dataclass
class WeightMismatch:
    """One tensor whose values differ (or that is missing on one side)."""

    name: str
    problem: str  # "values", "missing", "extra", "shape", "dtype"
    count: int = 0  # elements that differ
    max_abs: float = 0.0  # the largest |difference| of the dequantized values
    index: list[int] = field(default_factory=list)  # a stacked tensor's [E, ...] entries (experts) that differ

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "problem": self.problem, "count": self.count, "max_abs": self.max_abs,
                "index": self.index}

    def describe(self) -> str:
        if self.problem != "values":
            return f"{self.name}: {self.problem}"
        where = f" (entries {', '.join(map(str, self.index))} of dim 0)" if self.index else ""
        return f"{self.name}{where}: {self.count} values differ, max |diff| {self.max_abs:.3g}"


def _differing(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return ~((a == b) | (np.isnan(a) & np.isnan(b)))


def _mismatch(name: str, a: np.ndarray, b: np.ndarray, bad: np.ndarray) -> WeightMismatch:
    """A value mismatch: how many differ, the largest |a - b|, and for a stacked (3-D) tensor which entries."""
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))[bad]
    worst = float(np.nanmax(d)) if d.size and np.isfinite(d).any() else float("nan")
    index = np.flatnonzero(bad.reshape(bad.shape[0], -1).any(1)).tolist() if bad.ndim >= 3 else []
    return WeightMismatch(name, "values", int(bad.sum()), worst, index)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


def compare_weights(archive: Mapping[str, tuple[np.ndarray, str]], reference: Mapping[str, tuple[np.ndarray, str]],
                    pair_of: Callable[[str], str | None]) -> tuple[list[WeightMismatch], int]:
    """Compare every tensor of `archive` with `reference` (both {name: (array in the storage type,
    dtype name)}); `pair_of(scale name)` names the low-bit weight a block scale belongs to. Low-bit
    weights are compared as code values x scale: an e4m3fnuz archive pair holds the e4m3fn values
    with codes read half as large and scales twice as large (formats.fp8_fn_to_fnuz), so its codes
    are compared x2 and its scales /2. Returns (the mismatches, tensors compared)."""
    out: list[WeightMismatch] = []
    scales = {s: w for s in archive if (w := pair_of(s)) is not None and w in archive}
    out += [WeightMismatch(n, "missing") for n in reference if n not in archive]
    out += [WeightMismatch(n, "extra") for n in archive if n not in reference]
    for name, (arr, dt) in archive.items():
        if name not in reference or name in scales:
            continue
        ref, rdt = reference[name]
        low_bit = name in scales.values()
        if arr.shape != ref.shape:
            out.append(WeightMismatch(name, "shape"))
            continue
        if not low_bit:
            if dt != rdt:
                out.append(WeightMismatch(name, "dtype"))
                continue
            a, b = decode_values(arr, dt), decode_values(ref, rdt)
            if not _same(a, b):
                out.append(_mismatch(name, a, b, _differing(a, b)))
            continue
        sname = next(s for s, w in scales.items() if w == name)
        (sa, sdt), (sr, srdt) = archive[sname], reference[sname]
        if sa.shape != sr.shape:
            out.append(WeightMismatch(sname, "shape"))
            continue
        ca, va, da = _pair_values(arr, dt, sa, sdt)
        cr, vr, dr = _pair_values(ref, rdt, sr, srdt)
        k = 2.0 if (dt, rdt) == ("float8_e4m3fnuz", "float8_e4m3fn") else 1.0
        if _same(da, dr) and _same(ca * k, cr):
            continue
        if not _same(ca * k, cr):
            out.append(_mismatch(name, da, dr, _differing(ca * k, cr)))
        if not _same(va / k, vr):  # counted in scale entries, the difference in the weight's values
            m = _mismatch(sname, va / k, vr, _differing(va / k, vr))
            d = np.abs(da - dr)[_differing(da, dr)]
            m.max_abs = float(np.nanmax(d)) if d.size and np.isfinite(d).any() else float("nan")
            out.append(m)
    return out, len(archive)


# ---------------------------------------------------------------------------------------------
# activations: the yardstick and the verdict


def value_error(x: np.ndarray, ref: np.ndarray) -> float:
    """||x - ref|| / ||ref|| (2-norms over the whole tensor, float64); inf where x is not finite."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(x).all():
        return float("inf")
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def choice_disagreement(x: np.ndarray, ref: np.ndarray) -> float:
    """The share of choices of `ref` (rows of the last dim, -1 = none) that `x` does not make:
    1 - mean over rows with choices of |x_row & ref_row| / |ref_row|."""
    x, ref = np.asarray(x).reshape(-1, x.shape[-1]), np.asarray(ref).reshape(-1, ref.shape[-1])
    missed, rows = 0.0, 0
    for a, b in zip(x, ref):
        want = set(b[b >= 0].tolist())
        if want:
            missed += 1 - len(want & set(a[a >= 0].tolist())) / len(want)
            rows += 1
    return missed / rows if rows else 0.0


@dataclass
class PartVerdict:
    """One part of one layer pooled over every call of the run: the compiled-vs-eager error and the
    noise (eager at the export's dtype against the wider eager run), each as ||diff|| / ||eager|| over
    all calls' values together (values), or the share of all eager choices not made (choices)."""

    choice: bool = False
    divergent: bool = False
    _err: float = 0.0  # sum of squared differences (values) or missed choices (choices)
    _noise: float = 0.0
    _den: float = 0.0  # sum of squared eager values, or eager choice rows

    def add(self, compiled: np.ndarray, eager: np.ndarray, wide: np.ndarray) -> None:
        """One call's tensors of this part: compiled, eager at the export's dtype, eager wider."""
        if self.choice:
            e, n, rows = _missed(compiled, eager), _missed(wide, eager), _rows(eager)
            self._err, self._noise, self._den = self._err + e, self._noise + n, self._den + rows
            return
        c, e, w = (np.asarray(x, np.float64) for x in (compiled, eager, wide))
        self._err += float(np.sum((c - e) ** 2)) if np.isfinite(c).all() else float("inf")
        self._noise += float(np.sum((w - e) ** 2))
        self._den += float(np.sum(e ** 2))

    @property
    def error(self) -> float:
        return self._err / self._den if self.choice else (self._err / max(self._den, 1e-300)) ** 0.5 if self._den else 0.0

    @property
    def noise(self) -> float:
        return self._noise / self._den if self.choice else (self._noise / max(self._den, 1e-300)) ** 0.5 if self._den else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"error": self.error, "noise": self.noise, "divergent": self.divergent}


def _rows(ref: np.ndarray) -> int:
    ref = np.asarray(ref).reshape(-1, ref.shape[-1])
    return int(np.sum((ref >= 0).any(-1)))


def _missed(x: np.ndarray, ref: np.ndarray) -> float:
    return choice_disagreement(x, ref) * _rows(ref)


def judge_part(p: PartVerdict, floor: float) -> bool:
    """Diverges when the error passes NOISE_FACTOR x noise and the floor (CHOICE_FLOOR for choices,
    the activation dtype's rounding for values)."""
    return p.error > NOISE_FACTOR * p.noise and p.error > (CHOICE_FLOOR if p.choice else floor)


def verdict(parts: Mapping[str, PartVerdict], floor: float, order: Sequence[str]) -> tuple[int | None, str | None]:
    """Judge every part ({"<layer>.<part>": PartVerdict}, sets .divergent) and return (first divergent
    layer, its first divergent part in `order`), or (None, None)."""
    first: tuple[int, int] | None = None
    for name, p in parts.items():
        p.divergent = judge_part(p, floor)
        if p.divergent and "." in name:
            layer, part = name.split(".", 1)
            key = (int(layer), order.index(part))
            first = key if first is None or key < first else first
    if first is None:
        return None, None
    return first[0], order[first[1]]


# ---------------------------------------------------------------------------------------------
# the run


@dataclass
class Report:
    """Everything `dsv4 audit` found (`to_json`: the --json line)."""

    export: str
    target: str
    device: str
    reference: str
    prompt_tokens: int
    steps: int
    weights_compared: int = 0
    weights_mismatch: list[WeightMismatch] = field(default_factory=list)
    parts: dict[str, PartVerdict] = field(default_factory=dict)
    kinds: list[str] = field(default_factory=list)
    first_divergent_layer: int | None = None
    first_divergent_part: str | None = None
    logits: PartVerdict = field(default_factory=PartVerdict)
    probe_vs_export: float = 0.0
    greedy_agree: str = ""
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def consistent(self) -> bool:
        head = self.parts.get("head")
        return (not self.weights_mismatch and self.first_divergent_layer is None and not self.logits.divergent
                and not (head is not None and head.divergent))

    def layer_rows(self) -> list[dict[str, Any]]:
        from dsv4.model.taps import PARTS

        rows = []
        for i, kind in enumerate(self.kinds):
            mine = {p: self.parts[f"{i}.{p}"] for p in PARTS if f"{i}.{p}" in self.parts}
            bad = [p for p in PARTS if p in mine and mine[p].divergent]
            rows.append({"layer": i, "kind": kind, "divergent": bool(bad), "first_divergent_part": bad[0] if bad else None,
                         "parts": {p: v.to_json() for p, v in mine.items()}})
        return rows

    def to_json(self) -> dict[str, Any]:
        return {"consistent": self.consistent, "first_divergent_layer": self.first_divergent_layer,
                "first_divergent_part": self.first_divergent_part,
                "weights_mismatch": [m.name for m in self.weights_mismatch],
                "weights_mismatch_detail": [m.to_json() for m in self.weights_mismatch],
                "weights_compared": self.weights_compared, "layers": self.layer_rows(),
                "head": self.parts["head"].to_json() if "head" in self.parts else None,
                "logits": self.logits.to_json(), "probe_vs_export_logits": self.probe_vs_export,
                "greedy_agree": self.greedy_agree, "noise_factor": NOISE_FACTOR, "choice_floor": CHOICE_FLOOR,
                "export": self.export, "target": self.target, "device": self.device, "reference": self.reference,
                "prompt_tokens": self.prompt_tokens, "steps": self.steps,
                "seconds": {k: round(v, 1) for k, v in self.seconds.items()}}

    def table(self) -> str:
        lines = [f"weights: {self.weights_compared} tensors compared with {self.reference}: "
                 + ("all equal" if not self.weights_mismatch else f"{len(self.weights_mismatch)} differ")]
        for m in self.weights_mismatch[:20]:
            lines.append(f"  DIFFERS {m.describe()}")
        lines.append(f"activations: prompt {self.prompt_tokens} tokens + {self.steps} decode steps; error = "
                     f"compiled vs eager, noise = eager vs eager at a wider dtype; a part diverges above "
                     f"{NOISE_FACTOR:g}x noise")
        lines.append(f"{'layer':>5} {'kind':9} {'part':9} {'error':>9} {'noise':>9} {'ratio':>7}  verdict "
                     "(each block on the compiled side's input; the part shown: the first divergent, else the "
                     "largest ratio)")
        for row in self.layer_rows():
            parts = row["parts"]
            worst = max(parts, key=lambda p: parts[p]["error"] / max(parts[p]["noise"], 1e-30))
            if row["first_divergent_part"]:
                worst = row["first_divergent_part"]
            e, n = parts[worst]["error"], parts[worst]["noise"]
            lines.append(f"{row['layer']:>5} {row['kind']:9} {worst:9} {e:9.2e} {n:9.2e} {_ratio(e, n)}  "
                         + (f"DIVERGES at {row['first_divergent_part']}" if row["divergent"] else "ok"))
        for label, kind, p, note in (("head", "norm+head", self.parts.get("head"), "on the probe's last streams"),
                                     ("all", "logits", self.logits,
                                      f"the export's vmfb end to end; greedy {self.greedy_agree}, "
                                      f"probe vs export {self.probe_vs_export:.1e}")):
            if p is not None:
                lines.append(f"{label:>5} {kind:9} {'logits':9} {p.error:9.2e} {p.noise:9.2e} "
                             f"{_ratio(p.error, p.noise)}  {'DIVERGES' if p.divergent else 'ok'}  ({note})")
        lines.append("verdict: " + ("consistent" if self.consistent else
                                    "DIVERGES" + (f": first at layer {self.first_divergent_layer} "
                                                  f"({self.first_divergent_part})"
                                                  if self.first_divergent_layer is not None else "")
                                    + (f"; {len(self.weights_mismatch)} weight(s) differ"
                                       if self.weights_mismatch else "")))
        return "\n".join(lines)


def _ratio(error: float, noise: float) -> str:
    """error / noise for the table; "-" where the two eager runs agree exactly (the floor judges then)."""
    return f"{error / noise:7.2f}" if noise > 0 else f"{'-':>7}"


def _layer_kind(ratio: int) -> str:
    return {0: "sliding", 4: "CSA"}.get(ratio, f"HCA/{ratio}")


def _filled(model: Any, tensors: Any) -> Any:
    """`model` (an empty model) with every tensor of `tensors` ((key, array in the storage type, dtype
    name), the export's keys) copied into its parameter."""
    import torch

    from dsv4.contract.artifact import PARAM_PREFIX

    state = model.state_dict()
    with torch.no_grad():
        for key, arr, _ in tensors:
            t = state[key.removeprefix(PARAM_PREFIX)]
            t.copy_(torch.from_numpy(np.ascontiguousarray(arr)).view(t.dtype).reshape(t.shape))
    return model.eval()


def _reference_model(exp: Any, checkpoint: Path | None, act: Any) -> tuple[Any, str]:
    """The eager reference at the export's activation dtype, and what it was loaded from: the
    checkpoint's tensors as the export's model holds them (its first layers for a --layers export),
    or random weights drawn again from the recorded seed."""
    from dsv4.model.checkpoint import param_inventory
    from dsv4.model.config import ModelConfig
    from dsv4.model.model import empty_model

    cfg = ModelConfig.from_dict(exp.model)
    source = exp.raw.get("source") or {}
    if checkpoint is None and "checkpoint" in source:
        checkpoint = Path(source["checkpoint"])
    if checkpoint is not None:
        from dsv4.model.checkpoint import checkpoint_tensors, load_checkpoint

        if not (checkpoint / "config.json").is_file():
            raise ValueError(f"{checkpoint}: no checkpoint there (no config.json)")
        ck = load_checkpoint(checkpoint, dtype=act, overrides={"max_seq_len": cfg.max_seq_len, "quant_sim": cfg.quant_sim},
                             layers=cfg.n_layers, expert_dtype="fp8" if cfg.expert_dtype == "fp8" else None,
                             mtp=bool(cfg.n_mtp), weights=False)
        mine, theirs = cfg.to_dict(), ck.cfg.to_dict()
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        if diff:
            raise ValueError(f"{checkpoint} is not the model of this export: {', '.join(diff[:6])} differ")
        return _filled(ck, checkpoint_tensors(checkpoint, ck, "float8_e4m3fn")), str(checkpoint)
    if "seed" in source:  # random weights (an export of a preset, or `dsv4 weights random`)
        from dsv4.contract.random_weights import random_tensors

        quantized = any(dt.startswith("float8") or dt == "uint8" for _, _, dt in exp.raw["weights"]["tensors"])
        model = empty_model(cfg, act, quantized=quantized)
        return (_filled(model, random_tensors(param_inventory(model), cfg.to_dict(), int(source["seed"]))),
                f"random weights, seed {source['seed']}")
    raise ValueError(f"{exp.directory}/config.json does not say which checkpoint the export was made from; "
                     "pass --checkpoint DIR")


def _widened(model: Any, dtype: Any) -> Any:
    """The same weights at activation dtype `dtype`: float tensors widened exactly, FP8/MXFP4 codes and
    scales as they are."""
    import torch

    from dsv4.model.model import empty_model

    quantized = any(p.dtype in (torch.float8_e4m3fn, torch.uint8) for p in model.parameters())
    wide = empty_model(model.cfg, dtype, quantized=quantized)
    src = model.state_dict()
    with torch.no_grad():
        for name, t in wide.state_dict(keep_vars=True).items():
            t.data = src[name].to(t.dtype)
    return wide.eval()


def _archive_tensors(exp: Any, target: str) -> tuple[dict[str, tuple[np.ndarray, str]], Any]:
    from dsv4.contract.artifact import PARAM_PREFIX
    from dsv4.contract.weights import WholeWeights, open_weights

    group = next(g for g in exp.weight_groups() if target in g.targets)
    w = open_weights(group.files)
    if exp.weight_devices > 1:
        w = WholeWeights(w, exp.weight_devices)
    out = {}
    for key in w:
        shape, dt = w.spec(key) or (None, None)
        if dt is None:
            raise ValueError(f"{w.file_of(key)}: {key} has no shape/dtype metadata")
        out[key.removeprefix(PARAM_PREFIX)] = (w.tensor(key, shape, dt), dt)
    return out, w


def _reference_tensors(model: Any) -> dict[str, tuple[np.ndarray, str]]:
    from dsv4.model.checkpoint.irpa import archive_tensors

    return {k: (a, dt) for k, a, dt in archive_tensors(dict(model.state_dict()), "float8_e4m3fn")}


def _prompt(exp: Any, prompt: str | None, prompt_ids: Sequence[int] | None) -> list[int]:
    vocab = int(exp.model["vocab_size"])
    if prompt_ids is not None:
        ids = [int(x) for x in prompt_ids]
        bad = [x for x in ids if not 0 <= x < vocab]
        if bad:
            raise ValueError(f"--prompt-ids: {bad[0]} is outside the vocabulary [0, {vocab})")
    elif prompt is not None or exp.tokenizer is not None:
        if exp.tokenizer is None:
            raise ValueError("--prompt needs an export with a tokenizer; pass --prompt-ids")
        from dsv4.runtime.text import TextCodec

        ids = TextCodec(exp.tokenizer, exp.bos_token_id).encode(prompt or DEFAULT_PROMPT, True)
    else:  # no tokenizer: a fixed random prompt
        ids = np.random.default_rng(0).integers(2, vocab, size=RANDOM_PROMPT_LEN).tolist()
    if len(ids) < exp.prefill_min_tokens:
        raise ValueError(f"the prompt has {len(ids)} tokens; the export's prefill takes at least "
                         f"{exp.prefill_min_tokens}")
    return ids


def _chunks(ids: list[int], lo: int, hi: int) -> list[tuple[list[int], int]]:
    """The prompt in prefill pieces of at most `hi` tokens, none below `lo` (the last one is shortened
    from the front when needed)."""
    out, pos = [], 0
    while pos < len(ids):
        n = min(hi, len(ids) - pos)
        if 0 < len(ids) - pos - n < lo:  # the remainder would be too short: leave it more
            n = len(ids) - pos - lo
        out.append((ids[pos:pos + n], pos))
        pos += n
    return out


class _Eager:
    """The eager model on one torch device with its own decode state. `__call__` runs it end to end;
    `layers` runs each block on the compiled side's input to that block (the previous block's output
    streams of the probe), so a layer's error is its own, not what earlier layers passed on."""

    def __init__(self, model: Any, exp: Any, alternatives: Mapping[str, Any], device: str):
        import torch

        from dsv4.model.state import new_state

        self.torch, self.device, self.alternatives = torch, device, alternatives
        self.model = model.to(device).eval()
        self.state = new_state(model.cfg, exp.n_slots, model.dtype, device=device)

    def _args(self, tokens: list[int], pos: int) -> tuple[Any, Any, Any, Any]:
        torch = self.torch
        t = torch.tensor([tokens], dtype=torch.int64, device=self.device)
        z = torch.zeros(1, dtype=torch.int64, device=self.device)
        return t, z + pos, z + len(tokens), z

    @staticmethod
    def _host(logits: Any, taps: Mapping[str, Any]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return (logits[0].double().cpu().numpy(),
                {k: v.double().cpu().numpy() if v.is_floating_point() else v.cpu().numpy() for k, v in taps.items()})

    def __call__(self, tokens: list[int], pos: int) -> np.ndarray:
        from dsv4.model.kernels import overrides

        with self.torch.no_grad(), overrides(self.alternatives):
            logits = self.model(*self._args(tokens, pos), self.state)
        return logits[0].double().cpu().numpy()

    def layers(self, tokens: list[int], pos: int, inputs: Sequence[np.ndarray]
               ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Block i on inputs[i] (the compiled streams entering it; block 0 on the embeddings), the head
        on inputs[n_layers]: (logits, taps)."""
        from dsv4.model.kernels import overrides
        from dsv4.model.model import Batch, embed_streams, rope_of
        from dsv4.model.taps import record_taps

        torch, m = self.torch, self.model
        t, start, lengths, slots = self._args(tokens, pos)
        b = Batch.make(t, start, lengths, slots)
        rope = rope_of(m, b.pos)

        def streams(a: np.ndarray) -> Any:
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, m.dtype)

        with torch.no_grad(), overrides(self.alternatives), record_taps(m) as taps:
            for i, blk in enumerate(m.layers):
                h = embed_streams(m.embed, t, m.cfg.hc_mult) if i == 0 else streams(inputs[i])
                blk(h, b, m.layout.layers[i], self.state, rope, t)
            logits = m.logits(streams(inputs[len(m.layers)]), lengths, False)
        return self._host(logits, taps)


def _probe_spec(exp: Any, target: str) -> Any:
    from dsv4.export.compile import check_target
    from dsv4.export.spec import ExportSpec

    raw = exp.raw
    tinfo = raw["targets"][target]
    tgt = check_target(target)
    return ExportSpec(targets=(tgt,), batch_sizes=(1,), decode_batch_sizes=(1,), n_slots=exp.n_slots,
                      max_chunk=exp.prefill_max_tokens, score=False, kernels=tuple(tinfo.get("kernels", {}).items()),
                      batch_invariant=bool(raw.get("lowering", {}).get("batch_invariant", False)),
                      extra_flags=tuple(f for f in tinfo.get("flags", []) if f not in tgt.flags))


def build_probe(exp: Any, target: str, work: Path, kernels: Mapping[str, str] | None = None,
                log: Callable[[str], None] = lambda s: None) -> Path:
    """The probe vmfb of the export for `target` in `work`, reused when `work/probe.json` says it was
    built for this export, target and kernel choices."""
    import torch

    from dsv4.export.exporter import probe_module
    from dsv4.model.config import ModelConfig
    from dsv4.model.model import empty_model

    stamp = {"export_id": exp.export_id, "target": target, "kernels": dict(kernels or {})}
    vmfb, meta = work / f"probe.{target}.vmfb", work / "probe.json"
    if vmfb.is_file() and meta.is_file() and json.loads(meta.read_text()) == stamp:
        log(f"probe: reusing {vmfb}")
        return vmfb
    cfg = ModelConfig.from_dict(exp.model)
    act = getattr(torch, exp.raw["activation_dtype"])
    quantized = any(dt.startswith("float8") or dt == "uint8" for _, _, dt in exp.raw["weights"]["tensors"])
    model = empty_model(cfg, act, quantized=quantized)
    path = probe_module(model, _probe_spec(exp, target), work, kernels=kernels, progress=log)
    meta.write_text(json.dumps(stamp))
    return path


def run_audit(out: str | Path, *, checkpoint: str | Path | None = None, prompt: str | None = None,
              prompt_ids: Sequence[int] | None = None, steps: int = 8, device: str = "local-task",
              eager_device: str = "cpu", work_dir: str | Path | None = None,
              probe_kernels: Mapping[str, str] | None = None,
              log: Callable[[str], None] = lambda s: None) -> Report:
    """Audit the export `out` (module docstring). `checkpoint`: the reference (default: config.json's
    source); `work_dir`: where the probe is compiled and kept for the next audit (default: a temporary
    directory); `probe_kernels` {op: implementation} replace the export's lowering in the probe only
    (a test's deliberately wrong kernel). ValueError for bad input."""
    import torch

    from dsv4.contract.artifact import ExportConfig, target_for_device
    from dsv4.contract.random_weights import weight_of_scale
    from dsv4.model.kernels import KERNELS
    from dsv4.export.exporter import PROBE_DECODE, PROBE_PREFILL
    from dsv4.model.taps import CHOICE_PARTS, PARTS, tap_names
    from dsv4.runtime import Engine
    from dsv4.runtime.module import IreeModule

    if steps < 0:
        raise ValueError(f"--steps must be >= 0, got {steps}")
    t0 = time.perf_counter()
    out = Path(out)
    if not (out / "config.json").is_file():
        raise ValueError(f"{out}: not an export directory (no config.json)")
    exp = ExportConfig.load(out)
    target = target_for_device(device)
    if target not in exp.raw["targets"]:
        raise ValueError(f"{out} has no {target} module (targets: {', '.join(exp.raw['targets'])})")
    if exp.n_devices > 1 or exp.pipeline:
        raise ValueError("dsv4 audit takes a one-device export (this one drives several devices)")
    act_name = exp.raw["activation_dtype"]
    act = getattr(torch, act_name)
    ids = _prompt(exp, prompt, prompt_ids)
    if len(ids) + steps > exp.max_seq_len:
        raise ValueError(f"prompt ({len(ids)} tokens) + {steps} steps exceed the export's max_seq_len {exp.max_seq_len}")

    ref, where = _reference_model(exp, Path(checkpoint) if checkpoint is not None else None, act)
    rep = Report(str(out), target, device, where, len(ids), steps)
    rep.kinds = [_layer_kind(r) for r in ref.cfg.compress_ratios[:ref.cfg.n_layers]]
    rep.seconds["load"] = time.perf_counter() - t0

    # 1. weights
    t = time.perf_counter()
    archive, handle = _archive_tensors(exp, target)
    rep.weights_mismatch, rep.weights_compared = compare_weights(archive, _reference_tensors(ref), weight_of_scale)
    del archive, handle
    rep.seconds["weights"] = time.perf_counter() - t
    log(f"weights: {rep.weights_compared} tensors, {len(rep.weights_mismatch)} differ ({rep.seconds['weights']:.1f} s)")

    # 2. the probe
    t = time.perf_counter()
    tmp = None
    if work_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="dsv4-audit-")
        work = Path(tmp.name)
    else:
        work = Path(work_dir)
        work.mkdir(parents=True, exist_ok=True)
    try:
        vmfb = build_probe(exp, target, work, probe_kernels, log)
        rep.seconds["probe_compile"] = time.perf_counter() - t
        group = next(g for g in exp.weight_groups() if target in g.targets)
        probe = IreeModule(vmfb, exp.parameters_for(target), driver=device, expect=group.specs)
    finally:
        if tmp is not None:
            tmp.cleanup()  # the module has mapped the vmfb already
    eng = Engine(out, device=device)
    probe_state = [probe.zeros(s) for s in exp.state]

    # 3. the eager sides: block by block on the compiled inputs, and end to end (for the logits)
    chosen = exp.raw["targets"][target].get("kernels", {})
    alternatives = {op: KERNELS[op].alternatives[impl] for op, impl in chosen.items()
                    if op != "moe_experts" and op in KERNELS and impl in KERNELS[op].alternatives}
    wide_dtype = torch.float64 if act == torch.float32 else torch.float32
    wide_model = _widened(ref, wide_dtype)
    eager, wide = _Eager(ref, exp, alternatives, eager_device), _Eager(wide_model, exp, alternatives, eager_device)
    eager_e2e = _Eager(ref, exp, alternatives, eager_device)
    wide_e2e = _Eager(wide_model, exp, alternatives, eager_device)
    names = tap_names(ref.cfg)
    n_layers = ref.cfg.n_layers
    rep.parts = {n: PartVerdict(choice=n.split(".", 1)[1] in CHOICE_PARTS) for n in names}
    rep.parts["head"] = PartVerdict()

    def compiled(tokens: list[int], pos: int) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
        a = np.array([tokens], dtype=np.int64)
        args = (a, np.array([pos]), np.array([len(tokens)]), np.array([0]))
        fn = PROBE_PREFILL if len(tokens) > 1 else PROBE_DECODE
        res = probe.call(fn, *args, *probe_state)
        if len(res) != len(names) + 1:
            raise ValueError(f"the probe returned {len(res)} results, expected {len(names) + 1}")
        lg, _ = eng.invoke("prefill_bs1" if len(tokens) > 1 else "decode_bs1", *args)
        return (np.asarray(res[0], np.float64)[0], dict(zip(names, res[1:])),
                np.array(lg.to_host(), dtype=np.float64)[0])

    t = time.perf_counter()
    calls = _chunks(ids, exp.prefill_min_tokens, exp.prefill_max_tokens)
    pos, agree, total = len(ids), 0, 0
    for step in range(steps + 1):
        for tokens, at in calls:
            lp, taps_c, lx = compiled(tokens, at)
            inputs = [None, *(taps_c[f"{i}.out"] for i in range(n_layers))]
            le, taps_e = eager.layers(tokens, at, inputs)
            lw, taps_w = wide.layers(tokens, at, inputs)
            for n in names:
                rep.parts[n].add(taps_c[n], taps_e[n], taps_w[n])
            rep.parts["head"].add(lp, le, lw)
            lx_e, lx_w = eager_e2e(tokens, at), wide_e2e(tokens, at)
        rep.logits.add(lx, lx_e, lx_w)
        rep.probe_vs_export = max(rep.probe_vs_export, value_error(lp, lx))
        nxt = int(np.argmax(lx))
        agree, total = agree + (nxt == int(np.argmax(lx_e))), total + 1
        calls = [([nxt], pos)]
        pos += 1
        log(f"step {step}: export token {nxt}")
    rep.greedy_agree = f"{agree}/{total}"
    rep.seconds["activations"] = time.perf_counter() - t
    floor = DTYPE_FLOOR.get(act_name, 2.0 ** -8)
    rep.first_divergent_layer, rep.first_divergent_part = verdict(rep.parts, floor, PARTS)
    rep.logits.divergent = judge_part(rep.logits, floor)
    rep.parts["head"].divergent = judge_part(rep.parts["head"], floor)
    rep.seconds["total"] = time.perf_counter() - t0
    return rep


# ---------------------------------------------------------------------------------------------
# the command


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token ids are integers separated by commas or spaces, got {text!r}")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("out", help="the export directory")
    ap.add_argument("--checkpoint", metavar="DIR",
                    help="the checkpoint to audit against (default: the one config.json names as the export's source)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--prompt", metavar="TEXT", help="prompt text (needs the export's tokenizer; default: a fixed "
                                                    "paragraph, or 96 fixed random ids without a tokenizer)")
    g.add_argument("--prompt-ids", metavar="IDS", type=_ids, help="prompt token ids, e.g. 0,17,42")
    ap.add_argument("--steps", type=int, default=8, help="greedy decode steps after the prefill")
    ap.add_argument("--device", default="local-task", help="IREE driver: local-task (llvm-cpu), cuda, hip (gfx942)")
    ap.add_argument("--eager-device", default="cpu", help="torch device of the eager reference")
    ap.add_argument("--work-dir", metavar="DIR", help="compile the probe here and reuse it on the next audit "
                                                      "(default: a temporary directory)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def run(args: argparse.Namespace) -> int:
    """`dsv4 audit`: 0 consistent, 1 divergent (ValueError for bad input: the CLI prints it, exit 2)."""
    log = (lambda s: print(s, file=sys.stderr, flush=True))
    rep = run_audit(args.out, checkpoint=args.checkpoint, prompt=args.prompt, prompt_ids=args.prompt_ids,
                    steps=args.steps, device=args.device, eager_device=args.eager_device, work_dir=args.work_dir,
                    log=log)
    print(rep.table())
    print(f"audit took {rep.seconds['total']:.1f} s (probe compile {rep.seconds.get('probe_compile', 0):.1f} s)")
    if args.json:
        print(json.dumps(rep.to_json()))
    return 0 if rep.consistent else 1


if __name__ == "__main__":
    _ap = argparse.ArgumentParser(prog="python -m dsv4.bench.audit", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(_ap)
    _args = _ap.parse_args()
    try:
        sys.exit(run(_args))
    except (ValueError, OSError, RuntimeError) as _e:
        print(f"dsv4 audit: error: {_e}", file=sys.stderr)
        sys.exit(2)
