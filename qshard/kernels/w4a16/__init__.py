"""Weight-only 4-bit (W4A16) kernels, one family for every 4-bit layout: int4 (asymmetric,
symmetric, float zero point), MXFP4 and NVFP4. `select.py` chooses the kernel; `ops.py` holds
the `torch.library` ops; each other module is one kernel (its `problem()`, `config()` and
`launch()`) or what they share (`decode.py`, `register_parts.py`, `format.py`). The package
imports nothing itself: `format.py` and `select.py`'s callers stay free of Triton until a kernel
is about to run (`kernels/loader.py`)."""
