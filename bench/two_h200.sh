#!/bin/bash
# Issue 18 on the two-H200 host (nvidia-h200-x2), in one device call: Flash --layers 4 as a 2-stage pipeline
# (one stage per GPU) vs one module, then the whole Flash on the pair (docs/scale.md).
# Compile here first (no weights travel; the GPU host makes them in /dev/shm, 256 GB there):
#   F="--preset flash --no-weights --target cuda --batch-sizes 1 --decode-batch-sizes 1,16,64 --no-score"
#   dsv4 export $F --layers 4 -o C/f4n1; dsv4 export $F --layers 4 --devices 2 --pipeline -o C/f4p2
#   dsv4 export $F --devices 2 --pipeline -o C/fullp2           # 8 min on the 2-core box
# then carry C (git-ignored, ~50 MB) and .whl (the iree-base-runtime cp312 wheel) and run:
#   bash bench/two_h200.sh C
set -u
C=${1:?the folder holding f4n1, f4p2 and fullp2}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-index --no-build-isolation -e . 2>&1 | tail -2
mkdir -p /dev/shm/f4n1 /dev/shm/f4p2 && cp "$C"/f4n1/* /dev/shm/f4n1/ && cp "$C"/f4p2/* /dev/shm/f4p2/
dsv4 weights random /dev/shm/f4n1 --jobs 17 | tail -1
for f in /dev/shm/f4n1/*.irpa; do ln -s "$f" /dev/shm/f4p2/; done  # one inventory: the same files serve both
echo "== parity $(( $(date +%s) - T0 )) s"
timeout -s KILL 110 python3 bench/multidevice_parity.py /dev/shm/f4n1 /dev/shm/f4p2 --device cuda --steps 32 --json
for e in f4p2 f4n1; do
  echo "== bench $e $(( $(date +%s) - T0 )) s"
  timeout -s KILL 150 dsv4 bench /dev/shm/$e --device cuda --batch 1,16 --context 160 --prefill 256 --steps 16 --warmup 2 --no-profile
done
rm -rf /dev/shm/f4n1 /dev/shm/f4p2
echo "== whole Flash $(( $(date +%s) - T0 )) s"
mkdir -p /dev/shm/full && cp "$C"/fullp2/* /dev/shm/full/
timeout -s KILL 200 /usr/bin/time -f "weights %e s %M kB" dsv4 weights random /dev/shm/full --jobs 24 2>&1 | tail -2
timeout -s KILL 170 /usr/bin/time -f "generate %e s %M kB" dsv4 generate /dev/shm/full --device cuda \
    --prompt-ids 0,11,22,33,44,55,66,77,88,99,110,121,132,143,154,165 --max-new-tokens 8
nvidia-smi --query-gpu=index,memory.used --format=csv,noheader
echo "end $(( $(date +%s) - T0 )) s"
