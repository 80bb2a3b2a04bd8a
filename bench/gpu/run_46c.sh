#!/usr/bin/env bash
# Issue 46: the NCCL tests and the README's torchrun examples on 2 GPUs (nvidia-h200-x2).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
run2() { python3 -m torch.distributed.run --standalone --nproc-per-node 2 "$@" 2>&1 | grep -v "^W1\|OMP_NUM\|\*\*\*\|UserWarning\|return func"; }
timeout 60 run2 examples/tp_inference.py | tee $OUT/examples.log
timeout 60 run2 examples/tp_checkpoint.py | tee -a $OUT/examples.log
timeout 470 python3 -m pytest -q -s -p no:cacheprovider -m cuda tests/tp 2>&1 | tee $OUT/nccl_tests.log | grep -E "passed|failed|FAILED|EP load|Error|dB" | tail -40
