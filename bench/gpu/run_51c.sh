#!/usr/bin/env bash
# nvidia-h200-x4, call 3: issue 46's remaining decode rows (lane 0,1), the single-GPU tests and
# the 2-GPU NCCL suite again (lane 2,3), then the NCCL suite at world 4 on all four.
source bench/gpu/prelude.sh
DECODE="python3 bench/bench_decode.py --new 64 --check --timeout 100"
(
  export CUDA_VISIBLE_DEVICES=0,1
  started "llama-8b fp8 batch 32"
  $DECODE --layouts fp8-block --batches 32 --tp 1,2 --profile --results $OUT/llama8b.jsonl > $OUT/llama8b_fp8_b32.log 2>&1
  QWEN="$DECODE --config qwen3-30b-a3b --layers 12 --tp 2 --results $OUT/qwen.jsonl"
  started "qwen etp"
  $QWEN --experts etp --layouts bf16,fp8-block --batches 32 > $OUT/qwen_etp.log 2>&1
  started "qwen a2a"
  $QWEN --experts ep-all-to-all --layouts bf16,fp8-block --batches 32 > $OUT/qwen_a2a.log 2>&1
  started "lane 0,1 done"
) &
(
  export CUDA_VISIBLE_DEVICES=2
  started "single-GPU tests"
  timeout 250 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/layouts/test_int4_native.py > $OUT/single_gpu.log 2>&1
  started "single-GPU tests exit $?"
  export CUDA_VISIBLE_DEVICES=2,3
  [ $SECONDS -lt 200 ] && { QSHARD_NCCL_WORLDS=2 timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m cuda tests/tp > $OUT/nccl_w2.log 2>&1; started "nccl world 2 exit $?"; }
) &
wait
pkill -9 -f "bench_decode.py" 2>/dev/null
started "nccl world 4"
QSHARD_NCCL_WORLDS=4 timeout $((590 - SECONDS)) python3 -m pytest -q -s -p no:cacheprovider -m cuda tests/tp > $OUT/nccl_w4.log 2>&1
started "nccl world 4 exit $?"
cat $OUT/status.txt; tail -n 3 $OUT/single_gpu.log $OUT/nccl_w*.log; grep -h "^|\|INFO step" $OUT/*.log
