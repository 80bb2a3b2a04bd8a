#!/usr/bin/env bash
# Issue 49, the GPU check of the kernel-choice redesign on one H200: the GPU kernel tests on the
# new code, then the linear-layer tables (the op on the Llama-3.1-8B layer, bench_op_layer.py)
# before (c969b17, carried in .before/) and after, alternating, in one call.
# ".before/" is made beforehand, then carried: git archive c969b17 qshard bench | tar -x -C .before
source bench/gpu/prelude.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
started tests
timeout 260 python3 -m pytest -q -p no:cacheprovider -x tests/kernels tests/layouts/test_int4_native.py tests/test_cuda.py 2>&1 | tail -25 | tee $OUT/gpu_tests.log
for fmt in int4 mxfp4 nvfp4; do
  for side in before after; do
    [ $SECONDS -gt 540 ] && break 2
    started "$side $fmt"
    dir=$PWD; [ $side = before ] && dir=$PWD/.before
    (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 120 python3 bench/bench_op_layer.py --format $fmt 2>&1) | tee $OUT/op_layer_${fmt}_${side}.log | tail -12
  done
done
