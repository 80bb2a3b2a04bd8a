"""Which GPU kernel backends can run here, decided without importing Triton (layouts use this;
the kernel modules, which import Triton, are loaded only when a kernel is about to run)."""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F

__all__ = [
    "cublas_unavailable_reason",
    "native_int4_problem",
    "triton_unavailable_reason",
]


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_unavailable_reason(device: torch.device, fp8: bool = True) -> str | None:
    """Why the Triton kernels cannot run on `device`, or None if they can: the FP8 kernels
    (`fp8`) need sm_89+, the weight-only ones (bf16/fp16 MMAs) sm_80+. On the CPU they run only
    under the Triton interpreter (TRITON_INTERPRET=1, for tests)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton)"
    if device.type == "cpu" and triton_interpreted():
        return None
    if device.type != "cuda":
        return f"the Triton kernels run on CUDA GPUs, not {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if fp8 and capability < (8, 9):
        name = torch.cuda.get_device_name(device)
        return f"Triton's fp8 dot needs sm_89 or newer (Ada, Hopper); {name} is older"
    if capability < (8, 0):
        name = torch.cuda.get_device_name(device)
        return f"the weight-only kernels' bf16 dot needs sm_80 or newer; {name} is older"
    return None


def cublas_unavailable_reason(
    device: torch.device, n: int, k: int, block_n: int, block_k: int, group: int
) -> str | None:
    """Why cuBLAS blockwise FP8 (`F.scaled_mm`) cannot run this layout here, or None."""
    if device.type != "cuda":
        return f"it needs a CUDA device, not {device.type}"
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return f"torch {torch.__version__} has no F.scaled_mm blockwise scaling (torch >= 2.10)"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "cuBLAS blockwise FP8 runs on sm_90 (H100/H200) only"
    if (block_n, block_k, group) != (128, 128, 128):
        return (
            f"cuBLAS takes 128x128 weight blocks and 1x128 activation groups, not "
            f"{block_n}x{block_k} blocks with 1x{group} groups"
        )
    if k % 128 or n % 128:
        return f"cuBLAS needs N and K multiples of 128 (no partial blocks), got N={n}, K={k}"
    if k // 128 % 4:
        # torch's scaled_mm asks for weight scales of K/128 rows rounded up to a multiple of 4
        # (seen on an H200, torch 2.11: "scale_b must have shape 16 x 56 ..., got [14, 56]" at
        # K = 1792, DeepSeek-V3's attention output cut over 4 ranks)
        return f"cuBLAS blockwise needs K / 128 to be a multiple of 4, got K={k} ({k // 128})"
    return None


def native_int4_problem(device: torch.device) -> str | None:
    """Why int4 weights on `device` do not hold their codes in the native order of the Hopper
    register kernels (`packing.native_codes`; the word GEMV and the wgmma kernel read it), or
    None where they do: a CUDA device of compute capability 9.0 whose Triton has Gluon. Triton
    is imported only on such a device."""
    if device.type != "cuda":
        return f"the native order is for Hopper GPUs, not {device.type}"
    if torch.cuda.get_device_capability(device) != (9, 0):
        name = torch.cuda.get_device_name(device)
        return f"the native order's kernels run on sm_90 (Hopper), not on {name}"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton)"
    from .gluon_api import GLUON_IMPORT_ERROR  # imports Triton: only on a Hopper GPU

    if GLUON_IMPORT_ERROR is not None:
        return f"this Triton has no usable Gluon ({GLUON_IMPORT_ERROR})"
    return None
