"""The W4A8 Triton kernel (int4 weights on FP8 tensor cores) and its ops; the definitions are
`kernels/w4a8.py`'s references."""
