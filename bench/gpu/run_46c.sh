#!/usr/bin/env bash
# Issue 46: the NCCL tests on 2 GPUs (nvidia-h200-x2; the examples ran in run_46d.sh).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
timeout 470 python3 -m pytest -q -s -p no:cacheprovider -m cuda tests/tp 2>&1 | tee $OUT/nccl_tests.log | grep -E "passed|failed|FAILED|EP load|Error|dB" | tail -40
