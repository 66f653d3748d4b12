"""The model's hot spots as `KernelOp`s: a per-op switch between the torch reference and a kernel.

Hooks (model/kernels, `hookable`): sparse_attention, indexer_scores (+ top-k, see topk.py),
fp8_block_linear, mxfp4_linear, moe_experts. Each gets a KernelOp here whose "reference" is the
model's own function (so "reference" traces exactly what eager runs) and, where written, a
"kernel": hand-written MLIR inlined into the exported module (style A of kernel_op.py).

Use while tracing: ``with use_kernels({"sparse_attention": "kernel"}): fxb.export_program(...)``
(the exporter's ``kernels=`` argument does this). Ops not named keep the plain reference, traced
without a KernelOp in between. Shapes the KernelOp spec cannot express (x of any rank for the
linears; quantized expert weights, whose scales may be None) are adapted here: linears flatten
x to 2-D, moe_experts routes only float expert weights through its op.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping

import torch

from dsv4.model import kernels as mk
from dsv4.model.kernels import indexer as _indexer  # noqa: F401  (registers the hooks)
from dsv4.model.kernels import linear as _linear  # noqa: F401
from dsv4.model.kernels import moe as _moe  # noqa: F401
from dsv4.model.kernels import sparse_attention as _sa  # noqa: F401

from .kernel_op import KernelOp, impls, kernel_op

__all__ = ["MODEL_OPS", "use_kernels", "SPARSE_ATTENTION_MLIR"]

_F = (torch.float32, torch.bfloat16)
_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)

# ---------------------------------------------------------------------------------------------
# sparse attention: gather the selected rows, sink-aware softmax, P.V, as linalg (fp32 math)

SPARSE_ATTENTION_MLIR = """
{%- set f32 = q_dtype == "f32" -%}
util.func private @{{kernel_name}}(%q: {{q_type}}, %kv: {{kv_type}}, %idx: {{idx_type}}, %sink: {{sink_type}}) -> {{out_type}} {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %c2 = arith.constant 2 : index
  %zero = arith.constant 0.0 : f32
  %ninf = arith.constant 0xFF800000 : f32
  %scale = arith.constant {{ "%.9e" % scale }} : f32
  %b = tensor.dim %q, %c0 : {{q_type}}
  %t = tensor.dim %q, %c1 : {{q_type}}
  %k = tensor.dim %idx, %c2 : {{idx_type}}
  // sel[b,t,k,d] = kv[b, idx, d] (0 where idx < 0), as f32
  %sel0 = tensor.empty(%b, %t, %k) : tensor<?x?x?x{{D}}xf32>
  %sel = linalg.generic {
      indexing_maps = [affine_map<(b, t, k, d) -> (b, t, k)>, affine_map<(b, t, k, d) -> (b, t, k, d)>],
      iterator_types = ["parallel", "parallel", "parallel", "parallel"]}
      ins(%idx : {{idx_type}}) outs(%sel0 : tensor<?x?x?x{{D}}xf32>) {
    ^bb0(%i: {{idx_dtype}}, %o: f32):
      %bi = linalg.index 0 : index
      %di = linalg.index 3 : index
      %i0 = arith.constant 0 : {{idx_dtype}}
      %valid = arith.cmpi sge, %i, %i0 : {{idx_dtype}}
      %ic = arith.select %valid, %i, %i0 : {{idx_dtype}}
      %r = arith.index_cast %ic : {{idx_dtype}} to index
      %v = tensor.extract %kv[%bi, %r, %di] : {{kv_type}}
{%- if kv_dtype == "f32" %}
      %vf = arith.addf %v, %zero : f32
{%- else %}
      %vf = arith.extf %v : {{kv_dtype}} to f32
{%- endif %}
      %out = arith.select %valid, %vf, %zero : f32
      linalg.yield %out : f32
  } -> tensor<?x?x?x{{D}}xf32>
  // s[b,t,h,k] = scale * sum_d q . sel  (-inf where idx < 0)
  %s0 = tensor.empty(%b, %t, %k) : tensor<?x?x{{H}}x?xf32>
  %sz = linalg.fill ins(%zero : f32) outs(%s0 : tensor<?x?x{{H}}x?xf32>) -> tensor<?x?x{{H}}x?xf32>
  %dot = linalg.generic {
      indexing_maps = [affine_map<(b, t, h, k, d) -> (b, t, h, d)>, affine_map<(b, t, h, k, d) -> (b, t, k, d)>,
                       affine_map<(b, t, h, k, d) -> (b, t, h, k)>],
      iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction"]}
      ins(%q, %sel : {{q_type}}, tensor<?x?x?x{{D}}xf32>) outs(%sz : tensor<?x?x{{H}}x?xf32>) {
    ^bb0(%a: {{q_dtype}}, %c: f32, %acc: f32):
{%- if f32 %}
      %af = arith.addf %a, %zero : f32
{%- else %}
      %af = arith.extf %a : {{q_dtype}} to f32
{%- endif %}
      %p = arith.mulf %af, %c : f32
      %n = arith.addf %acc, %p : f32
      linalg.yield %n : f32
  } -> tensor<?x?x{{H}}x?xf32>
  %s = linalg.generic {
      indexing_maps = [affine_map<(b, t, h, k) -> (b, t, h, k)>, affine_map<(b, t, h, k) -> (b, t, k)>,
                       affine_map<(b, t, h, k) -> (b, t, h, k)>],
      iterator_types = ["parallel", "parallel", "parallel", "parallel"]}
      ins(%dot, %idx : tensor<?x?x{{H}}x?xf32>, {{idx_type}}) outs(%s0 : tensor<?x?x{{H}}x?xf32>) {
    ^bb0(%x: f32, %i: {{idx_dtype}}, %o: f32):
      %i0 = arith.constant 0 : {{idx_dtype}}
      %valid = arith.cmpi sge, %i, %i0 : {{idx_dtype}}
      %xs = arith.mulf %x, %scale : f32
      %r = arith.select %valid, %xs, %ninf : f32
      linalg.yield %r : f32
  } -> tensor<?x?x{{H}}x?xf32>
  // m[b,t,h] = max(max_k s, sink[h]); reductions start from fills (a broadcast init fails on gfx942)
  %m0 = tensor.empty(%b, %t) : tensor<?x?x{{H}}xf32>
  %mfill = linalg.fill ins(%ninf : f32) outs(%m0 : tensor<?x?x{{H}}xf32>) -> tensor<?x?x{{H}}xf32>
  %mk = linalg.generic {
      indexing_maps = [affine_map<(b, t, h, k) -> (b, t, h, k)>, affine_map<(b, t, h, k) -> (b, t, h)>],
      iterator_types = ["parallel", "parallel", "parallel", "reduction"]}
      ins(%s : tensor<?x?x{{H}}x?xf32>) outs(%mfill : tensor<?x?x{{H}}xf32>) {
    ^bb0(%x: f32, %acc: f32):
      %n = arith.maximumf %acc, %x : f32
      linalg.yield %n : f32
  } -> tensor<?x?x{{H}}xf32>
  %m = linalg.generic {
      indexing_maps = [affine_map<(b, t, h) -> (b, t, h)>, affine_map<(b, t, h) -> (h)>,
                       affine_map<(b, t, h) -> (b, t, h)>],
      iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%mk, %sink : tensor<?x?x{{H}}xf32>, {{sink_type}}) outs(%m0 : tensor<?x?x{{H}}xf32>) {
    ^bb0(%x: f32, %y: f32, %o: f32):
      %n = arith.maximumf %x, %y : f32
      linalg.yield %n : f32
  } -> tensor<?x?x{{H}}xf32>
  // den[b,t,h] = sum_k exp(s - m) + exp(sink - m)
  %dfill = linalg.fill ins(%zero : f32) outs(%m0 : tensor<?x?x{{H}}xf32>) -> tensor<?x?x{{H}}xf32>
  %dsum = linalg.generic {
      indexing_maps = [affine_map<(b, t, h, k) -> (b, t, h, k)>, affine_map<(b, t, h, k) -> (b, t, h)>,
                       affine_map<(b, t, h, k) -> (b, t, h)>],
      iterator_types = ["parallel", "parallel", "parallel", "reduction"]}
      ins(%s, %m : tensor<?x?x{{H}}x?xf32>, tensor<?x?x{{H}}xf32>) outs(%dfill : tensor<?x?x{{H}}xf32>) {
    ^bb0(%x: f32, %mx: f32, %acc: f32):
      %e0 = arith.subf %x, %mx : f32
      %e = math.exp %e0 : f32
      %n = arith.addf %acc, %e : f32
      linalg.yield %n : f32
  } -> tensor<?x?x{{H}}xf32>
  %den = linalg.generic {
      indexing_maps = [affine_map<(b, t, h) -> (b, t, h)>, affine_map<(b, t, h) -> (h)>,
                       affine_map<(b, t, h) -> (b, t, h)>, affine_map<(b, t, h) -> (b, t, h)>],
      iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%dsum, %sink, %m : tensor<?x?x{{H}}xf32>, {{sink_type}}, tensor<?x?x{{H}}xf32>)
      outs(%m0 : tensor<?x?x{{H}}xf32>) {
    ^bb0(%x: f32, %y: f32, %mx: f32, %o: f32):
      %e0 = arith.subf %y, %mx : f32
      %e = math.exp %e0 : f32
      %n = arith.addf %x, %e : f32
      linalg.yield %n : f32
  } -> tensor<?x?x{{H}}xf32>
  // p = exp(s - m) / den, rounded to the KV dtype as the reference does
  %p = linalg.generic {
      indexing_maps = [affine_map<(b, t, h, k) -> (b, t, h, k)>, affine_map<(b, t, h, k) -> (b, t, h)>,
                       affine_map<(b, t, h, k) -> (b, t, h)>, affine_map<(b, t, h, k) -> (b, t, h, k)>],
      iterator_types = ["parallel", "parallel", "parallel", "parallel"]}
      ins(%s, %m, %den : tensor<?x?x{{H}}x?xf32>, tensor<?x?x{{H}}xf32>, tensor<?x?x{{H}}xf32>)
      outs(%s0 : tensor<?x?x{{H}}x?xf32>) {
    ^bb0(%x: f32, %mx: f32, %dn: f32, %o: f32):
      %e0 = arith.subf %x, %mx : f32
      %e = math.exp %e0 : f32
      %r = arith.divf %e, %dn : f32
{%- if kv_dtype == "f32" %}
      linalg.yield %r : f32
{%- else %}
      %rt = arith.truncf %r : f32 to {{kv_dtype}}
      %rf = arith.extf %rt : {{kv_dtype}} to f32
      linalg.yield %rf : f32
{%- endif %}
  } -> tensor<?x?x{{H}}x?xf32>
  // o[b,t,h,d] = sum_k p . sel
  %o0 = tensor.empty(%b, %t) : tensor<?x?x{{H}}x{{D}}xf32>
  %oz = linalg.fill ins(%zero : f32) outs(%o0 : tensor<?x?x{{H}}x{{D}}xf32>) -> tensor<?x?x{{H}}x{{D}}xf32>
  %o = linalg.generic {
      indexing_maps = [affine_map<(b, t, h, d, k) -> (b, t, h, k)>, affine_map<(b, t, h, d, k) -> (b, t, k, d)>,
                       affine_map<(b, t, h, d, k) -> (b, t, h, d)>],
      iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction"]}
      ins(%p, %sel : tensor<?x?x{{H}}x?xf32>, tensor<?x?x?x{{D}}xf32>) outs(%oz : tensor<?x?x{{H}}x{{D}}xf32>) {
    ^bb0(%a: f32, %c: f32, %acc: f32):
      %x = arith.mulf %a, %c : f32
      %n = arith.addf %acc, %x : f32
      linalg.yield %n : f32
  } -> tensor<?x?x{{H}}x{{D}}xf32>
{%- if f32 %}
  util.return %o : {{out_type}}
{%- else %}
  %ot0 = tensor.empty(%b, %t) : {{out_type}}
  %ot = linalg.generic {
      indexing_maps = [affine_map<(b, t, h, d) -> (b, t, h, d)>, affine_map<(b, t, h, d) -> (b, t, h, d)>],
      iterator_types = ["parallel", "parallel", "parallel", "parallel"]}
      ins(%o : tensor<?x?x{{H}}x{{D}}xf32>) outs(%ot0 : {{out_type}}) {
    ^bb0(%x: f32, %y: {{out_dtype}}):
      %r = arith.truncf %x : f32 to {{out_dtype}}
      linalg.yield %r : {{out_dtype}}
  } -> {{out_type}}
  util.return %ot : {{out_type}}
{%- endif %}
}
"""


def _sa_ref(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    return mk.HOOKS["sparse_attention"](q, kv, idx, sink, scale)


sparse_attention_op = kernel_op(
    name="sparse_attention",
    args={"q": "B, T, H, D", "kv": "B, N, D", "idx": "B, T, K", "sink": "H", "scale": float},
    results={"out": "B, T, H, D"}, static=("H", "D"),
    dtypes={"q": _F, "kv": _F, "idx": (torch.int64,), "sink": (torch.float32,)},
    mlir=SPARSE_ATTENTION_MLIR,
)(_sa_ref)


# ---------------------------------------------------------------------------------------------
# indexer scores, FP8 block linear, MXFP4 linear, MoE experts: reference lowering for now


def _idx_ref(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return mk.HOOKS["indexer_scores"](q, w, keys)


indexer_scores_op = kernel_op(
    name="indexer_scores", args={"q": "B, T, Hi, Di", "w": "B, T, Hi", "keys": "B, R, Di"},
    results={"scores": "B, T, R"}, static=("Hi", "Di"), dtypes={"q": _F, "w": _F, "keys": _F},
)(_idx_ref)


def _fp8_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return mk.HOOKS["fp8_block_linear"](x, weight, scale)


fp8_block_linear_op = kernel_op(
    name="fp8_block_linear", args={"x": "M, K", "weight": "N, K", "scale": "NB, KB"},
    results={"y": "M, N"}, static=("N", "K", "NB", "KB"), dtypes={"x": _F, "weight": _FP8},
)(_fp8_ref)


def _mxfp4_ref(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return mk.HOOKS["mxfp4_linear"](x, packed, scale)


mxfp4_linear_op = kernel_op(
    name="mxfp4_linear", args={"x": "M, K", "packed": "N, KP", "scale": "N, KS"},
    results={"y": "M, N"}, static=("N", "KP", "KS"), dtypes={"x": _F, "packed": (torch.uint8, torch.int8)},
)(_mxfp4_ref)


def _moe_ref(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
             w3: torch.Tensor, limit: float) -> torch.Tensor:
    return mk.HOOKS["moe_experts"](x, weights, indices, w1, None, w2, None, w3, None, limit)


moe_experts_op = kernel_op(
    name="moe_experts",
    args={"x": "N, Dm", "weights": "N, Kx", "indices": "N, Kx", "w1": "E, I, Dm", "w2": "E, Dm, I",
          "w3": "E, I, Dm", "limit": float},
    results={"y": "N, Dm"}, static=("Dm", "Kx", "E", "I"), result_dtypes={"y": torch.float32},
    dtypes={"x": _F, "indices": (torch.int64,)},
)(_moe_ref)

MODEL_OPS: dict[str, KernelOp] = {op.name: op for op in (
    sparse_attention_op, indexer_scores_op, fp8_block_linear_op, mxfp4_linear_op, moe_experts_op)}


# ---------------------------------------------------------------------------------------------
# adapters: model hook signature -> KernelOp


def _linear_adapter(op: KernelOp) -> Callable[..., torch.Tensor]:
    def call(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        y = op(x.reshape(-1, x.shape[-1]), weight, scale)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    return call


def _moe_adapter(x, weights, indices, w1, s1, w2, s2, w3, s3, limit):
    if s1 is None and s2 is None and s3 is None:
        return moe_experts_op(x, weights, indices, w1, w2, w3, float(limit))
    return mk.HOOKS["moe_experts"](x, weights, indices, w1, s1, w2, s2, w3, s3, limit)


_ADAPTERS: dict[str, Callable[..., Any]] = {
    "sparse_attention": lambda q, kv, idx, sink, scale: sparse_attention_op(q, kv, idx, sink, float(scale)),
    "indexer_scores": indexer_scores_op,
    "fp8_block_linear": _linear_adapter(fp8_block_linear_op),
    "mxfp4_linear": _linear_adapter(mxfp4_linear_op),
    "moe_experts": _moe_adapter,
}


@contextlib.contextmanager
def use_kernels(choices: Mapping[str, str] | None) -> Iterator[None]:
    """Route the named hooks through their KernelOp with the chosen implementation
    ("reference", "kernel", "opaque"); '*' applies to every op that offers the implementation."""
    choices = dict(choices or {})
    if not choices:
        yield
        return
    expanded: dict[str, str] = {}
    for name, impl in choices.items():
        names = list(MODEL_OPS) if name == "*" else [name]
        if name != "*" and name not in MODEL_OPS:
            raise ValueError(f"unknown kernel op {name!r}; model ops: {sorted(MODEL_OPS)}")
        for n in names:
            if name == "*" and impl not in MODEL_OPS[n].impl_names:
                continue
            MODEL_OPS[n].implementation(impl)  # validates, raises ValueError listing the choices
            expanded[n] = impl
    with impls(**expanded), mk.overrides({n: _ADAPTERS[n] for n in expanded}):
        yield
