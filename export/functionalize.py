"""Functionalize the decode-state writes of a freshly traced program, without retracing it.

torch.export (non-strict) returns training IR, where the model's in-place state writes
(`index_put_` into the state arguments or a reshaped view of one, model/state.py) are still in place. turbine then calls
`ExportedProgram.run_decompositions`, which retraces the whole graph through functionalization and
the decomposition table: about 60 % of the export time (measured on 3 Flash layers, decode: trace
10.5 s, retrace 16.3 s even with an empty table). The importer needs only the state writes made
functional, so `functionalize_state_writes` rewrites those few nodes instead: each `index_put_`
becomes `index_put` on the state's latest value, later reads see that value, and the final values
are returned as input mutations (what functionalization would have produced; turbine's importer
turns them into in-place updates of the state buffers).

Safety: any other in-place op, a write into something that is not a user input, or a view of a
state input taken before its write and read after it (which eager would see updated) raises
`NotImplementedError`; the exporter then falls back to the full decomposition.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind, OutputSpec, TensorArgument
from torch.fx import Node
from torch.fx.node import map_arg

__all__ = ["functionalize_state_writes", "positive_unflatten_dims"]

# aten ops whose result aliases their first argument
_VIEW_OPS = frozenset({"alias", "as_strided", "chunk", "diagonal", "expand", "flatten", "movedim", "narrow",
                       "permute", "reshape", "select", "slice", "split", "split_with_sizes", "squeeze", "t",
                       "transpose", "unbind", "unflatten", "unsqueeze", "view"})


def _op(n: Node) -> str:
    return getattr(n.target, "__name__", str(n.target)).split(".")[0]


def functionalize_state_writes(ep: ExportedProgram) -> ExportedProgram:
    """Rewrite `ep` in place (see the module docstring); returns it."""
    g, sig = ep.graph, ep.graph_signature
    user_inputs = {s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT}
    nodes = list(g.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    latest: dict[Node, Node] = {}  # state input -> its value after the writes so far
    first_write: dict[Node, int] = {}
    for n in nodes:
        if n.op != "call_function":
            continue
        n.args = map_arg(n.args, lambda a: latest.get(a, a))
        n.kwargs = map_arg(n.kwargs, lambda a: latest.get(a, a))
        if n.target is torch.ops.aten.index_put_.default:
            target = n.args[0]
            # a write into a reshaped view of the state (model._set_rows: [rows, features], one index
            # tensor): the written view reshaped back is the state's new value
            whole = target.args[0] if target.op == "call_function" and target.target is torch.ops.aten.view.default \
                else target
            base = next((s for s, v in latest.items() if v is whole), whole)
            if base.op != "placeholder" or base.name not in user_inputs:
                raise NotImplementedError(f"in-place write into {base.name}, which is not a state input")
            with g.inserting_after(n):
                new = g.call_function(torch.ops.aten.index_put.default, n.args, n.kwargs)
            new.meta = dict(n.meta)
            n.replace_all_uses_with(new)
            g.erase_node(n)
            if whole is not target:
                with g.inserting_after(new):
                    new = g.call_function(torch.ops.aten.view.default, (new, list(whole.meta["val"].shape)))
                new.meta = {**whole.meta}
            latest[base] = new
            first_write.setdefault(base, pos[n])
        elif _op(n).endswith("_") and not _op(n).startswith("_"):
            raise NotImplementedError(f"in-place op {n.target}")
    alias_of = {s: s for s in first_write}  # views (of views ...) of a written state input
    for n in nodes:
        if n.op == "call_function" and _op(n) in _VIEW_OPS and n.args and n.args[0] in alias_of:
            base = alias_of[n] = alias_of[n.args[0]]
            w = first_write[base]
            if pos[n] < w and any(pos.get(u, -1) > w for u in n.users):
                raise NotImplementedError(f"{n.name}, a view of {base.name}, is read after a write to it")
    out = next(n for n in g.nodes if n.op == "output")
    out.args = (tuple(latest.values()) + tuple(out.args[0]),)
    sig.output_specs[:0] = [OutputSpec(kind=OutputKind.USER_INPUT_MUTATION, arg=TensorArgument(name=v.name),
                                       target=s.name) for s, v in latest.items()]
    g.lint()
    ep.graph_module.recompile()
    return ep


def positive_unflatten_dims(ep: ExportedProgram) -> ExportedProgram:
    """`aten.unflatten(x, -1, sizes)` -> `aten.unflatten(x, x.dim() - 1, sizes)`, in place.

    The decomposition retrace used to turn unflatten into a view; without it, torch-mlir's lowering of
    unflatten with a negative dim builds a wrong static cast (IREE 3.13: "tensor_static_info_cast ...
    [1,1,128,1] and [1,1,1,128] are cast incompatible"). A positive dim lowers correctly."""
    for n in ep.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.unflatten.int and n.args[1] < 0:
            rank = n.args[0].meta["val"].dim()
            n.args = (n.args[0], n.args[1] + rank, *n.args[2:])
    ep.graph_module.recompile()
    return ep
