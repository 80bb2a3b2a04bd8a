"""Kernels, one file per family: the reference definition beside each fast implementation."""
