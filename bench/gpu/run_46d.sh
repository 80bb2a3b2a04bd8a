#!/usr/bin/env bash
# Issue 46: the README's torchrun examples, TP 1 / TP 2 decode, the plain tear-down (nvidia-h200-x2).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
for example in tp_inference tp_checkpoint; do
  timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node 2 examples/$example.py 2>&1 | grep -E "^TP|Error|rror:" | tee -a $OUT/examples.log; echo "exit ${PIPESTATUS[0]}"
done
timeout 420 python3 bench/bench_decode.py --layouts bf16,int4-g128,fp8-block --batches 1 --tp 1,2 --new 64 --profile --timeout 120 2>&1 | tee $OUT/decode.log | grep -v "^W1\|Warning\|warn\|^\[rank"
# the tear-down without qshard.tp.shutdown: each rank's stacks at its 40 s deadline
timeout 100 python3 bench/bench_decode.py --config tiny --layouts bf16 --batches 1 --tp 2 --new 16 --prompt 64 --timeout 40 --teardown plain > $OUT/plain_teardown.log 2>&1; grep -E "tok/s|Timeout|File|Thread" $OUT/plain_teardown.log | head -30
