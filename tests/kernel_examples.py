"""Two small hot spots for the kernel machinery's tests (tests/test_export_infra.py), declared as the
model's are (``dsv4.model.kernels.Kernel``) but in their own registry, ``EXAMPLES``, so the model's
kernel table stays the model's. Route them with ``use_kernels(choices, registry=EXAMPLES)``.

* ``gather_rows(table[N, D], idx[K]) -> [K, D]``: row gather (embedding lookup, KV gather);
  ``D`` is specialized into the kernel, ``N`` and ``K`` stay dynamic.
* ``silu_mul(gate[T, D], up[T, D], limit) -> [T, D]``: DeepSeek's SwiGLU core with the optional
  clamp (``limit > 0``: gate <= limit, -limit <= up <= limit); fully dynamic, the float ``limit``
  is a compile-time attribute, math in f32 for any float input dtype (as torch does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4.model.kernels import Kernel, hook

__all__ = ["EXAMPLES", "gather_rows", "silu_mul"]

EXAMPLES: dict[str, Kernel] = {}


def kernel_op(*, mlir: str, **spec):
    """Declare the decorated reference in EXAMPLES, with its MLIR template given as text."""

    def wrap(ref):
        EXAMPLES[ref.__name__] = Kernel.declare(ref.__name__, ref, mlir=mlir, **spec)
        return hook(ref.__name__, ref)

    return wrap

GATHER_ROWS_MLIR = """
util.func private @{{kernel_name}}(%table: {{table_type}}, %idx: {{idx_type}}) -> {{out_type}} {
  %c0 = arith.constant 0 : index
  %k = tensor.dim %idx, %c0 : {{idx_type}}
  %empty = tensor.empty(%k) : {{out_type}}
  %out = linalg.generic {
      indexing_maps = [affine_map<(i, j) -> (i)>, affine_map<(i, j) -> (i, j)>],
      iterator_types = ["parallel", "parallel"]}
      ins(%idx : {{idx_type}}) outs(%empty : {{out_type}}) {
    ^bb0(%row: {{idx_dtype}}, %unused: {{out_dtype}}):
      %r = arith.index_cast %row : {{idx_dtype}} to index
      %j = linalg.index 1 : index
      %v = tensor.extract %table[%r, %j] : {{table_type}}
      linalg.yield %v : {{out_dtype}}
  } -> {{out_type}}
  util.return %out : {{out_type}}
}
"""


@kernel_op(
    args={"table": "N, D", "idx": "K"},
    results={"out": "K, D"},
    static=("D",),
    dtypes={"idx": (torch.int64, torch.int32)},
    mlir=GATHER_ROWS_MLIR,
)
def gather_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``table[idx]``."""
    return table[idx]


SILU_MUL_MLIR = """
{%- set f32 = gate_dtype == "f32" -%}
util.func private @{{kernel_name}}(%gate: {{gate_type}}, %up: {{up_type}}) -> {{out_type}} {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %t = tensor.dim %gate, %c0 : {{gate_type}}
  %d = tensor.dim %gate, %c1 : {{gate_type}}
  %empty = tensor.empty(%t, %d) : {{out_type}}
  %out = linalg.generic {
      indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>,
                       affine_map<(i, j) -> (i, j)>],
      iterator_types = ["parallel", "parallel"]}
      ins(%gate, %up : {{gate_type}}, {{up_type}}) outs(%empty : {{out_type}}) {
    ^bb0(%g_in: {{gate_dtype}}, %u_in: {{up_dtype}}, %unused: {{out_dtype}}):
{%- if f32 %}{% set g = "%g_in" %}{% set u = "%u_in" %}
{%- else %}
      %g_ext = arith.extf %g_in : {{gate_dtype}} to f32
      %u_ext = arith.extf %u_in : {{up_dtype}} to f32
{%- set g = "%g_ext" %}{% set u = "%u_ext" %}
{%- endif %}
{%- if limit > 0 %}
      %lim = arith.constant {{ "%.9e" % limit }} : f32
      %nlim = arith.constant {{ "%.9e" % -limit }} : f32
      %g_cl = arith.minimumf {{g}}, %lim : f32
      %u_hi = arith.minimumf {{u}}, %lim : f32
      %u_cl = arith.maximumf %u_hi, %nlim : f32
{%- set g = "%g_cl" %}{% set u = "%u_cl" %}
{%- endif %}
      %one = arith.constant 1.0 : f32
      %ng = arith.negf {{g}} : f32
      %e = math.exp %ng : f32
      %den = arith.addf %one, %e : f32
      %silu = arith.divf {{g}}, %den : f32
      %r = arith.mulf %silu, {{u}} : f32
{%- if f32 %}
      linalg.yield %r : f32
{%- else %}
      %r_t = arith.truncf %r : f32 to {{out_dtype}}
      linalg.yield %r_t : {{out_dtype}}
{%- endif %}
  } -> {{out_type}}
  util.return %out : {{out_type}}
}
"""


@kernel_op(
    args={"gate": "T, D", "up": "T, D", "limit": float},
    results={"out": "T, D"},
    dtypes={"gate": (torch.float32, torch.bfloat16, torch.float16), "up": (torch.float32, torch.bfloat16, torch.float16)},
    mlir=SILU_MUL_MLIR,
)
def silu_mul(gate: torch.Tensor, up: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """``silu(gate) * up`` in at least f32 (clamped when ``limit > 0``), in gate's dtype."""
    acc = torch.promote_types(gate.dtype, torch.float32)
    g, u = gate.to(acc), up.to(acc)
    if limit > 0:
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    return (F.silu(g) * u).to(gate.dtype)
