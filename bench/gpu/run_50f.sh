#!/usr/bin/env bash
# Issue 50, item 1 on one H200: the GPU's traits, the tuner (the op's own choice against every
# kernel, per Llama-3.1-8B linear and token bucket) writing kernels/tuned/h200.json, then the
# GPU tests of the tuning and the Gluon W4A16 kernels with that file in place.
source bench/gpu/prelude.sh
python3 -c "import torch; from qshard.kernels.gpu import traits; print(torch.cuda.get_device_properties(0)); print(traits(0))" > $OUT/traits.txt 2>&1
started tune
timeout 450 python3 bench/tune_w4a16.py --formats int4,mxfp4,nvfp4 --out qshard/kernels/tuned/h200.json > $OUT/tune.log 2>&1
started "tune exit $?"
cp qshard/kernels/tuned/h200.json $OUT/ 2>/dev/null
timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_tuning.py tests/kernels/test_w4a16_gluon_wgmma.py 2>&1 | tail -5 > $OUT/tests.log
started "tests done"
