#!/usr/bin/env bash
# Issue 50 on one H200, the session's last device time: the decode attention tests (int64
# sequence offsets), then Llama-3.1-8B-shaped decode at batch 1 for the FP4 layouts beside bf16.
source bench/gpu/prelude.sh
timeout 90 python3 -m pytest -q -x tests/kernels/test_decode_attention.py > $OUT/tests.log 2>&1
started "tests exit $?"
timeout $((235 - SECONDS)) python3 bench/bench_decode.py --layouts bf16,mxfp4,nvfp4 --batches 1 --new 64 --profile > $OUT/decode_fp4.log 2>&1
started "decode fp4 exit $?"
