#!/usr/bin/env bash
# Issue 50, W4A8 on one H200: its correctness on the GPU (bench_w4a8.py's checks), the tile sweep
# and the Llama-3.1-8B layer table, then the MoE experts (bench_moe.py) with the W4A8 experts.
source bench/gpu/prelude.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
started w4a8
timeout 330 python3 bench/bench_w4a8.py --sweep 2>&1 | tee $OUT/w4a8.log | grep -v "^sweep .* fails" | tail -60
started moe
timeout 200 python3 bench/bench_moe.py --shapes deepseek-v3,qwen3-30b-a3b --methods bf16-grouped,qshard-int4,qshard-int4-w4a8 --tokens 1,16,128,4096 2>&1 | tee $OUT/moe.log | tail -30
