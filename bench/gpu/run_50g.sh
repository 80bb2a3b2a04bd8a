#!/usr/bin/env bash
# Issue 50, items 1 and 4 on one H200: the NVFP4 tuning left (gate_up, down) into
# kernels/tuned/h200.json; Marlin built in the background (bench/build_marlin.sh on a checkout
# of IST-DASLab/marlin 2f6d7c1 carried as .marlin); the FP4 table; the int4 table beside
# tinygemm, gemlite and Marlin; the op per linear beside Marlin.
source bench/gpu/prelude.sh
( started marlin; bash bench/build_marlin.sh .marlin > $OUT/marlin_build.log 2>&1; started "marlin built $?" ) &
started tune
timeout 120 python3 bench/tune_w4a16.py --formats nvfp4 --shapes 28672x4096,4096x14336 --out qshard/kernels/tuned/h200.json > $OUT/tune_nvfp4.log 2>&1
started "tune exit $?"
cp qshard/kernels/tuned/h200.json $OUT/
timeout 100 python3 bench/bench_fp4.py --methods bf16,qshard-mxfp4,qshard-nvfp4 --ms 1,2,8,16,32,64,128,2048 > $OUT/fp4.log 2>&1
started "fp4 exit $?"
wait
export PYTHONPATH=$PYTHONPATH:$PWD/.marlin
timeout 200 python3 bench/bench_int4.py --methods bf16,qshard-triton,tinygemm,gemlite,fp16,marlin --ms 1,2,8,16,32,64,128,2048 > $OUT/int4.log 2>&1
started "int4 exit $?"
timeout 100 python3 bench/bench_op_layer.py --marlin --ms 1,2,8,16,32,64,128 > $OUT/op_layer.log 2>&1
started "op layer exit $?"
