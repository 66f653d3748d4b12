#!/bin/bash
# Flash --layers 4 on one H200, in one device call: the NaN-row probe of batched decode, sampling on
# the device vs the host, then IREE vs transformers (docs/real-size.md and docs/performance.md, session 14).
# Compile here first (5 min on the 2-core box; no weights travel, the GPU host makes them):
#   dsv4 export --preset flash --layers 4 --no-weights --target cuda --batch-sizes 1,8 \
#       --decode-batch-sizes 1,8,32,64 --max-seq-len 256 --no-score -o C/f4 && xz -T2 C/f4/model.cuda.vmfb
# then carry C (git-ignored) and .whl (the iree-base-runtime cp312 wheel) and run:
#   bash bench/flash4_h200.sh C/f4
set -u
F=${1:?the Flash --layers 4 cuda export}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-index --no-build-isolation -e . 2>&1 | tail -2
[ -f "$F"/model.cuda.vmfb ] || xz -d -T0 "$F"/model.cuda.vmfb.xz
ls "$F"/*.irpa > /dev/null 2>&1 || python3 -m dsv4.runtime.cli weights random "$F" --seed 0 --jobs 16 | tail -1
echo "== zero-state probe (the last-row fault of sessions 14-21: docs/performance.md, session 22), $(( $(date +%s) - T0 )) s"
timeout -s KILL 120 python3 bench/nonfinite_probe.py "$F" --device cuda --zero-state --positions 1,2,3,16,100,200
for s in 0 1; do
  echo "== NaN-row probe, seed $s, $(( $(date +%s) - T0 )) s"
  timeout -s KILL 90 python3 bench/nonfinite_probe.py "$F" --device cuda --requests 64 --tokens 16 --steps 3 --seed $s
done
echo "== sampling $(( $(date +%s) - T0 )) s"
timeout -s KILL 150 python3 bench/device_sampling.py "$F" --device cuda --batch 1,8,32,64 --steps 16 --check
echo "== bench vs transformers $(( $(date +%s) - T0 )) s"
timeout -s KILL 330 python3 -m dsv4.runtime.cli bench "$F" --device cuda --batch 1,8,32,64 --context 128 --prefill 128 \
    --steps 16 --warmup 3 --compare transformers --no-profile
