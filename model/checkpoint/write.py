"""Writing: a model (or state dict) as a checkpoint directory in the official layout and dtypes, or
the transformers layout; float weights are quantized on the way, low-bit ones copied byte for byte."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import nn
from tqdm import tqdm

from ..config import ModelConfig
from ..quant.formats import E4M3FN, FP8_BLOCK, MXFP4_BLOCK, dequant_fp8_block, dequant_mxfp4
from ..quant.quantize import quantize_fp8_block, quantize_mxfp4
from dsv4.contract.release import BF16 as _BF16, F32 as _F32, FP8_LINEAR as _FP8_LINEAR, I64 as _I64
from dsv4.contract.tokenizer import save_tokenizer
from ..transformers_config import transformers_config_dict
from .inventory import INDEX_FILE, SINGLE_FILE
from .names import EXPERTS, transformers_name

__all__ = ["write_checkpoint", "transformers_state_dict", "unquantized_config", "DEFAULT_MAX_SHARD_BYTES"]

DEFAULT_MAX_SHARD_BYTES = 4 << 30
# what the official checkpoint holds for each model tensor (docs/model.md, Checkpoint format): the
# table of contract/release.py (_FP8_LINEAR, _BF16, _F32, _I64), which dsv4 bench counts bytes with



@dataclass
class _Out:
    """One tensor to write: name, dtype and shape known up front (for sharding), data made on demand."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _source_format(w: torch.Tensor, s: torch.Tensor | None) -> tuple[str, str | None]:
    if w.dtype == torch.float8_e4m3fn:
        return "fp8", "fp32" if s is not None and s.dtype == torch.float32 else "ue8m0"
    if w.dtype in (torch.uint8, torch.int8):
        return "fp4", "ue8m0"
    return "float", None


def _dequantize(w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    fmt, _ = _source_format(w, s)
    if fmt == "fp8":
        return dequant_fp8_block(w, s)
    if fmt == "fp4":
        return dequant_mxfp4(w.view(torch.uint8), s)
    return w.float()


def _as_e8m0(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.uint8).view(torch.float8_e8m0fnu)


class _Encoded:
    """A weight's encoded (weight, scale) pair, made once for its two tensors and dropped after both
    were taken, so a write holds at most a shard's worth of encoded tensors."""

    def __init__(self, make: Callable[[], tuple[torch.Tensor, torch.Tensor | None]], parts: int):
        self._make, self._parts, self._value, self._taken = make, parts, None, 0

    def part(self, i: int) -> torch.Tensor:
        if self._value is None:
            self._value = self._make()
        out = self._value[i]
        self._taken += 1
        if self._taken == self._parts:
            self._value = None
        return out


def _weight_outs(name: str, w: torch.Tensor, s: torch.Tensor | None, fmt: str,
                 scale_fmt: str, dense: torch.dtype = torch.bfloat16) -> list[_Out]:
    """Checkpoint tensors for one weight in target format fmt ('fp8', 'fp4' or 'bf16'; 'bf16' means
    unquantized, stored as `dense`)."""
    src = _source_format(w, s)
    n, k = w.shape[0], (w.shape[1] * 2 if src[0] == "fp4" else w.shape[1])
    sname = name[: -len("weight")] + "scale"
    target = {"fp8": ("fp8", scale_fmt), "fp4": ("fp4", "ue8m0"), "bf16": ("float", None)}[fmt]

    def encode() -> tuple[torch.Tensor, torch.Tensor | None]:
        if src == target and fmt != "bf16":  # already in the checkpoint format: byte for byte
            return w, s
        v = _dequantize(w, s)
        if fmt == "fp8":
            return quantize_fp8_block(v, scale_fmt)
        if fmt == "fp4":
            return quantize_mxfp4(v)
        return v.to(dense), None

    if fmt == "bf16":
        enc = _Encoded(encode, 1)
        return [_Out(name, dense, (n, k), lambda: enc.part(0))]
    enc = _Encoded(encode, 2)
    if fmt == "fp8":
        sshape = (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK))
        sdt = torch.float32 if scale_fmt == "fp32" else torch.float8_e8m0fnu
        return [_Out(name, E4M3FN, (n, k), lambda: enc.part(0)),
                _Out(sname, sdt, sshape, lambda: enc.part(1) if sdt == torch.float32 else _as_e8m0(enc.part(1)))]
    return [_Out(name, torch.int8, (n, k // 2), lambda: enc.part(0).view(torch.int8)),
            _Out(sname, torch.float8_e8m0fnu, (n, k // MXFP4_BLOCK), lambda: _as_e8m0(enc.part(1)))]


def _official_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig,
                      dense: torch.dtype = torch.bfloat16) -> list[_Out]:
    """The official checkpoint inventory for a model state dict, in the model's order. `dense`: the
    dtype of the unquantized weights (bf16 in a checkpoint)."""
    lin_fmt = "fp8" if cfg.quantization_config else "bf16"
    scale_fmt = (cfg.quantization_config or {}).get("scale_fmt") or "ue8m0"
    exp_fmt = cfg.expert_dtype if cfg.expert_dtype in ("fp4", "fp8") else "bf16"
    outs: list[_Out] = []
    unknown = []
    for name, t in state.items():
        m = EXPERTS.match(name)
        if m:
            if m.group(3):
                continue
            prefix, w = m.group(1), m.group(2)
            sc = state.get(f"{name}_scale")
            for e in range(t.shape[0]):
                outs += _weight_outs(f"{prefix}.{e}.{w}.weight", t[e], None if sc is None else sc[e],
                                     exp_fmt, scale_fmt, dense)
        elif name.endswith(".scale") and name[:-6] + ".weight" in state:
            continue
        elif _FP8_LINEAR.search(name):
            outs += _weight_outs(name, t, state.get(name[:-7] + ".scale"), lin_fmt, scale_fmt, dense)
        elif _BF16.search(name):
            if t.dtype in (torch.float8_e4m3fn, torch.uint8):
                unknown.append(f"{name} ({t.dtype}: expected a float tensor)")
            outs.append(_Out(name, dense, tuple(t.shape), lambda t=t: t.to(dense)))
        elif _F32.search(name):
            outs.append(_Out(name, torch.float32, tuple(t.shape), lambda t=t: t.to(torch.float32)))
        elif _I64.search(name):
            outs.append(_Out(name, torch.int64, tuple(t.shape), lambda t=t: t.to(torch.int64)))
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"write_checkpoint: no checkpoint format is known for {unknown}")
    return outs


def _transformers_tensors(outs: list[_Out]) -> list[_Out]:
    """Rename to the transformers layout and stack the routed experts (gate_up = cat(w1, w3))."""
    by_name = {o.name: o for o in outs}
    result: list[_Out] = []
    done: set[str] = set()
    rx = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|scale)$")
    n_experts: dict[str, int] = {}
    for o in outs:
        m = rx.match(o.name)
        if m:
            n_experts[m.group(1)] = max(n_experts.get(m.group(1), 0), int(m.group(2)) + 1)
    for o in outs:
        m = rx.match(o.name)
        if m is None:
            result.append(_Out(transformers_name(o.name), o.dtype, o.shape, o.make))
            continue
        prefix, leaf = m.group(1), m.group(4)
        for kind, parts in (("gate_up_proj", ("w1", "w3")), ("down_proj", ("w2",))):
            key = f"{prefix}.{kind}.{leaf}"
            if m.group(3) not in parts or key in done:
                continue
            done.add(key)
            E = n_experts[prefix]
            members = [[by_name[f"{prefix}.{e}.{p}.{leaf}"] for p in parts] for e in range(E)]
            rows = sum(x.shape[0] for x in members[0])

            def make(members: list[list[_Out]] = members) -> torch.Tensor:
                return torch.stack([torch.cat([x.make() for x in row], 0) for row in members])

            base = transformers_name(f"{prefix}.{kind}")
            name = base if leaf == "weight" else f"{base}_scale_inv"
            result.append(_Out(name, o.dtype, (E, rows, o.shape[1]), make))
    return result


def unquantized_config(cfg: ModelConfig) -> ModelConfig:
    """cfg with no FP8 linears and no low-bit experts: the model transformers_state_dict describes."""
    return ModelConfig.from_dict({**cfg.to_dict(), "quantization_config": None, "expert_dtype": None})


def transformers_state_dict(model_or_state: nn.Module | dict[str, torch.Tensor], cfg: ModelConfig,
                            dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The tensors transformers' DeepseekV4ForCausalLM holds for this model, unquantized: FP8 and
    MXFP4 weights dequantized (to `dtype`, as every other float weight), transformers' names and
    stacked experts; fp32 tensors (mHC, sinks, biases) stay fp32. Its config is
    transformers_config_dict(unquantized_config(cfg)). The MTP layers are included under their
    names; transformers' model has none and ignores them."""
    state = model_or_state.state_dict() if isinstance(model_or_state, nn.Module) else dict(model_or_state)
    outs = _official_tensors(state, unquantized_config(cfg), dtype)
    return {o.name: o.make() for o in _transformers_tensors(outs)}


def _write_tokenizer(tokenizer: Tokenizer | str | os.PathLike | None, out: Path, cfg: ModelConfig) -> None:
    if tokenizer is None:
        return
    if isinstance(tokenizer, (str, os.PathLike)):
        src = Path(tokenizer)
        files = [src] if src.is_file() else [p for p in src.iterdir() if p.name.startswith("tokenizer")
                                              or p.name == "special_tokens_map.json"]
        if not files:
            raise FileNotFoundError(f"no tokenizer files in {src}")
        for p in files:
            shutil.copyfile(p, out / p.name)
        return
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer: expected a tokenizers.Tokenizer, a path or None, got {type(tokenizer).__name__}")
    save_tokenizer(tokenizer, out, model_max_length=cfg.max_seq_len)


def write_checkpoint(model_or_state: nn.Module | dict[str, torch.Tensor], cfg: ModelConfig,
                     directory: str | os.PathLike, layout: str = "official", *,
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                     tokenizer: Tokenizer | str | os.PathLike | None = None,
                     overwrite: bool = False, progress: bool | None = None) -> Path:
    """Write a checkpoint directory in the official (or transformers) layout and dtypes.

    The target formats come from `cfg`: FP8 linears if cfg.quantization_config (E8M0 scales, or
    float32 with scale_fmt 'fp32'), experts as cfg.expert_dtype ('fp4' MXFP4, 'fp8', else bf16).
    Float weights are quantized; weights already in the target format are copied byte for byte.
    More than `max_shard_bytes` in all gives `model-0000i-of-0000n.safetensors` shards plus
    `model.safetensors.index.json`. tokenizer: a `tokenizers.Tokenizer` is saved (tokenizer.json +
    tokenizer_config.json), a path copies the tokenizer files from there, None writes none (training
    one is `dsv4.train.tokenizer`'s job).
    """
    if layout not in ("official", "transformers"):
        raise ValueError(f"layout must be 'official' or 'transformers', got {layout!r}")
    state = model_or_state.state_dict() if isinstance(model_or_state, nn.Module) else dict(model_or_state)
    outs = _official_tensors(state, cfg)
    if layout == "transformers":
        outs = _transformers_tensors(outs)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    old = [p for p in out.iterdir() if p.name.endswith(".safetensors") or p.name == INDEX_FILE]
    if old and not overwrite:
        raise FileExistsError(f"{out} already holds a checkpoint ({old[0].name}); pass overwrite=True")
    for p in old:
        p.unlink()

    shards: list[list[_Out]] = [[]]
    size = 0
    for o in outs:
        if shards[-1] and size + o.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(o)
        size += o.nbytes
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    total = sum(o.nbytes for o in outs)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {out.name}",
               disable=None if progress is None else not progress, leave=False)
    weight_map = {}
    for fname, shard in zip(names, shards):
        tensors = {}
        for o in shard:
            t = o.make().contiguous()
            if t.dtype != o.dtype or tuple(t.shape) != o.shape:
                raise AssertionError(f"{o.name}: made {t.dtype} {tuple(t.shape)}, planned {o.dtype} {o.shape}")
            tensors[o.name] = t
            weight_map[o.name] = fname
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        bar.update(sum(o.nbytes for o in shard))
        del tensors
    bar.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    config = cfg.to_dict() if layout == "official" else transformers_config_dict(cfg)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "do_sample": True,
           "temperature": 1.0, "top_p": 1.0}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    _write_tokenizer(tokenizer, out, cfg)
    return out
