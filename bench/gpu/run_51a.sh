#!/usr/bin/env bash
# nvidia-h200-x4, call 1: issue 46's 2-GPU runs in two lanes of 2 GPUs (0,1 and 2,3).
source bench/gpu/prelude.sh
nvidia-smi topo -m > $OUT/topo.txt 2>&1
DECODE="python3 bench/bench_decode.py --new 64 --check --timeout 100"
(
  export CUDA_VISIBLE_DEVICES=0,1
  started "nccl world 2"
  QSHARD_NCCL_WORLDS=2 timeout 260 python3 -m pytest -q -s -p no:cacheprovider -m cuda tests/tp > $OUT/nccl_w2.log 2>&1
  started "nccl world 2 exit $?; llama-8b batch 32"
  $DECODE --layouts bf16,int4-g128,fp8-block --batches 32 --tp 1,2 --profile --results $OUT/llama8b.jsonl > $OUT/llama8b_b32.log 2>&1
  started "llama-8b done"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  sleep 20
  started "single-GPU tests"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/layouts/test_int4_native.py > $OUT/single_gpu.log 2>&1
  started "single-GPU tests exit $?"
) &
(
  export CUDA_VISIBLE_DEVICES=2,3
  QWEN="$DECODE --config qwen3-30b-a3b --layers 12 --tp 2 --results $OUT/qwen.jsonl"
  started "qwen ep"
  $QWEN --experts ep --layouts bf16,fp8-block,int4-g128,mxfp4 --batches 1,32 --profile > $OUT/qwen_ep.log 2>&1
  [ $SECONDS -lt 430 ] && { started "qwen etp"; $QWEN --experts etp --layouts bf16,fp8-block --batches 32 > $OUT/qwen_etp.log 2>&1; }
  [ $SECONDS -lt 500 ] && { started "qwen a2a"; $QWEN --experts ep-all-to-all --layouts fp8-block --batches 32 > $OUT/qwen_a2a.log 2>&1; }
  started "qwen done"
) &
wait
pkill -9 -f "bench_decode.py" 2>/dev/null
cat $OUT/status.txt; tail -n 3 $OUT/nccl_w2.log $OUT/single_gpu.log; grep -h "^|" $OUT/*.log
