"""Does a compiled state read `state[slots, w]` return slot `slots`'s cells? A minimal repro of the
slot-dependent decode found in session 21 (docs/performance.md): each formulation of reading one
layer's window ring from a [S, L, W, D] state (and, in the `*_rw` functions, writing it back plus one
like the model's ring update) is exported alone, compiled, and run against numpy for single slots and
a batch of slots.

    python bench/slot_gather.py build DIR [--target cuda] [--target llvm-cpu]   # here (needs the compiler)
    python bench/slot_gather.py check DIR --device cuda                       # where the device is
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from dsv4.contract.random_weights import bf16_bits

S, L, W, D, LAYER = 64, 5, 8, 16, 3
DTYPES = ("bfloat16", "float32")


def _reads():
    import torch

    return {
        "select_index": lambda st, s: st[s, LAYER],  # what the model did before bcb61e9: select, then index
        "two_index": lambda st, s: st[s, torch.full_like(s, LAYER)],
        "flat": lambda st, s: st.flatten(0, 1)[s * L + LAYER],
        "index_select": lambda st, s: st.index_select(0, s)[:, LAYER],
    }


def build(out: Path, targets: list[str]) -> None:
    import torch
    import iree.turbine.aot as aot

    from dsv4.export.compile import compile_mlir

    out.mkdir(parents=True, exist_ok=True)
    done = {}
    for dt in DTYPES:
        for name, read in _reads().items():
            for rw in (False, True):
                class F(torch.nn.Module):
                    def forward(self, st, s):
                        ring = read(st, s)
                        if not rw:
                            return ring * 1
                        return ring * 1, st.index_put((s, torch.full_like(s, LAYER)), ring + 1)

                for b in (1, 8):
                    fn = f"{name}{'_rw' if rw else ''}_{dt}_bs{b}"
                    e = aot.export(F(), args=(torch.zeros(S, L, W, D, dtype=getattr(torch, dt)),
                                              torch.zeros(b, dtype=torch.int64)))
                    for t in targets:
                        compile_mlir(e, t, out / f"{fn}.{t.split(':')[0]}.vmfb")
                    done[fn] = dict(read=name, rw=rw, dtype=dt, batch=b)
                    print("built", fn, flush=True)
    (out / "index.json").write_text(json.dumps(done, indent=1))


def _upload(rt, device, x: np.ndarray, dtype: str):
    if dtype == "float32":
        return rt.asdevicearray(device, np.ascontiguousarray(x, np.float32))
    bits = np.ascontiguousarray(bf16_bits(x))
    bv = device.allocator.allocate_buffer_copy(
        memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=rt.BufferUsage.DEFAULT, device=device,
        buffer=bits, element_type=rt.HalElementType.BFLOAT_16)
    return rt.DeviceArray(device, bv, override_dtype=np.uint16)


def _host_f32(a) -> np.ndarray:
    """A result on the host as float32 (bf16 widened from its bits)."""
    x = np.asarray(a.to_host())
    if x.dtype.itemsize == 2:
        return (x.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


def check(out: Path, device: str) -> int:
    import iree.runtime as rt

    target = {"cuda": "cuda", "local-task": "llvm-cpu", "hip": "gfx942"}[device]
    rng = np.random.default_rng(0)
    bad = 0
    functions = json.loads((out / "index.json").read_text())
    for fn, meta in functions.items():
        vm = out / f"{fn}.{target}.vmfb"
        cfg = rt.Config(device)
        ctx = rt.SystemContext(config=cfg)
        ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vm.read_bytes()))
        f = ctx.modules.module["main"]
        st = rng.standard_normal((S, L, W, D)).astype(np.float32)
        if meta["dtype"] == "bfloat16":  # exact in bf16
            st = ((st.view(np.uint32) >> 16) << 16).view(np.float32)
        b = meta["batch"]
        wrong = []
        for slots in ([0], [1], [4], [5], [63]) if b == 1 else (list(range(8)), [63, 5, 1, 0, 9, 40, 2, 7]):
            s = np.asarray(slots, np.int64)
            arg = _upload(rt, cfg.device, st, meta["dtype"])
            res = f(arg, s)
            got = _host_f32(res[0] if meta["rw"] else res)
            want = st[s, LAYER]
            rows = [int(i) for i in range(b) if not np.array_equal(got[i], want[i])]
            found = []
            for i in rows:  # which (slot, layer) the row did read
                hit = np.argwhere((st == got[i][None, None]).all((2, 3)))
                found.append(f"slot {slots[i]} read {[tuple(int(v) for v in h) for h in hit][:2] or 'nothing stored'}")
            if meta["rw"] and not rows:
                new = _host_f32(res[1])
                exp = st.copy(); exp[s, LAYER] = want + 1
                if meta["dtype"] == "bfloat16":  # the +1 rounds to bf16 on the device (exact ties aside)
                    exp = (bf16_bits(exp).astype(np.uint32) << 16).view(np.float32)
                if not np.array_equal(new, exp):
                    found.append(f"write-back wrong in {int((new != exp).any((2, 3)).sum())} (slot, layer) rings")
            if found:
                wrong.append(f"slots {slots}: " + "; ".join(found))
        bad += bool(wrong)
        print(f"{fn:28s} {'OK' if not wrong else 'WRONG: ' + ' | '.join(wrong)}", flush=True)
    print(f"{bad} of {len(functions)} functions wrong on {device}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["build", "check"])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--target", action="append", default=None)
    ap.add_argument("--device", default="local-task")
    a = ap.parse_args(argv)
    if a.mode == "build":
        build(a.dir, a.target or ["cuda", "llvm-cpu"])
        return 0
    return check(a.dir, a.device)


if __name__ == "__main__":
    sys.exit(main())
