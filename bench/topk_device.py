"""Exact top-k on a device: the radix select alone and inside the compiled multi-layer graph.

Two steps, so the run needs no torch and no compiler (the H200 host has neither IREE compiler):

  prepare (here, torch + compiler):
    python bench/topk_device.py prepare --target cuda -o OUT [--export DIR]
      writes OUT/topk.vmfb (radix top-k 512 alone, dynamic rows/entries); with --export DIR (the
      k = 512 test export, cached by tests/test_topk.py under .cache/topk512-*/) also OUT/model.vmfb
      (DIR's model.mlir), OUT/model.irpa and OUT/case.npz (2,560 prompt tokens, the state, eager's
      logits and the indices of every top-k of the last chunk).
  run (anywhere with iree-base-runtime + numpy; torch optional):
    python bench/topk_device.py run OUT --driver cuda
      prints a table: top-k 512 alone over 1 / 16 / 64 rows x 4k / 16k / 64k entries, every one of
      REPS calls checked against the tie rule (numpy's stable sort), and, where torch is there,
      against torch.topk on the same scores (same values; index sets equal per row unless the k-th
      value is tied), with median ms per call (host round trip included) next to torch.topk's;
      then, if OUT/model.vmfb exists, the model's prefill chunks + topk_probe (picks vs eager,
      duplicates, max |logit diff|, ms).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

CHUNK, TOKENS = 512, 2560


def stable_topk(x: np.ndarray, k: int) -> np.ndarray:
    """The tie rule: largest first, equal values by ascending index (numpy's stable argsort)."""
    return np.argsort(-x, axis=-1, kind="stable")[..., :k]


def prepare(args: argparse.Namespace) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import dsv4.export  # noqa: F401
    from iree.turbine import aot

    from dsv4.export.compile import compile_mlir
    from dsv4.model.checkpoint import load_checkpoint
    from dsv4.model.kernels.topk import record_topk, topk_radix
    from dsv4.model.state import new_state

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    class M(torch.nn.Module):
        def forward(self, x):
            return topk_radix(x, 512)

    fxb = aot.FxProgramsBuilder(M())
    dims = {"x": {0: torch.export.Dim("R", min=1, max=4096), 1: torch.export.Dim("N", min=512, max=262144)}}
    fxb.export_program(lambda m, x: m(x), name="topk", args=(torch.randn(3, 1024),), dynamic_shapes=dims, strict=False)
    aot.export(fxb, import_symbolic_shape_expressions=True).save_mlir(str(out / "topk.mlir"))
    todo = [("topk", out / "topk.mlir")]
    if args.export:
        src = Path(args.export)
        todo.append(("model", src / "model.mlir"))
    for name, mlir in todo:
        t0 = time.perf_counter()
        compile_mlir(mlir, args.target, out / f"{name}.vmfb")
        print(f"compiled {name} for {args.target}: {time.perf_counter() - t0:.1f} s")
    if not args.export:
        return
    cfg = json.loads((src / "config.json").read_text())
    files = [cfg["parameters"]] if isinstance(cfg["parameters"], str) else cfg["parameters"]
    if len(files) != 1:
        raise SystemExit(f"{src}: expected one weight file, got {files}")
    shutil.copy(src / files[0], out / "model.irpa")

    model = load_checkpoint(src / "hf", dtype=torch.float32, overrides=dict(quant_sim=False, max_seq_len=4096)).eval()
    toks = torch.randint(0, model.cfg.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(11))
    st = new_state(model.cfg, 1, torch.float32)
    case = {"tokens": toks.numpy(), "state_names": np.array(list(st))}
    case.update({f"state{i}": v.numpy().copy() for i, v in enumerate(st.values())})
    i64 = lambda v: torch.tensor([v], dtype=torch.long)  # noqa: E731
    with torch.no_grad():
        for c in range(TOKENS // CHUNK - 1):
            model(toks[:, c * CHUNK:(c + 1) * CHUNK], i64(c * CHUNK), i64(CHUNK), i64(0), st)
        with record_topk() as rec:
            logits = model(toks[:, -CHUNK:], i64(TOKENS - CHUNK), i64(CHUNK), i64(0), st)
    case["logits"] = logits.numpy()
    case.update({f"topk{i}": idx.numpy() for i, (_, idx) in enumerate(rec)})
    np.savez(out / "case.npz", **case)
    print(f"wrote {out} ({len(rec)} top-ks in the probe)")


def _timed(fn, reps: int) -> tuple[list, float]:
    """All `reps` results (each is checked: a race shows up as a call that differs) and the median ms."""
    fn()  # first call: loads and JITs the kernels
    res, ts = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        res.append(fn())
        ts.append(time.perf_counter() - t0)
    return res, float(np.median(ts)) * 1e3


def scores(rows: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Normal scores with exact ties (every 5th rounded), row 0 half -inf (fewer finite entries than a
    long row's k), and, from 16 rows on, the last row distinct negatives one ulp apart around -1."""
    x = rng.standard_normal((rows, n), dtype=np.float32)
    x[:, ::5] = np.round(x[:, ::5])
    x[0, n // 2:] = -np.inf
    if rows >= 16:
        x[-1] = (np.float32(-1.0).view(np.int32) + rng.permutation(n).astype(np.int32)).view(np.float32)
    return x


def vs_torch(x: np.ndarray, got: np.ndarray, k: int) -> tuple[str, float | None]:
    """torch.topk (on the GPU when there is one) on the same scores: same values, and index sets
    equal in every row whose k-th value is not tied outside the top k. Returns (verdict, torch ms)."""
    try:
        import torch
    except ImportError:
        return "no torch", None
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    xt = torch.from_numpy(x).to(dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    tv, ti = torch.topk(xt, k, dim=-1)
    ts = []
    for _ in range(10):
        sync()
        t0 = time.perf_counter()
        torch.topk(xt, k, dim=-1)
        sync()
        ts.append(time.perf_counter() - t0)
    tv, ti = tv.cpu().numpy(), ti.cpu().numpy()
    same_values = np.array_equal(np.take_along_axis(x, got, -1), tv)
    kth = tv[:, -1:]
    untied = (x == kth).sum(-1) == (tv == kth).sum(-1)  # the k-th value has no copy left outside
    same_sets = all(set(a) == set(b) for a, b, u in zip(got, ti, untied) if u)
    verdict = f"values {'=' if same_values else '!='}, index sets {'=' if same_sets else '!='} ({int(untied.sum())} untied rows)"
    return verdict, float(np.median(ts)) * 1e3


def run(args: argparse.Namespace) -> None:
    import iree.runtime as rt

    if args.driver == "local-task":
        rt.flags.parse_flags("--task_worker_stack_size=1048576")
    d = Path(args.dir)
    config = rt.Config(args.driver)
    dev = config.device
    inst = config.vm_instance

    def load(vmfb: Path, irpa: Path | None = None):
        mods = [rt.create_hal_module(inst, dev)]
        if irpa is not None:
            idx = rt.ParameterIndex()
            idx.load(str(irpa))
            mods.append(rt.create_io_parameters_module(inst, idx.create_provider(scope="model")))
        vm = rt.VmModule.mmap(inst, str(vmfb))
        ctx = rt.VmContext(inst, modules=[*mods, vm])
        return lambda name: rt.FunctionInvoker(ctx, dev, vm.lookup_function(name))

    host = lambda r: r.to_host() if isinstance(r, rt.DeviceArray) else r  # noqa: E731
    topk = load(d / "topk.vmfb")("topk")
    rng = np.random.default_rng(0)
    print(f"| top-k 512 ({args.driver}) | rows | entries | exact (all {args.reps} calls) | vs torch.topk | "
          f"median ms | torch.topk ms |\n|---|---|---|---|---|---|---|", flush=True)
    for rows in (1, 16, 64):
        for n in (4096, 16384, 65536):
            x = scores(rows, n, rng)
            xd = rt.asdevicearray(dev, x)
            got, ms = _timed(lambda: host(topk(xd)), args.reps)
            want = stable_topk(x, 512)
            exact = sum(np.array_equal(g, want) for g in got)
            verdict, tms = vs_torch(x, got[0], 512)
            print(f"| radix | {rows} | {n} | {exact}/{len(got)} | {verdict} | {ms:.2f} | "
                  f"{'-' if tms is None else f'{tms:.3f}'} |", flush=True)

    if not (d / "model.vmfb").exists():
        return
    case = np.load(d / "case.npz")
    fn = load(d / "model.vmfb", d / "model.irpa")
    prefill, probe = fn("prefill_bs1"), fn("topk_probe_bs1")
    state = [rt.asdevicearray(dev, case[f"state{i}"]) for i in range(len(case["state_names"]))]
    toks = case["tokens"]
    i64 = lambda v: np.array([v], dtype=np.int64)  # noqa: E731
    t0 = time.perf_counter()
    for c in range(TOKENS // CHUNK - 1):
        host(prefill(toks[:, c * CHUNK:(c + 1) * CHUNK], i64(c * CHUNK), i64(CHUNK), i64(0), *state)[0])
    t_prefill = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    res = [host(r) for r in probe(toks[:, -CHUNK:], i64(TOKENS - CHUNK), i64(CHUNK), i64(0), *state)]
    t_probe = (time.perf_counter() - t0) * 1e3
    n_topk = len([k for k in case.files if k.startswith("topk")])
    diff = float(np.abs(res[0] - case["logits"]).max())
    print(f"\nmodel ({args.driver}): {TOKENS // CHUNK - 1} prefill chunks of {CHUNK} in {t_prefill:.0f} ms (first call "
          f"included), topk_probe chunk {t_probe:.0f} ms; max |logit diff| vs eager {diff:.3g}")
    bad = 0
    for i in range(n_topk):
        got, want, sc = res[1 + i], case[f"topk{i}"], res[1 + n_topk + i]
        k = got.shape[-1]
        own = (got != stable_topk(sc, k)).sum()  # vs the tie rule on the graph's own returned scores
        d = got != want  # eager vs compiled picks; where they differ, how far apart are their scores
        gap = np.abs(np.take_along_axis(sc, got, -1) - np.take_along_axis(sc, want, -1))[d]
        srt = np.sort(got, -1)
        dup = int((srt[..., 1:] == srt[..., :-1]).sum())
        # a top-k of the returned scores up to 3e-6 (they are a second evaluation, see tests/test_topk.py)
        v = np.take_along_axis(sc, got, -1)
        rest = sc.copy()
        np.put_along_axis(rest, got, -np.inf, -1)
        fin = np.isfinite(sc)
        tol = 2e-5 * max(1.0, float(np.abs(sc[fin]).max())) if fin.any() else 0.0
        ok = dup == 0 and np.all(np.diff(v, axis=-1) <= tol) and np.all(rest.max(-1) <= v.min(-1) + tol)
        bad += not ok
        print(f"  top-k #{i} {tuple(want.shape)}: a top-k of the graph's scores: {ok}; {int(own)} picks differ from "
              f"the tie rule on the returned scores, {int(d.sum())} of {d.size} from eager (max score gap "
              f"{gap.max() if d.any() else 0:.3g}); duplicates {dup}")
    print(f"model top-ks that are not a top-k of their scores: {bad} of {n_topk}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--export", help="the k = 512 test export (.cache/topk512-*) for the model part")
    a.add_argument("--target", default="cuda")
    a.add_argument("-o", "--out", required=True)
    b = sub.add_parser("run")
    b.add_argument("dir")
    b.add_argument("--driver", default="cuda")
    b.add_argument("--reps", type=int, default=10, help="checked calls per shape (median ms over them)")
    args = p.parse_args()
    (prepare if args.cmd == "prepare" else run)(args)


if __name__ == "__main__":
    main()
