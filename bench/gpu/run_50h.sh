#!/usr/bin/env bash
# Issue 50, item 4 on one H200 (what run_50g.sh's time limits cut): the int4 table beside
# gemlite and Marlin, the FP8 blockwise table beside cuBLAS, the FP4 table with NVFP4.
source bench/gpu/prelude.sh
( bash bench/build_marlin.sh .marlin > $OUT/marlin_build.log 2>&1; started "marlin built $?" ) &
timeout 60 python3 bench/bench_fp4.py --methods bf16,qshard-mxfp4,qshard-nvfp4 --ms 1,16,128 > $OUT/fp4.log 2>&1
started "fp4 exit $?"
wait
export PYTHONPATH=$PYTHONPATH:$PWD/.marlin
timeout 230 python3 bench/bench_int4.py --methods bf16,qshard-triton,marlin,gemlite --ms 1,16,64,128,2048 > $OUT/int4.log 2>&1
started "int4 exit $?"
timeout 190 python3 bench/bench_fp8.py --tables llama --methods bf16,qshard-auto,torch-cublas-blockwise --ms 1,16,128,2048 > $OUT/fp8.log 2>&1
started "fp8 exit $?"
