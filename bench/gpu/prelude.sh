# Sourced by the bench/gpu/run_*.sh scripts: NVLink multicast off in every process, the carried
# transformers wheel, no bench child left from an earlier call holding a GPU.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
pkill -9 -f "bench_decode.py" 2>/dev/null
# A lane starts its next command only while there is time left for it (bash's SECONDS).
started() { echo "$(date +%T) +${SECONDS}s $*" >> $OUT/status.txt; }
