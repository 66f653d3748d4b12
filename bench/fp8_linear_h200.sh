#!/bin/bash
# Time each GEMM form of bench/fp8_linear.py's module on a CUDA device (docs/performance.md "FP8 on the
# matrix cores"). Run in a folder holding fp8_linear.cuda.vmfb, fp8_linear.irpa, fp8_linear_check.py,
# with iree-base-runtime importable and BM pointing at its iree-benchmark-module.
set -u
BM=${BM:-iree-benchmark-module}
python3 fp8_linear_check.py fp8_linear.cuda.vmfb fp8_linear.irpa cuda
for t in 1 16 512 2048; do
  for impl in kernel_f32 kernel_fp8 kernel; do
    for fn in lin exp; do
      if [ $fn = lin ]; then shape=${t}x4096; else shape=2x${t}x4096; fi
      r=$($BM --device=cuda --module=fp8_linear.cuda.vmfb --parameters=model=fp8_linear.irpa --function=${fn}_${impl} \
          --input=${shape}xbf16=0.5 --benchmark_repetitions=5 --benchmark_min_time=0.2s 2>&1 | grep -E "_median|rror" | head -2)
      echo "T=$t $fn $impl :: $r"
    done
  done
done
