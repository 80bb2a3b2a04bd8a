#!/usr/bin/env bash
# Builds Marlin (github.com/IST-DASLab/marlin, the FP16 x INT4 kernel; bench_int4.py's `marlin`
# row) in place in a checkout of it, for the Hopper GPU this runs on:
#
#     bench/build_marlin.sh PATH/TO/marlin && export PYTHONPATH=PATH/TO/marlin
#
# One change to its source first: with CUDA 13's ptxas (13.0 on the GPU machine here) the
# cache-hinted cp.async of Marlin's weight loads is built without its createpolicy and traps
# (cudaErrorIllegalInstruction at the first call; IST-DASLab/marlin#44; seen here 2026-11-25,
# also with the policy passed in as an operand), so those loads become a plain cp.async.cg
# (the workaround of IST-DASLab/marlin#40): the same copies without the evict-first L2 hint.
set -euo pipefail
cd "$1"
python3 - <<'PY'
import pathlib
import re

path = pathlib.Path("marlin/marlin_cuda_kernel.cu")
source = path.read_text()
hinted = re.compile(
    r'asm volatile\(\s*"\{\\n"\s*"\s*\.reg \.b64 p;\\n"\s*'
    r'"\s*createpolicy\.fractional\.L2::evict_first\.b64 p, 1\.0;"\s*'
    r'"\s*cp\.async\.cg\.shared\.global\.L2::cache_hint \[%0\], \[%1\], %2, p;\\n"\s*'
    r'"\}\\n" :: "r"\(smem\), "l"\(glob_ptr\), "n"\(BYTES\)\s*\);'
)
plain = ('asm volatile("cp.async.cg.shared.global [%0], [%1], %2;\\n" '
         ':: "r"(smem), "l"(glob_ptr), "n"(BYTES));')
if "cp.async.cg.shared.global.L2::cache_hint" in source:
    source, count = hinted.subn(lambda _: plain, source)
    if count != 1:
        raise SystemExit(f"expected one cache-hinted cp.async in {path}, replaced {count}")
    path.write_text(source)
PY
TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" python3 setup.py build_ext --inplace
