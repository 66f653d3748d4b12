"""The bytes one decode step moves, from an export's tensor shapes (torch-free: `dsv4 bench` runs on a
runtime-only install), in two accounts:

* ``implementation``: what the current lowering reads (export/lowering.py, model/kernels):
  - dense FP8 weights: the decode entry points use a bf16 copy decoded once at load (the compiler
    hoists it, export/compile.py HOIST_FLAG): 2 bytes a weight, the block scales not read; a one-row
    decode whose FP8 linears take `kernel_fp8_gemv` (a variant: `--kernel`) reads the FP8 bytes and
    scales instead (`fp8_read_in_place`);
  - fp32 weights of `f32_linear` (compressor wkv/wgate, the router gate, the mHC mixes) beside a bf16
    activation: three bf16 terms (model/kernels/dense.mlir.jinja): 6 bytes a weight;
  - routed experts: `moe_experts_routed` gathers one expert's weights per (token, slot) pair when
    B*k <= E, else per block of GROUP_BLOCK rows (a static count, `expert_blocks`); each gathered copy
    is read from the stack, written, and read again by the GEMM (3x its bytes), unless the export
    reads experts in place (config.json's kernels: `mxfp4_linear_gathered` = kernel or kernel_gemm: 1x;
    `experts_read_in_place`);
  - everything else as stored; embedding and tid2eid rows: one per token.
* ``release``: what the release checkpoint's format needs (contract/release.py): FP8 linears 1 byte
  + an E8M0 byte per 128x128 block, MXFP4 experts 0.5 byte + an E8M0 byte per 32, bf16 2, fp32 4; the
  routed experts counted once per distinct expert the step's tokens select.

State (both accounts): the window and compressor rings whole, the compressed KV and indexer key rows
up to the context (context / ratio), the CSA KV rows the indexer selects (index_topk).
"Layers" is every `layers.N.` tensor plus the state; the rest (embedding, head, final mixes and
norm) is the head. MTP blocks are not run by decode. `dsv4 bench` uses it; on its own it prints both
accounts for an export's config.json (no weights, no device; uniform routing):

    python -m dsv4.bench.traffic OUT [--batch 1 64] [--context 1024]
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from typing import Any, Mapping, Sequence

from dsv4.contract.artifact import TensorSpec, state_stage
from dsv4.contract.release import BF16, F32, FP8_LINEAR, I64

__all__ = ["DATASHEET_TBPS", "GROUP_BLOCK", "datasheet_peak", "expected_distinct", "expert_blocks", "experts_read_in_place",
           "fp8_read_in_place", "reads_in_place", "step_bytes"]

# HBM bandwidth from the vendors' datasheets, TB/s, by a name the driver reports
DATASHEET_TBPS = {"H200": 4.8, "MI300X": 5.3}
# rows per gathered expert block of a decode step: model/kernels/moe.py GROUP_BLOCK (tests/test_bench.py
# checks the two agree, and `expert_blocks` against the model's `grouped_blocks`)
GROUP_BLOCK = 16
_FP8_BLOCK, _MXFP4_BLOCK = 128, 32
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "uint8": 1,
             "int8": 1, "int64": 8, "int32": 4}
# fp32 weights that f32_linear multiplies (three bf16 terms beside a bf16 activation)
_F32_LINEAR = re.compile(r"\.compressor\.(wkv|wgate)\.weight$|\.ffn\.gate\.weight$|hc_(attn|ffn|head)_fn$")
_EXPERT = re.compile(r"^(layers\.\d+)\.ffn\.experts\.(w[123])(_scale)?$")


def datasheet_peak(device_name: str | None) -> float | None:
    """The datasheet HBM bandwidth (TB/s) of a device name such as "NVIDIA H200", or None if unknown."""
    if not device_name:
        return None
    name = device_name.upper()
    hits = [k for k in DATASHEET_TBPS if re.search(rf"\b{k}\b", name)]
    return DATASHEET_TBPS[max(hits, key=len)] if hits else None


def expected_distinct(n_experts: int, k: int, batch: int) -> float:
    """Expected distinct experts `batch` tokens select under uniform top-k routing: E (1 - (1 - k/E)^B)."""
    return n_experts * (1 - (1 - k / n_experts) ** batch)


def expert_blocks(n_experts: int, k: int, batch: int, block: int = GROUP_BLOCK) -> int:
    """Expert weight gathers per layer of a decode step of `batch` rows (model/kernels/moe.py
    `moe_experts_routed`): one per pair when P = B*k <= E, else the static block bound
    min(E, P) + (P - min(E, P)) // block."""
    P = batch * k
    if P <= n_experts:
        return P
    m = min(n_experts, P)
    return m + (P - m) // block


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _release_bytes(name: str, spec: TensorSpec, expert_dtype: str) -> float:
    """Bytes of one dense tensor in the release format (experts are counted per expert elsewhere)."""
    n = _numel(spec.shape)
    if FP8_LINEAR.search(name):
        N, K = spec.shape[-2], spec.shape[-1]
        return n + math.ceil(N / _FP8_BLOCK) * math.ceil(K / _FP8_BLOCK)
    if BF16.search(name):
        return 2 * n
    if F32.search(name):
        return 4 * n
    if I64.search(name):
        return 8 * n
    return n * _ITEMSIZE[spec.dtype]  # not in the release table: as stored


def _release_expert_bytes(shape: Sequence[int], dtype: str, expert_dtype: str) -> float:
    """Release bytes of one expert's weight [out, in] (w1/w2/w3) from its stored [E, out, in'] shape."""
    out_f, stored_in = shape[1], shape[2]
    in_f = 2 * stored_in if dtype in ("uint8", "int8") and expert_dtype == "fp4" else stored_in  # packed MXFP4
    if expert_dtype == "fp4":
        return out_f * in_f / 2 + out_f * math.ceil(in_f / _MXFP4_BLOCK)
    if expert_dtype == "fp8":
        return out_f * in_f + math.ceil(out_f / _FP8_BLOCK) * math.ceil(in_f / _FP8_BLOCK)
    return 2 * out_f * in_f


def experts_read_in_place(gathered_impl: str) -> bool:
    """Whether a decode reads its routed experts in place under the export's `mxfp4_linear_gathered`
    implementation: "kernel" (one sequential reduction) and "kernel_gemm" (blocks of rows: the gather inside
    the GEMM's dispatch; one row a block: inside the GEMV's) at every batch size; "reference" copies them."""
    return gathered_impl in ("kernel", "kernel_gemm")


def fp8_read_in_place(kernels: Mapping[str, str], batch: int) -> bool:
    """Whether a decode of `batch` rows reads the dense FP8 weights as stored (1 byte a weight and the block
    scales) under the export's kernel choices: one row, both FP8 linears (the shared expert's pair
    included) lowered with `kernel_fp8_gemv`; otherwise their bf16 copy made at load time."""
    return batch == 1 and all(kernels.get(op) == "kernel_fp8_gemv" for op in ("fp8_block_linear", "fp8_block_linear_shared"))


def reads_in_place(raw_config: Mapping[str, Any], batch: int) -> dict[str, bool]:
    """step_bytes' `experts_in_place` and `fp8_in_place` for a decode of `batch` rows of an export (its
    config.json as a dict): what every target's kernel choices read in place (a mixed-target export whose
    targets differ gets the copies' account)."""
    kernels = [t.get("kernels", {}) for t in raw_config.get("targets", {}).values()] or [{}]
    return {"experts_in_place": all(experts_read_in_place(kv.get("mxfp4_linear_gathered", "reference")) for kv in kernels),
            "fp8_in_place": all(fp8_read_in_place(kv, batch) for kv in kernels)}


def step_bytes(model: Mapping[str, Any], tensors: Sequence[TensorSpec], state: Sequence[Any], batch: int,
               context: int, max_seq_len: int, activation_dtype: str, experts_in_place: bool = False,
               distinct_experts: float | None = None, fp8_in_place: bool = False) -> dict[str, Any]:
    """Bytes of one decode step of `batch` rows at position ~`context` (module docstring): for each
    account {"layers", "head", "state", "total", "per_layer"} (layers includes the state; per_layer is
    layers / num_hidden_layers), plus the expert counts used. `tensors`: the export's whole-tensor
    inventory (keys with or without `model.`); `distinct_experts`: distinct experts per layer per step
    if measured (default: the uniform-routing expectation)."""
    V, L = model["vocab_size"], model["num_hidden_layers"]
    E, k = model.get("n_routed_experts", 1), model.get("num_experts_per_tok", 1)
    expert_dtype = model.get("expert_dtype", "bf16")
    distinct = expected_distinct(E, k, batch) if distinct_experts is None else distinct_experts
    blocks = expert_blocks(E, k, batch)
    bf16_act = activation_dtype == "bfloat16"
    impl = {"layers": 0.0, "head": 0.0}
    rel = {"layers": 0.0, "head": 0.0}
    fp8_weights = {t.name.removeprefix("model.") for t in tensors if t.dtype.startswith("float8")}
    for spec in tensors:
        name = spec.name.removeprefix("model.")
        if name.startswith("mtp."):
            continue
        part = "layers" if name.startswith("layers.") else "head"
        n, stored = _numel(spec.shape), spec.nbytes
        m = _EXPERT.match(name)
        if m:  # [E, ...] stacks: per expert
            impl[part] += stored / E * blocks * (1 if experts_in_place else 3)
            if not m.group(3):
                rel[part] += _release_expert_bytes(spec.shape, spec.dtype, expert_dtype) * distinct
            continue
        rows = min(1.0, batch / V) if name == "embed.weight" or I64.search(name) else 1.0
        rel[part] += 0.0 if name.endswith(".scale") else _release_bytes(name, spec, expert_dtype) * rows
        if spec.dtype.startswith("float8"):
            impl[part] += n if fp8_in_place else 2 * n  # as stored, or the hoisted bf16 copy
        elif name.endswith(".scale") and name[:-6] + ".weight" in fp8_weights:
            impl[part] += stored if fp8_in_place else 0  # read beside the FP8 bytes, or folded into the copy
        elif spec.dtype == "float32" and bf16_act and _F32_LINEAR.search(name):
            impl[part] += 6 * n  # three bf16 terms
        else:
            impl[part] += stored * rows
    s = 0.0
    for st in state:
        per_slot = st.nbytes / st.shape[0]
        sname = state_stage(st.name)[1]  # a pipeline stage's "stage<k>.kv_r4" is a kv_r4
        if sname.startswith(("kv_r", "idx_kv_r")):  # [slots, layers, max_seq/r + 1, dim]
            r = int(sname.rsplit("_r", 1)[1])
            rows_kept = min(context, max_seq_len) // r
            if sname.startswith("kv_r") and r == 4:
                rows_kept = min(rows_kept, model.get("index_topk", rows_kept))
            per_slot *= rows_kept / st.shape[2]
        s += per_slot * batch
    out: dict[str, Any] = {"experts_distinct": distinct, "experts_gathered": blocks,
                           "experts_in_place": experts_in_place, "fp8_in_place": fp8_in_place}
    for key, acc in (("implementation", impl), ("release", rel)):
        layers = acc["layers"] + s
        out[key] = {"layers": layers, "head": acc["head"], "state": s, "total": layers + acc["head"],
                    "per_layer": layers / L}
    return out


def main(argv: list[str] | None = None) -> int:
    from dsv4.contract.artifact import ExportConfig, whole_inventory

    ap = argparse.ArgumentParser(prog="python -m dsv4.bench.traffic", description=__doc__.splitlines()[0])
    ap.add_argument("export_dir", metavar="OUT", help="export directory (its config.json)")
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="default: the export's decode batch sizes")
    ap.add_argument("--context", type=int, default=None, help="default: the export's max_seq_len")
    a = ap.parse_args(argv)
    cfg = ExportConfig.load(a.export_dir, weights=False)
    if cfg.weights is None:
        print(f"{a.export_dir}: config.json has no weights inventory; re-export", file=sys.stderr)
        return 2
    tensors = whole_inventory(cfg.weights, cfg.n_devices)
    ctx = a.context or cfg.max_seq_len
    print(f"{'batch':>5} {'experts':>7} {'gathered':>8} {'impl MB':>10} {'impl MB/layer':>13} {'release MB':>10} "
          f"{'rel MB/layer':>12}")
    for b in a.batch or cfg.decode_batch_sizes:
        r = step_bytes(cfg.model, tensors, cfg.state, b, ctx, cfg.max_seq_len, cfg.raw.get("activation_dtype", ""),
                       **reads_in_place(cfg.raw, b))
        i, x = r["implementation"], r["release"]
        print(f"{b:>5} {r['experts_distinct']:>7.1f} {r['experts_gathered']:>8} {i['total'] / 1e6:>10.2f} "
              f"{i['per_layer'] / 1e6:>13.2f} {x['total'] / 1e6:>10.2f} {x['per_layer'] / 1e6:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
