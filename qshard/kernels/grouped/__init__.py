"""Grouped (mixture-of-experts) matmul kernels in Triton, one launch over every expert:
`select.py` chooses the kernel, `ops.py` holds the `torch.library` ops, `common.py` what the
kernels share. Imports nothing itself (Triton is imported when a kernel is about to run:
`kernels/loader.py`)."""
