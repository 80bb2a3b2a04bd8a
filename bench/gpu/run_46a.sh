#!/usr/bin/env bash
# Issue 46, first GPU run: the links, the all-reduce methods, the MoE numerics, the NCCL tests.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
nvidia-smi topo -m; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.device_count())"
timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/bench_all_reduce.py 2>&1 | grep -v "^W1\|OMP_NUM\|\*\*\*" | tee $OUT/all_reduce.log
timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/repro/experts_parallel_numerics.py 2>&1 | grep -E "dB|Error|error" | tee $OUT/numerics.log
timeout 430 python3 -m pytest -q -p no:cacheprovider tests/tp/test_tensor_parallel_cuda.py tests/tp/test_experts_parallel_cuda.py 2>&1 | tee $OUT/nccl_tests.log | tail -60
