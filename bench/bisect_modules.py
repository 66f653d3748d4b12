"""Compiled vs eager, module by module: where does an export's graph first leave eager?

    python bench/bisect_modules.py OUT [--tokens 2] [--target llvm-cpu] [--eager-moe routed] [--json FILE]

OUT is an export with weights (e.g. `dsv4 export --preset flash --layers 2 --dtype fp32 --no-weights`
+ `dsv4 weights random`). Traces one prefill of --tokens tokens from an empty state (the graph the
exporter traces, kernels as export picks them), returning the output of every module of interest
(each layer's norms, attention linears, compressor entries, sparse attention's inputs and output,
attention, MoE gate / routed experts / shared expert, block, and the logits), compiles it for
--target, runs it on the export's own .irpa and the eager model on the same (memory-mapped)
weights, and prints each output's max |diff| relative to its max |value|, in execution order. With
fp32 activations a correct graph stays near fp32 rounding (~1e-6) until a quantization step (FP8
activation / KV roundings) lands on the other side of a rounding boundary; the first module far
above that, with its input still close, is where to look.

--decode: the probe is one decode step at position --tokens instead, from the state the export's
own prefill_bs1 leaves after --tokens prompt tokens (both sides start from that same state). A
non-finite output shows as `rel err nan` on the first module that makes it. Every output of both
sides lands in WORK/outputs.npz ("got <label>", "want <label>"), e.g. to replay one op's inputs alone.
--kernel OP=IMPL traces the probe with another lowering of a hot spot (as `dsv4 export --kernel`).
--decode --batch B: B rows, each prefilled alone into its own slot, one decode call of B rows (the
NaN hunt of session 15: decode_bs40/64's last row). --no-eager skips the eager side and prints the
rows of every output that hold NaN/inf; --only NAMES records fewer outputs (each one recorded
changes what the compiler fuses, and with it what a layout-dependent bug does).
A GPU host has no IREE compiler: build the probe here (--build-only; it lands in --work), carry it,
and run it there with --probe FILE --device cuda.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

# module names (relative to the Transformer) whose outputs are compared, per layer ("X:in": X's input)
# "attn.compressor": its entries only; "attn.sparse": sparse_attention's inputs and output
_PER_LAYER = ("hc_attn", "attn_norm", "attn.wq_a", "attn.q_norm", "attn.wq_b", "attn.wkv", "attn.kv_norm",
              "attn.compressor", "attn.sparse", "attn.wo_b:in", "attn.wo_b", "attn", "ffn_norm", "ffn.gate",
              "ffn.experts", "ffn.shared_experts", "ffn", "")


# outputs that FP8 linears take as input (and quantize): attn_norm -> wq_a, wkv; q_norm -> wq_b;
# ffn_norm -> the shared and routed experts; wo_b's input (the attention after wo_a)
_QUANTIZED_INPUTS = ("attn_norm", "q_norm", "ffn_norm", "wo_b:in")


def _flat(x):
    """Tensors of a module output (a tensor or a tuple of them)."""
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    return [t for t in x if isinstance(t, torch.Tensor)] if isinstance(x, (tuple, list)) else []


def host_copy(x) -> np.ndarray:
    """A device array on the host with its buffer's own element type (bf16 as ml_dtypes.bfloat16).
    The engine's state arrays override the dtype with their storage dtype (uint16 for bf16), and
    to_host would then convert the values instead of keeping the bits."""
    import iree.runtime as rt

    arr = rt.DeviceArray(x._device, x._buffer_view)
    return np.array(arr.to_host(), copy=True)  # a copy: the host view dies with `arr`


def _state_values(x) -> np.ndarray:
    """A state device array's raw storage (bf16 as its uint16 bits, fp8 as uint8), on the host."""
    a = host_copy(x)
    return a.view(np.uint16) if a.dtype.itemsize == 2 and a.dtype.kind not in "iuf" else a


def _device_state(mod, spec, host: np.ndarray):
    """`host` (raw storage, as _state_values gives it) as a device array of the state's element type."""
    import iree.runtime as rt

    from dsv4.contract.artifact import DTYPES

    storage, et = DTYPES[spec.dtype]
    bv = mod.device.allocator.allocate_buffer_copy(
        memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=rt.BufferUsage.DEFAULT, device=mod.device,
        buffer=np.ascontiguousarray(host).view(storage), element_type=getattr(rt.HalElementType, et))
    return rt.DeviceArray(mod.device, bv, override_dtype=np.dtype(storage))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="export directory with weights")
    ap.add_argument("--tokens", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", default="llvm-cpu")
    ap.add_argument("--eager-moe", choices=("reference", "routed"), default="routed")
    ap.add_argument("--work", default=None, help="folder for the probe MLIR/vmfb (default: OUT/bisect)")
    ap.add_argument("--decode", action="store_true",
                    help="probe one decode step at position --tokens (after the export's own prefill)")
    ap.add_argument("--batch", type=int, default=1,
                    help="with --decode: B rows, row b prefilled (its own prompt) into slot b, one decode call of B rows")
    ap.add_argument("--no-eager", action="store_true",
                    help="skip the eager side: print each output's rows that hold NaN/inf (for a NaN hunt)")
    ap.add_argument("--only", metavar="NAMES", help="record only these outputs (comma list of labels, e.g. "
                    "norm,layers.3): fewer outputs change the compiled graph's fusion less")
    ap.add_argument("--build-only", action="store_true", help="trace and compile the probe, then stop")
    ap.add_argument("--probe", metavar="VMFB", help="a probe built earlier (--build-only): no tracing here")
    ap.add_argument("--device", default=None, help="IREE driver that runs it (default: the target's)")
    ap.add_argument("--kernel", action="append", default=[], metavar="OP=IMPL",
                    help="trace the probe with this lowering of a hot spot (as `dsv4 export --kernel`)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    kernels = dict(k.split("=", 1) for k in args.kernel)

    import torch

    from dsv4.export.compile import resolve_target
    from dsv4.model.checkpoint import load_irpa
    from dsv4.model.config import ModelConfig
    from dsv4.model.kernels.linear import fp8_act_qdq
    from dsv4.model.kernels.moe import routed_moe
    from dsv4.model.model import empty_model
    from dsv4.model.state import state_spec
    from dsv4.contract.artifact import PARAM_SCOPE, ExportConfig
    from dsv4.runtime.module import IreeModule

    exp = ExportConfig.load(args.out, weights=not args.build_only)
    cfg = ModelConfig.from_dict(exp.model)
    act = {"bfloat16": torch.bfloat16, "float32": torch.float32}[exp.raw["activation_dtype"]]
    quantized = any(dt.startswith("float8") for _, _, dt in exp.raw["weights"]["tensors"])
    tgt = resolve_target(args.target)
    work = Path(args.work or Path(args.out) / "bisect")
    work.mkdir(parents=True, exist_ok=True)

    model = empty_model(cfg, act, quantized=quantized)
    names = []
    for i in range(cfg.n_layers):
        for sub in _PER_LAYER:
            n = f"layers.{i}" + (f".{sub}" if sub else "")
            if sub in ("hc_attn", "attn.sparse") or n.split(":")[0] in dict(model.named_modules()):
                names.append(n)
    names.append("norm")
    if args.only:
        keep = args.only.split(",")
        unknown = [n for n in keep if n not in names]
        if unknown:
            raise SystemExit(f"--only: unknown outputs {unknown}; choose from {names}")
        sparse = any(n.endswith("attn.sparse") for n in keep)  # one wrapper records every layer's, or none
        names = [n for n in names if n in keep or (sparse and n.endswith("attn.sparse"))]
    record_sparse = any(n.endswith("attn.sparse") for n in names)
    state_names = list(state_spec(cfg, exp.n_slots, act))

    class Probe(torch.nn.Module):
        """prefill from slot 0, position 0; returns the logits and every hooked module's output."""

        def __init__(self, m):
            super().__init__()
            self.model = m

        def step(self, tokens, start_pos, lengths, slots, state):
            import dsv4.model.model as mm

            got: list = []
            hooks = []
            mods = dict(self.model.named_modules())
            for n in names:
                if n.endswith("attn.sparse"):  # a function, recorded by the wrapper below
                    continue
                if n.endswith("hc_attn") or n.endswith(":in"):  # a module's input: the block's streams
                    m = mods[n.rsplit(".", 1)[0]] if n.endswith("hc_attn") else mods[n[:-3]]
                    hooks.append(m.register_forward_pre_hook(lambda mod, a: got.extend(_flat(a[0]))))
                elif n.endswith("compressor"):  # (entries, ids, done, ring k, ring z): the entries
                    hooks.append(mods[n].register_forward_hook(lambda mod, a, out: got.append(out[0])))
                else:
                    hooks.append(mods[n].register_forward_hook(lambda mod, a, out: got.extend(_flat(out))))
            attention = mm.sparse_attention

            def recorded(q, kv, idx, sink, scale):
                o = attention(q, kv, idx, sink, scale)
                got.extend([q, kv, idx, sink, o])
                return o

            if record_sparse:
                mm.sparse_attention = recorded
            try:
                logits = self.model(tokens, start_pos, lengths, slots, dict(zip(state_names, state)))
            finally:
                mm.sparse_attention = attention
                for h in hooks:
                    h.remove()
            return (logits, *[t.float() if t.is_floating_point() else t for t in got])

    def zeros_state():
        return [torch.zeros(s, dtype=dt) for s, dt in state_spec(cfg, exp.n_slots, act).values()]

    T = args.tokens
    rng = np.random.default_rng(args.seed)
    ids = torch.from_numpy(rng.integers(2, cfg.vocab_size, size=(1, T)))
    z = torch.zeros(1, dtype=torch.int64)
    call = (ids, z, z + T, z)
    state0 = zeros_state()
    B = args.batch
    if B > 1 and not args.decode:
        raise SystemExit("--batch needs --decode")
    if args.decode:  # one token at position T per row; its state is what the export's own prefill leaves
        ids = torch.from_numpy(rng.integers(2, cfg.vocab_size, size=(B, T)))
        zb = torch.zeros(B, dtype=torch.int64)
        call = (torch.from_numpy(rng.integers(2, cfg.vocab_size, size=(B, 1))), zb + T, zb + 1,
                torch.arange(B, dtype=torch.int64))
    vmfb = Path(args.probe) if args.probe else work / f"probe.{tgt.name}.vmfb"

    if not args.probe:  # --- the probe traced as export traces (parameters by name, kernels by default)
        from iree.turbine import aot

        import dsv4.export  # noqa: F401  (compat shim)
        from dsv4.export.compile import compile_mlir
        from dsv4.export.exporter import _no_stack_traces, _trace
        from dsv4.export.kernel_op import use_kernels

        t0 = time.perf_counter()
        tmodel = empty_model(cfg, act, quantized=quantized)
        tprobe = Probe(tmodel).eval()
        aot.externalize_module_parameters(tprobe, external_scope=PARAM_SCOPE)
        fxb = aot.FxProgramsBuilder(tprobe)

        def fn(m, tokens, start_pos, lengths, slots, state):
            return Probe.step(m, tokens, start_pos, lengths, slots, state)

        with torch.no_grad(), use_kernels(kernels), _no_stack_traces():
            _trace(fxb, "probe", fn, (*call, state0), None)
        mlir = work / "probe.mlir"
        aot.export(fxb, import_symbolic_shape_expressions=False).save_mlir(str(mlir))
        compile_mlir(mlir, tgt, vmfb)
        print(f"compiled the probe in {time.perf_counter() - t0:.1f} s: {vmfb}", file=sys.stderr)
        if args.build_only:
            return 0

    driver = args.device or tgt.driver
    files = exp.parameters_for(tgt.name)
    mod = IreeModule(vmfb, files, driver=driver)
    state = [mod.zeros(s) for s in exp.state]
    if args.decode:  # the export's own prefill fills the state; both sides start from it
        from dsv4.runtime import Engine

        eng = Engine(args.out, device=driver)
        for b in range(B):  # padded to the export's shortest prefill, as the Engine calls it
            tk = np.zeros((1, max(T, eng.config.prefill_min_tokens)), np.int64)
            tk[0, :T] = ids[b].numpy()
            eng.invoke("prefill_bs1", tk, np.zeros(1, np.int64), np.array([T]), np.array([b]))
        host = [_state_values(x) for x in eng.state]
        del eng
        state = [_device_state(mod, spec, h) for spec, h in zip(exp.state, host)]
        signed = {1: np.int8, 2: np.int16}  # torch reinterprets int8/int16 as fp8/bf16 (uint16 has no view)
        state0 = [torch.from_numpy(h.view(signed.get(h.dtype.itemsize, h.dtype)) if h.dtype.kind == "u" else h).view(dt)
                  for h, (_, dt) in zip(host, state_spec(cfg, exp.n_slots, act).values())]

    if args.no_eager:
        got = mod("probe", *[a.numpy() for a in call], *state)
        return _report_nonfinite(names, got)

    # --- eager, on the mapped weights
    t0 = time.perf_counter()
    load_irpa(model, files, mapped=True)
    model.eval()
    probe = Probe(model)
    from contextlib import nullcontext

    with torch.no_grad(), routed_moe() if args.eager_moe == "routed" else nullcontext():
        want = [t.float().numpy() if t.is_floating_point() else t.numpy() for t in probe.step(*call, state0)]
    print(f"eager: {len(want)} outputs in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    t0 = time.perf_counter()
    got = mod("probe", *[a.numpy() for a in call], *state)
    print(f"compiled probe ran in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    # labels in hook order (= execution order); the gate returns (weights, indices)
    expanded = _labels(names)
    if len(expanded) != len(want):
        raise SystemExit(f"{len(want)} outputs for {len(expanded)} labels: a hooked module ran more or less "
                         "than once")
    np.savez(work / "outputs.npz", **{f"got {n}": np.asarray(g) for n, g in zip(expanded, got)},
             **{f"want {n}": w for n, w in zip(expanded, want)})
    rows = []
    order = list(range(1, len(want))) + [0]  # execution order, logits last
    for j in order:
        g, w = np.asarray(got[j]), want[j]
        if w.dtype.kind == "f":
            w = w.astype(np.float64)
        if w.dtype.kind in "iu":
            diff = float((g.astype(np.int64) != w.astype(np.int64)).mean())
            rows.append({"module": expanded[j], "shape": list(w.shape), "index_mismatch": diff})
            print(f"{expanded[j]:32s} {str(list(w.shape)):22s} index mismatch {diff:.3f}")
            continue
        rel = float(np.abs(g.astype(np.float64) - w).max() / max(np.abs(w).max(), 1e-30))
        row = {"module": expanded[j], "shape": list(w.shape), "rel_err": rel}
        note = ""
        if expanded[j].rsplit(".", 1)[-1] in _QUANTIZED_INPUTS:
            # the FP8 linears after it quantize this activation per 128-block to e4m3: count the
            # elements whose e4m3 value differs between the two sides (a step is 1/16..1/8 of it)
            qg, qw = (fp8_act_qdq(torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))) for a in (g, w))
            row["e4m3_flips"] = int((qg != qw).sum())
            note = f"   e4m3 flips {row['e4m3_flips']} of {qw.numel()}"
        rows.append(row)
        print(f"{expanded[j]:32s} {str(list(w.shape)):22s} rel err {rel:.2e}{note}")
    if args.json:
        Path(args.json).write_text(json.dumps({"export": str(args.out), "tokens": T, "target": tgt.label,
                                               "eager_moe": args.eager_moe, "rows": rows}, indent=1))
    return 0


def _labels(names: list[str]) -> list[str]:
    """The probe's outputs in order: the logits, then per hooked name its tensors (the gate returns
    weights and indices; sparse attention records its inputs and output)."""
    labels = ["logits"]
    for n in names:
        labels += ([f"{n}.weights", f"{n}.indices"] if n.endswith("ffn.gate") else
                   [f"{n}.{a}" for a in ("q", "kv", "idx", "sink", "out")] if n.endswith("attn.sparse") else [n])
    return labels


def _report_nonfinite(names: list[str], got) -> int:
    """--no-eager: per probe output (execution order, logits last), the rows of dim 0 that hold NaN/inf."""
    labels = _labels(names)
    if len(labels) != len(got):
        raise SystemExit(f"{len(got)} outputs for {len(labels)} labels: a hooked module ran more or less than once")
    order = list(range(1, len(got))) + [0]
    for j in order:
        g = np.asarray(got[j])
        if g.dtype.kind != "f":
            print(f"{labels[j]:32s} {str(list(g.shape)):22s} (integer) min {g.min()} max {g.max()}")
            continue
        bad = ~np.isfinite(g.reshape(g.shape[0], -1)) if g.ndim else ~np.isfinite(g.reshape(1, 1))
        rows = np.flatnonzero(bad.any(1)).tolist()
        print(f"{labels[j]:32s} {str(list(g.shape)):22s} non-finite rows {rows[:16]}"
              f"{' ...' if len(rows) > 16 else ''} ({int(bad.sum())} values)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
