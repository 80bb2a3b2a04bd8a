#!/usr/bin/env bash
# Issue 50, item 3 on one H200: the decode attention op's plan (128-position blocks, 2
# programs per SM) timed against SDPA with the mask row; Llama-3.1-8B-shaped decode at batch 32
# with it (int4 g128, bf16, FP8 blockwise) and with SDPA (int4 g128, bf16), step profiles.
source bench/gpu/prelude.sh
timeout 100 python3 bench/bench_decode_attention.py > $OUT/attention.log 2>&1
started "attention exit $?"
timeout 320 python3 bench/bench_decode.py --layouts bf16,int4-g128,fp8-block --batches 32 --new 64 --profile > $OUT/decode_kernel.log 2>&1
started "decode kernel exit $?"
if [ $SECONDS -lt 400 ]; then
timeout $((590 - SECONDS)) python3 bench/bench_decode.py --attention sdpa --layouts bf16,int4-g128 --batches 32 --new 64 --profile > $OUT/decode_sdpa.log 2>&1
started "decode sdpa exit $?"
fi
