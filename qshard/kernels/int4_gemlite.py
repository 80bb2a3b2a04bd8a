"""The gemlite backend of the int4 layout: gemlite's A16Wn kernels (docs/design.md, "PyTorch
behaviour") on a device form made from the canonical packing (`kernels/int4.py`).

gemlite's int4 weight is W = (W_q - zeros) * scales with W_q in 0..15 and one (scale, zero)
per row per group: the canonical definition itself, so the form holds the same weights (the
symmetric layout's zero point 8 is written out). gemlite packs for one activation dtype (its
scales are cast to it), so the form is made for the weight's outer dtype.

gemlite is optional and imported lazily: importing it queries the CUDA device and raises on a
machine without one (docs/design.md, "PyTorch behaviour"). On a GPU with no shipped gemlite config
(H200) the H100 config is loaded, or gemlite would autotune for minutes per shape (docs/design.md,
"PyTorch behaviour").
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
import torch.nn.functional as F

from .packing import unpack_nibbles

__all__ = ["gemlite_form", "gemlite_linear", "gemlite_problem"]

# GPUs with no shipped gemlite config, and the config that serves them (same SM, same caches).
NEAREST_CONFIG = {"h200": "h100"}


def gemlite_problem(
    device: torch.device, dtype: torch.dtype, x_dtype: torch.dtype | None
) -> str | None:
    """Why gemlite cannot run a weight of outer `dtype` on `device` with `x_dtype` activations
    (None: not known yet), or None."""
    if device.type != "cuda":
        return f"gemlite runs on CUDA GPUs only, not {device.type}"
    if importlib.util.find_spec("gemlite") is None:
        return "gemlite is not installed (pip install gemlite)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"gemlite takes float16 or bfloat16 weights and activations, not {dtype}"
    if x_dtype is not None and x_dtype != dtype:
        return (
            f"the gemlite form is made for {dtype} activations and the input is {x_dtype}; cast "
            f"the input, or .to({x_dtype}) the weight"
        )
    return None


@functools.cache
def _load_gemlite():
    import gemlite  # optional: the gemlite backend

    name = torch.cuda.get_device_properties(0).name.lower().replace(" ", "_")
    configs = os.path.join(os.path.dirname(gemlite.__file__), "configs")
    for gpu, nearest in NEAREST_CONFIG.items():
        if gpu in name and not os.path.exists(os.path.join(configs, f"{gpu}.json")):
            gemlite.core.GemLiteLinear.load_config(os.path.join(configs, f"{nearest}.json"))
    return gemlite


def gemlite_form(
    qdata: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group: int,
    k: int,
    dtype: torch.dtype,
) -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
    """({"gemlite_w", "gemlite_scales", "gemlite_zeros", "gemlite_meta_scale"}, meta) for the
    canonical int4 weight; meta = (K, K_pad, N, gemlite's 12 meta arguments...). A partial last
    group is padded with zero-weight columns (code = zero point)."""
    gemlite = _load_gemlite()
    groups = scale.shape[1]
    k_pad = groups * group
    codes = unpack_nibbles(qdata, k)
    z = zero if zero.numel() else torch.full_like(scale, 8.0)
    if k_pad != k:
        pad = z[:, -1:].to(torch.uint8).expand(-1, k_pad - k)
        codes = torch.cat([codes, pad], dim=1)
    linear = gemlite.helper.A16Wn(device=qdata.device, dtype=dtype).from_weights(
        codes.contiguous(), scale.to(dtype), z.to(dtype), W_nbits=4, group_size=group
    )
    w, scales, zeros, meta_scale = linear.get_tensor_args()
    tensors = {
        "gemlite_w": w,
        "gemlite_scales": scales,
        "gemlite_zeros": zeros,
        "gemlite_meta_scale": meta_scale,
    }
    return tensors, (k, k_pad, qdata.shape[0], *linear.get_meta_args())


def gemlite_linear(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], meta: tuple[int, ...], bias
) -> torch.Tensor:
    """y = x @ W.T + bias through gemlite's compile-safe op; x [..., K] in the form's dtype."""
    _load_gemlite()
    k, k_pad, n, *gemlite_meta = meta
    x2d = x.reshape(-1, k)
    if k_pad != k:
        x2d = F.pad(x2d, (0, k_pad - k))
    args = [tensors[n] for n in ("gemlite_w", "gemlite_scales", "gemlite_zeros")]
    args.append(tensors["gemlite_meta_scale"])
    out = torch.ops.gemlite.forward_functional(x2d, bias, args, list(gemlite_meta))
    return out.reshape(*x.shape[:-1], n)
