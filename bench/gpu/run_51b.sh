#!/usr/bin/env bash
# nvidia-h200-x4, call 2: the NCCL suite at world 4; DeepSeek-V3's MoE layers (2) in FP8
# blockwise at EP 4, ETP 4 (512 rows a rank) and EP 2 x TP 2, checked against one GPU's.
source bench/gpu/prelude.sh
started "nccl world 4"
QSHARD_NCCL_WORLDS=4 timeout 300 python3 -m pytest -q -s -p no:cacheprovider -m cuda tests/tp > $OUT/nccl_w4.log 2>&1
started "nccl world 4 exit $?"
DSV3="python3 bench/bench_decode.py --config deepseek-v3 --layers 2 --prompt 128 --new 64 --check --timeout 110 --tp 4 --layouts fp8-block --profile --results $OUT/dsv3.jsonl"
for experts in ep etp ep-x-tp2; do
  [ $SECONDS -lt 480 ] && { started "deepseek $experts"; $DSV3 --experts $experts --batches 32 > $OUT/dsv3_$experts.log 2>&1; }
done
[ $SECONDS -lt 470 ] && { started "deepseek ep 1,256"; $DSV3 --experts ep --batches 1,256 > $OUT/dsv3_ep_1_256.log 2>&1; }
started "deepseek done"
pkill -9 -f "bench_decode.py" 2>/dev/null
cat $OUT/status.txt; tail -n 3 $OUT/nccl_w4.log; grep -h "^|\|INFO step" $OUT/*.log
