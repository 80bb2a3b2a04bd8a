#!/usr/bin/env bash
# nvidia-h200-x4: the NCCL suite at world 4 (GPUs 0-3) beside the int4 native-code tolerance
# measurement (GPU 3, correctness only); then DeepSeek-V3's MoE layers (2) in FP8 blockwise at
# EP 4, checked against one GPU's, at batch 32, 1 and 256.
source bench/gpu/prelude.sh
(
  export CUDA_VISIBLE_DEVICES=3
  started "int4 tolerance"
  timeout 240 python3 bench/repro/int4_native_tolerance.py --draws 10 > $OUT/int4_tol.log 2>&1
  started "int4 tolerance exit $?"
) &
started "nccl world 4"
QSHARD_NCCL_WORLDS=4 timeout 330 python3 -m pytest -q -s -p no:cacheprovider -m cuda tests/tp --durations=0 > $OUT/nccl_w4.log 2>&1
started "nccl world 4 exit $?"
wait
DSV3="python3 bench/bench_decode.py --config deepseek-v3 --layers 2 --prompt 128 --new 64 --check --timeout 110 --tp 4 --layouts fp8-block --profile --results $OUT/dsv3.jsonl"
for batch in 32 1 256; do
  [ $SECONDS -lt 470 ] && { started "deepseek ep $batch"; $DSV3 --experts ep --batches $batch > $OUT/dsv3_ep_$batch.log 2>&1; }
done
started "deepseek done"
pkill -9 -f "bench_decode.py" 2>/dev/null
cat $OUT/status.txt; tail -n 40 $OUT/nccl_w4.log | grep -v "^$"; cat $OUT/int4_tol.log; grep -h "^|\|INFO step\|Error\|error" $OUT/dsv3*.log | head -60
