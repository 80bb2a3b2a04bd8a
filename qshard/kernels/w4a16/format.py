"""The 4-bit formats the W4A16 kernels read (a `FORMAT` constexpr in every kernel): how a code
and its group's scale become a weight. No Triton here, so that choosing a kernel
(`select.py`) and the layouts can name a format without importing it.

    INT4_ASYM  W = (u - zero) * scale, bf16 scale and zero
    INT4_SYM   W = (u - 8) * scale
    INT4_FZERO W = (u - 8) * scale + zero, zero a float value
    MXFP4      W = e2m1(c) * 2**(e - 127), e8m0 byte e
    NVFP4      W = (e2m1(c) * e4m3 scale) * global_scale
"""

from __future__ import annotations

import enum

__all__ = ["Format", "tuned_format"]


class Format(enum.IntEnum):
    INT4_ASYM = 0
    INT4_SYM = 1
    INT4_FZERO = 2  # the int4 formats come first: `FORMAT >= MXFP4` means e2m1
    MXFP4 = 3
    NVFP4 = 4

    @property
    def is_int4(self) -> bool:
        return self < Format.MXFP4


def tuned_format(fmt: Format, group: int, native: bool = False) -> str:
    """The format part of a tuned config's key: "int4_asym_g128", "mxfp4_g32", ...;
    "int4_asym_g128_native" for int4 codes in the native order (other kernels read them). A
    float zero point moves the same bytes as an integer one and takes its configs."""
    fmt = Format.INT4_ASYM if fmt == Format.INT4_FZERO else fmt
    return f"{fmt.name.lower()}_g{group}" + ("_native" if native else "")
