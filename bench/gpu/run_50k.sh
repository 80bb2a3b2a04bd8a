#!/usr/bin/env bash
# Issue 50, item 3 on one H200: the decode attention op (one-load combine) checked, timed
# against SDPA with the mask row and swept; Llama-3.1-8B-shaped decode at batch 1 with it
# (int4 g128, bf16, FP8 blockwise) and with SDPA (int4 g128, bf16), with the step profile.
source bench/gpu/prelude.sh
timeout 120 python3 -m pytest -q -x tests/kernels/test_decode_attention.py > $OUT/tests.log 2>&1
started "tests exit $?"
timeout 150 python3 bench/bench_decode_attention.py --sweep > $OUT/attention.log 2>&1
started "attention exit $?"
timeout 250 python3 bench/bench_decode.py --layouts int4-g128,bf16,fp8-block --batches 1 --new 64 --profile > $OUT/decode_kernel.log 2>&1
started "decode kernel exit $?"
if [ $SECONDS -lt 430 ]; then
timeout $((590 - SECONDS)) python3 bench/bench_decode.py --attention sdpa --layouts int4-g128,bf16 --batches 1 --new 64 --profile > $OUT/decode_sdpa.log 2>&1
started "decode sdpa exit $?"
fi
