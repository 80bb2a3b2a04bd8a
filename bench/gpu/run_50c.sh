#!/usr/bin/env bash
# Issue 50: W4A8 by cuBLAS for prefill (the codes expanded to e4m3, F.scaled_mm with 1 x 128
# scales on both operands) beside the Triton W4A8 kernel, on one H200.
source bench/gpu/prelude.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
started w4a8
timeout 300 python3 bench/bench_w4a8.py --ms 1,16,128,512,2048 2>&1 | tee $OUT/w4a8.log | tail -45
