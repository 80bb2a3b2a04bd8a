#!/usr/bin/env bash
# Issue 50: the W4A8 tests on one H200, the Llama-3.1-8B layer table with the op's choice
# (tile kernel below 128 tokens, cuBLAS above), and the MoE experts.
source bench/gpu/prelude.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
started tests
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_w4a8.py 2>&1 | tail -5 | tee $OUT/tests.log
started w4a8
timeout 200 python3 bench/bench_w4a8.py --ms 1,16,64,128,512,2048 2>&1 | tee $OUT/w4a8.log | tail -9
started moe
timeout 230 python3 bench/bench_moe.py --shapes deepseek-v3,qwen3-30b-a3b --methods bf16-grouped,qshard-fp8,qshard-int4,qshard-int4-w4a8 --tokens 1,16,128,1024,4096 2>&1 | tee $OUT/moe.log | tail -22
