#!/usr/bin/env bash
# Issue 50 on one H200, the session's last device time: the decode attention tests after the
# review's fixes (filled positions divided among the splits, int64 offsets, head dim 256, the
# model compiled with CUDA graphs), then Llama-3.1-8B-shaped decode at batch 1 (int4 g128, bf16)
# with the shipped plan, and the op's own table if time is left.
source bench/gpu/prelude.sh
timeout 80 python3 -m pytest -q -x tests/kernels/test_decode_attention.py > $OUT/tests.log 2>&1
started "tests exit $?"
timeout $((228 - SECONDS)) python3 bench/bench_decode.py --layouts bf16,int4-g128 --batches 1 --new 64 --profile > $OUT/decode.log 2>&1
started "decode exit $?"
if [ $SECONDS -lt 195 ]; then
timeout $((232 - SECONDS)) python3 bench/bench_decode_attention.py --batches 1 > $OUT/attention.log 2>&1
started "attention exit $?"
fi
