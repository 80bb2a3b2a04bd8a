#!/usr/bin/env bash
# Issue 50: the W4A8 tests on one H200 (the cuBLAS route's tolerance), and the layer table.
source bench/gpu/prelude.sh
started tests
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_w4a8.py 2>&1 | grep -E "Error|assert|passed|failed" | tail -12 | tee $OUT/tests.log
started w4a8
timeout 150 python3 bench/bench_w4a8.py --no-check --ms 1,16,64,128,512,2048 2>&1 | tee $OUT/w4a8.log | tail -9
