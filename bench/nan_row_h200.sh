#!/bin/bash
# The batched-decode NaN row (docs/real-size.md, session 15) bisected by depth in one H200 call: Flash
# with 1, 2, 3 and 4 layers, decode_bs40 (row 39 NaN at 4 layers) and decode_bs48 (finite), each probed
# from the zero state at a few positions (bench/nonfinite_probe.py --zero-state). Build here first
# (about 2-3 min per export on the 2-core box; the GPU host makes the weights):
#   for L in 1 2 3 4; do dsv4 export --preset flash --layers $L --no-weights --target cuda --batch-sizes 1 \
#       --decode-batch-sizes 40,48 --n-slots 48 --max-seq-len 256 --no-score -o C/n$L && xz -T2 C/n$L/model.cuda.vmfb; done
# then carry C (git-ignored) and .whl (the iree-base-runtime cp312 wheel) and run:
#   bash bench/nan_row_h200.sh C
set -u
C=${1:?the folder of the n1..n4 exports}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-index --no-build-isolation -e . 2>&1 | tail -2
for L in 1 2 3 4; do
  F="$C/n$L"
  [ -d "$F" ] || continue
  [ -f "$F"/model.cuda.vmfb ] || xz -d -T0 "$F"/model.cuda.vmfb.xz
  python3 -m dsv4.runtime.cli weights random "$F" --seed 0 --jobs 16 | tail -1
  echo "== $L layers, $(( $(date +%s) - T0 )) s"
  timeout -s KILL 90 python3 bench/nonfinite_probe.py "$F" --device cuda --zero-state --positions 1,16,200
  rm -f "$F"/*.irpa  # the disk holds one Flash-4 set of weights at a time
done
