#!/usr/bin/env bash
# Issue 50, W4A8 with the two-plane conversion on one H200: the checks, the tile sweep and the
# Llama-3.1-8B layer table (beside FP8 blockwise), then the MoE experts.
source bench/gpu/prelude.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
started w4a8
timeout 330 python3 bench/bench_w4a8.py --sweep --ms 1,16,128,512,2048 2>&1 | tee $OUT/w4a8.log | grep -v "^sweep .* fails" | tail -45
started moe
timeout 200 python3 bench/bench_moe.py --shapes deepseek-v3,qwen3-30b-a3b --methods bf16-grouped,qshard-fp8,qshard-int4-w4a8 --tokens 128,4096 2>&1 | tee $OUT/moe.log | tail -20
