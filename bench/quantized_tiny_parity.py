"""Compiled llvm-cpu vs eager on the tiny preset with FP8 linears + MXFP4 experts (random bytes, no NaN
codes) and quant_sim on: exports (once) to OUT_DIR, prefills 37 tokens, decodes 32 steps fed eager's
greedy tokens, prints max |logit diff|, bitwise-equal calls and greedy agreement. A check, not a test.

    python bench/quantized_tiny_parity.py OUT_DIR float32|bfloat16
"""
import json, sys, time
from pathlib import Path
import numpy as np, torch
import dsv4.export  # noqa
from dsv4.export.exporter import ExportSpec, export_model
from dsv4.runtime.module import IreeModule, ensure_runtime_flags
from dsv4.model.state import new_state
ensure_runtime_flags()
out, dtn = Path(sys.argv[1]), sys.argv[2]
dt = getattr(torch, dtn)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_export_model import _quantized_tiny  # the tests' quantized tiny model (random FP8/MXFP4 bytes)

q = _quantized_tiny(quant_sim=True, dtype=dt)
cfg = q.cfg
if not (out / "config.json").exists():
    t0 = time.time()
    r = export_model(q, ExportSpec(targets=("llvm-cpu",), batch_sizes=(1,), decode_batch_sizes=(1,), score=False, max_chunk=64, n_slots=2), out, progress=print)
    print("export s", round(time.time() - t0, 1), {k: round(v, 1) for k, v in r.timings.items()} if hasattr(r, "timings") else "")
c = json.loads((out / "config.json").read_text())
mod = IreeModule(out / c["targets"]["llvm-cpu"]["vmfb"], [out / p for p in ([c["parameters"]] if isinstance(c["parameters"], str) else c["parameters"])])
st = new_state(cfg, 2, dt)
import ml_dtypes
def host(v): return v.float().numpy().astype(ml_dtypes.bfloat16) if v.dtype == torch.bfloat16 else v.numpy()
dev = [mod.device_array(host(v)) for v in st.values()]
toks = np.random.default_rng(1).integers(0, 512, (1, 37), dtype=np.int64)
def call(fn, tokens, start, lengths):
    args = [torch.as_tensor(np.asarray(a), dtype=torch.int64) for a in (tokens, start, lengths, [1])]
    got = mod(fn, *[a.numpy() for a in args], *dev)
    with torch.no_grad():
        want = q(*args, st)
    return np.asarray(got[0]).astype(np.float32), want.float().numpy()
rows = []
got, want = call("prefill_bs1", toks, [0], [37]); rows.append((got, want))
pos, nxt, agree = 37, int(want[0].argmax()), 0
for step in range(32):
    got, want = call("decode_bs1", [[nxt]], [pos], [1]); rows.append((got, want))
    agree += int(got[0].argmax() == want[0].argmax())
    pos, nxt = pos + 1, int(want[0].argmax())  # teacher-forced by eager's greedy token
diffs = [float(np.abs(g - w).max()) for g, w in rows]
bit = sum(int(np.array_equal(g.view(np.int32), w.view(np.int32))) for g, w in rows)
print("RESULT", json.dumps({"dtype": dtn, "prefill_max_diff": diffs[0], "decode_max_diff": max(diffs[1:]), "bitwise_equal_calls": f"{bit}/{len(rows)}",
      "greedy_agree": f"{agree}/32", "max_abs_logit": float(max(np.abs(w).max() for _, w in rows))}))
