#!/usr/bin/env bash
# nvidia-h200-x4: the NCCL suite at world 4 (second run) beside the native-int4 GPU tests and
# their planted bug (GPU 3, correctness only); then Llama-3.1-8B decode at TP 4.
source bench/gpu/prelude.sh
(
  export CUDA_VISIBLE_DEVICES=3
  started "int4 native tests"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/layouts/test_int4_native.py > $OUT/int4_native.log 2>&1
  started "int4 native tests exit $?"
  # The planted bug: every int4 scale 0.5 % off in the op's launch; the old test and the new.
  rm -rf /tmp/plant && mkdir /tmp/plant && cp -r qshard tests pyproject.toml /tmp/plant/ && cp .plant/test_int4_native_old.py /tmp/plant/tests/layouts/
  python3 - <<'PY'
p = "/tmp/plant/qshard/kernels/w4a16_triton.py"
s = open(p).read()
anchor = "    m, k = x.shape\n    n = qdata.shape[0]\n    assert all(t is None"
assert s.count(anchor) == 1
open(p, "w").write(s.replace(anchor, "    scale = scale * 1.005  # PLANTED\n" + anchor))
PY
  started "planted"
  (cd /tmp/plant && PYTHONPATH=/tmp/site:/tmp/plant timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda -k hopper tests/layouts/test_int4_native_old.py tests/layouts/test_int4_native.py > $OUT/int4_planted.log 2>&1)
  started "planted exit $?"
) &
started "nccl world 4"
QSHARD_NCCL_WORLDS=4 timeout 330 python3 -m pytest -q -s -p no:cacheprovider -m cuda tests/tp --durations=0 > $OUT/nccl_w4.log 2>&1
started "nccl world 4 exit $?"
wait
DECODE="python3 bench/bench_decode.py --new 64 --check --timeout 100 --tp 4 --results $OUT/llama8b.jsonl"
for layout in int4-g128 bf16 fp8-block; do
  [ $SECONDS -lt 500 ] && { started "llama-8b $layout b1"; $DECODE --layouts $layout --batches 1 > $OUT/llama8b_${layout}_b1.log 2>&1; }
done
for layout in int4-g128 bf16 fp8-block; do
  [ $SECONDS -lt 500 ] && { started "llama-8b $layout b32"; $DECODE --layouts $layout --batches 32 > $OUT/llama8b_${layout}_b32.log 2>&1; }
done
started "done"
pkill -9 -f "bench_decode.py" 2>/dev/null
cat $OUT/status.txt; tail -n 8 $OUT/nccl_w4.log | grep -v "^$"; tail -n 3 $OUT/int4_native.log; grep -E "passed|failed|FAILED|Error: \(" $OUT/int4_planted.log | head; grep -h "^|" $OUT/llama8b*.log
