#!/usr/bin/env bash
# Issue 49, second call: the rest of the GPU kernel tests (new code), NVFP4's linear-layer table
# and the FP8 blockwise layer table before (c969b17, .before/) and after.
# ".before/" is made beforehand, then carried: git archive c969b17 qshard bench | tar -x -C .before
source bench/gpu/prelude.sh
started tests
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_host_paths.py::test_cublas_rowwise_call_matches_the_reference tests/kernels/test_tuning.py tests/kernels/test_w4a16_gluon.py tests/kernels/test_w4a16_gluon_ws.py tests/kernels/test_w4a16_gluon_wgmma.py tests/kernels/test_w4a16_triton.py tests/layouts/test_int4_native.py tests/test_cuda.py 2>&1 | tail -25 | tee $OUT/gpu_tests.log
for lane in "op nvfp4" "fp8"; do
  for side in after before; do
    [ $SECONDS -gt 520 ] && break 2
    started "$side $lane"
    dir=$PWD; [ $side = before ] && dir=$PWD/.before
    if [ "$lane" = fp8 ]; then
      (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 110 python3 bench/bench_fp8.py --tables llama --methods bf16,qshard-auto --ms 1,16,64,128,2048 2>&1) | tee $OUT/fp8_${side}.log | tail -8
    else
      (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 110 python3 bench/bench_op_layer.py --format nvfp4 2>&1) | tee $OUT/op_layer_nvfp4_${side}.log | tail -9
    fi
  done
done
