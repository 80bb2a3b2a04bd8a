#!/usr/bin/env bash
# nvidia-h200-x4: the native-int4 GPU tests under a planted bug of the word GEMV alone (the
# old test and the new); the NCCL suite at world 4 (third run); Llama-3.1-8B decode at TP 4.
source bench/gpu/prelude.sh
rm -rf /tmp/plant && mkdir /tmp/plant && cp -r qshard tests pyproject.toml /tmp/plant/ && cp .plant/test_int4_native_old.py /tmp/plant/tests/layouts/
python3 - <<'PY'
p = "/tmp/plant/qshard/kernels/w4a16_triton.py"
s = open(p).read()
anchor = "    _gemv_words_kernel[grid](\n"
assert s.count(anchor) == 1
open(p, "w").write(s.replace(anchor, "    args = (*args[:2], args[2] * 1.005, *args[3:])  # PLANTED\n" + anchor))
PY
started "planted"
(cd /tmp/plant && CUDA_VISIBLE_DEVICES=3 PYTHONPATH=/tmp/site:/tmp/plant timeout 120 python3 -m pytest -q -p no:cacheprovider -m cuda -k "hopper_quantize" tests/layouts/test_int4_native_old.py tests/layouts/test_int4_native.py > $OUT/int4_planted.log 2>&1)
started "planted exit $?"
started "nccl world 4"
QSHARD_NCCL_WORLDS=4 timeout 330 python3 -m pytest -q -s -p no:cacheprovider -m cuda tests/tp --durations=0 > $OUT/nccl_w4.log 2>&1
started "nccl world 4 exit $?"
DECODE="python3 bench/bench_decode.py --new 64 --check --timeout 100 --tp 4 --results $OUT/llama8b.jsonl"
[ $SECONDS -lt 460 ] && { started "llama-8b fp8-block b1"; $DECODE --layouts fp8-block --batches 1 > $OUT/llama8b_fp8-block_b1.log 2>&1; }
started "done"
pkill -9 -f "bench_decode.py" 2>/dev/null
cat $OUT/status.txt; tail -n 8 $OUT/nccl_w4.log | grep -v "^$"; grep -E "passed|failed|FAILED|AssertionError: \(" $OUT/int4_planted.log | head; grep -h "^|" $OUT/llama8b*.log
