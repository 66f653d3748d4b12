"""What a program of the first N layers of a preset costs to export: fx nodes, trace, import, compile.

Builds the model at the preset's real sizes with uninitialized weights (torch.empty: the memory is
reserved, never touched), traces one program the way `dsv4 export` does (decode_bs1, or
prefill_bs1 with T dynamic in [largest compression ratio, --max-chunk]) and imports it to MLIR;
`--compile TARGET` also runs iree-compile. `--fnuz` retypes the FP8 weights as e4m3fnuz (what
gfx942 gets). `--kernel OP=IMPL` as in `dsv4 export` (e.g. `--kernel '*=reference'` traces every
hot spot's torch reference: the graph before the kernels). A benchmark, not a test.

    python bench/graph_cost.py --layers 3 --program decode [--compile gfx942] [--fnuz] [--preset flash]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--program", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--max-chunk", type=int, default=512)
    ap.add_argument("--compile", metavar="TARGET")
    ap.add_argument("--fnuz", action="store_true")
    ap.add_argument("--kernel", action="append", default=[], metavar="OP=IMPL")
    ap.add_argument("--mlir", type=Path, help="keep the MLIR here")
    ap.add_argument("--top", type=int, default=12, help="print the N most frequent ops")
    a = ap.parse_args(argv)

    from dsv4.export import compat
    from dsv4.export.exporter import _Entry, _no_stack_traces, _program
    from dsv4.export.kernel_op import use_kernels
    from dsv4.model.config import ModelConfig
    from dsv4.model.model import Transformer
    from dsv4.model.state import state_spec

    compat.apply()
    from iree.turbine import aot

    base = ModelConfig.preset(a.preset)
    n = a.layers
    cfg = ModelConfig.preset(a.preset, num_hidden_layers=n, compress_ratios=list(base.compress_ratios[:n]) + [0],
                             num_hash_layers=min(base.num_hash_layers, n))
    model = Transformer(cfg, dtype=torch.bfloat16, quantized=True)
    if a.fnuz:  # the same bytes as gfx942's dtype (the values are uninitialized either way)
        for mod in model.modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                if p.dtype == torch.float8_e4m3fn:
                    setattr(mod, name, torch.nn.Parameter(p.data.view(torch.float8_e4m3fnuz), requires_grad=False))
    names = list(state_spec(cfg, 1, torch.bfloat16))
    entry = _Entry(model, names).eval()
    aot.externalize_module_parameters(entry, external_scope="model")
    fxb = aot.FxProgramsBuilder(entry)
    state = [torch.zeros(s, dtype=dt) for s, dt in state_spec(cfg, 1, torch.bfloat16).values()]
    i64 = torch.int64
    dyn = None
    t = 1
    if a.program == "prefill":
        lo = max(base.compress_ratios)  # the exporter's min_tokens for the full model
        t = min(2 * lo, a.max_chunk)
        dyn = {"tokens": {1: torch.export.Dim("T", min=lo, max=a.max_chunk)}, "start_pos": None, "lengths": None,
               "slots": None, "state": [None] * len(state)}
    args = (torch.zeros(1, t, dtype=i64), torch.zeros(1, dtype=i64), torch.full((1,), t, dtype=i64),
            torch.zeros(1, dtype=i64), state)
    kernels = dict(k.split("=", 1) for k in a.kernel)

    rows: list[tuple[str, str]] = []
    t0 = time.perf_counter()
    with torch.no_grad(), use_kernels(kernels), _no_stack_traces():
        ep = fxb.export_program(_program(_Entry.step), name=f"{a.program}_bs1", args=args, dynamic_shapes=dyn,
                                strict=False)
    rows.append(("trace", f"{time.perf_counter() - t0:.1f} s"))
    calls = Counter(str(nd.target) for nd in ep.graph.nodes if nd.op == "call_function")
    rows.append(("fx nodes (call_function)", f"{len(ep.graph.nodes)} ({sum(calls.values())})"))
    with tempfile.TemporaryDirectory() as tmp:
        mlir = a.mlir or Path(tmp) / "graph.mlir"
        t0 = time.perf_counter()
        aot.export(fxb, import_symbolic_shape_expressions=False).save_mlir(str(mlir))
        rows.append(("import", f"{time.perf_counter() - t0:.1f} s ({mlir.stat().st_size / 1e6:.1f} MB MLIR)"))
        if a.compile:
            from dsv4.export.compile import compile_mlir

            res = compile_mlir(mlir, a.compile, Path(tmp) / "graph.vmfb")
            rows.append((f"compile {a.compile}", f"{res.seconds:.1f} s ({res.path.stat().st_size / 1e6:.2f} MB vmfb)"))
    rows.append(("peak RSS", f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB"))
    print(f"{a.preset}, first {n} layers, {a.program}_bs1{', fnuz' if a.fnuz else ''}"
          f"{', kernels ' + ','.join(a.kernel) if a.kernel else ''}")
    for k, v in rows:
        print(f"  {k:<26} {v}")
    print("  most frequent ops:", ", ".join(f"{op} {c}" for op, c in calls.most_common(a.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
