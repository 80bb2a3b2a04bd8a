#!/usr/bin/env bash
# Issue 49, third call: the MoE table (bench_moe.py) before (c969b17, .before/) and after, then
# the GPU tests of the op's choice on Hopper (new code) while time is left.
# ".before/" is made beforehand, then carried: git archive c969b17 qshard bench | tar -x -C .before
source bench/gpu/prelude.sh
for side in after before; do
  started "moe $side"
  dir=$PWD; [ $side = before ] && dir=$PWD/.before
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 190 python3 bench/bench_moe.py --shapes qwen3-30b-a3b,deepseek-v3 --methods bf16-grouped,qshard-fp8,qshard-int4 --tokens 1,16,128,4096 2>&1) | tee $OUT/moe_${side}.log | grep -v "^$" | tail -14
done
started tests
timeout $((560 - SECONDS)) python3 -m pytest -q -p no:cacheprovider -k "chooses or op_reads or runs_fp4 or on_hopper or two_fp4" tests/kernels/test_w4a16_gluon.py tests/kernels/test_w4a16_gluon_ws.py tests/kernels/test_w4a16_gluon_wgmma.py tests/layouts/test_int4_native.py tests/kernels/test_w4a16_triton.py 2>&1 | tail -15 | tee $OUT/gpu_tests.log
