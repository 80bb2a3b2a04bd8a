#!/usr/bin/env bash
# Issue 46: the NCCL tests, the README's torchrun examples, the MoE numerics and the tear-down
# on 2 GPUs (nvidia-h200-x2).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
run2() { python3 -m torch.distributed.run --standalone --nproc-per-node 2 "$@" 2>&1 | grep -v "^W1\|OMP_NUM\|\*\*\*\|UserWarning\|return func"; }
timeout 360 python3 -m pytest -q -p no:cacheprovider -m cuda tests/tp 2>&1 | tee $OUT/nccl_tests.log | grep -E "passed|failed|FAILED|EP load|Error" | tail -20
timeout 60 run2 examples/tp_inference.py | tee $OUT/examples.log
timeout 90 run2 examples/tp_checkpoint.py | tee -a $OUT/examples.log
timeout 120 run2 bench/repro/experts_parallel_numerics.py | grep -E "dB|Error" | tee $OUT/numerics.log
timeout 60 run2 bench/bench_all_reduce.py --sizes 4096,131072,524288 | tee $OUT/all_reduce.log
# the tear-down without qshard.tp.shutdown: each rank's stacks at its 45 s deadline
timeout 100 python3 bench/bench_decode.py --config tiny --layouts bf16 --batches 1 --tp 2 --new 16 --prompt 64 --timeout 45 --teardown plain > $OUT/plain_teardown.log 2>&1; grep -E "tok/s|Timeout|File|Thread" $OUT/plain_teardown.log | head -40
