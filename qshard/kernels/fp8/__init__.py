"""FP8 blockwise W8A8 kernels (128x128 weight blocks, 1x128 dynamic activation groups, as in
DeepSeek-V3): `select.py` chooses the kernel, `ops.py` holds the `torch.library` op, each other
module is one kernel (its `problem()`, `config()` and `launch()`) or the activation quantization
they share (`act_quant.py`). The package imports nothing itself (Triton is imported when a kernel
is about to run: `kernels/loader.py`)."""
