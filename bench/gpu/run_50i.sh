#!/usr/bin/env bash
# Issue 50, items 3 and 4 on one H200: Llama-3.1-8B-shaped decode at batch 1 (bf16, qshard int4
# g128, torchao's int4, qshard FP8 blockwise), each in a fresh process, with the step profile.
source bench/gpu/prelude.sh
timeout 350 python3 bench/bench_decode.py --layouts bf16,int4-g128,torchao-int4,fp8-block --batches 1 --new 64 --profile --results $OUT/decode.jsonl > $OUT/decode.log 2>&1
started "decode exit $?"
