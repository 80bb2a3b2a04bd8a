"""Decode attention, `torch.ops.qshard.decode_attention(q, k_cache, v_cache, input_pos, scale)`:
one query token per sequence attending to the positions 0..input_pos of a static KV cache, with
grouped-query heads (query head h reads KV head h // (Hq / Hkv)). What `qshard.models.Llama`
runs at each decode step in place of `F.scaled_dot_product_attention` with a causal mask row.

On CUDA (sm_80+, Triton) it runs the split-K kernels of `decode_attention_triton.py`, which read
only the filled positions; elsewhere the reference below. Why a kernel of its own: on an H200
the step's cuDNN attention (with the mask row converted and reduced by two more kernels) took
about 10 us a layer at batch 1 for a 1288-position cache of 2.6 MB (docs/decode.md).
"""

from __future__ import annotations

import functools

import torch

from ..errors import InputMismatchError
from .availability import triton_unavailable_reason

__all__ = ["decode_attention", "decode_attention_reference"]


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    input_pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The definition, in float32: softmax(scale * q . k) over positions <= input_pos, times v,
    cast to q's dtype. Later positions are not read (whatever they hold)."""
    b, hq, s, d = q.shape
    hkv, positions = k_cache.shape[1], k_cache.shape[2]
    qf = q.float().reshape(b, hkv, hq // hkv * s, d)
    scores = torch.matmul(qf, k_cache.float().transpose(-1, -2)) * scale
    live = torch.arange(positions, device=q.device) <= input_pos.reshape(-1)[0]
    scores = scores.masked_fill(~live, float("-inf"))
    values = v_cache.float().masked_fill(~live[:, None], 0.0)  # later positions never read
    out = torch.matmul(torch.softmax(scores, dim=-1), values)
    return out.reshape(b, hq, s, d).to(q.dtype)


def _check(q, k_cache, v_cache, input_pos) -> None:
    if q.dim() != 4 or q.shape[2] != 1:
        raise InputMismatchError(
            f"decode_attention: q has shape {tuple(q.shape)}; it takes one query token per "
            "sequence, [batch, heads, 1, head_dim] (run prefill through "
            "F.scaled_dot_product_attention)"
        )
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise InputMismatchError(
            f"decode_attention: k_cache {tuple(k_cache.shape)} and v_cache "
            f"{tuple(v_cache.shape)} must both be [batch, kv_heads, positions, head_dim]"
        )
    b, hq, _, d = q.shape
    if k_cache.shape[0] != b or k_cache.shape[3] != d or hq % k_cache.shape[1]:
        raise InputMismatchError(
            f"decode_attention: q {tuple(q.shape)} does not fit the cache "
            f"{tuple(k_cache.shape)}: same batch and head_dim, and query heads a multiple of "
            "the KV heads"
        )
    if input_pos.numel() != 1:
        raise InputMismatchError(
            f"decode_attention: input_pos has {input_pos.numel()} values; it takes the one "
            "position of the decoded token"
        )


@functools.cache
def _kernel_runs_on(device: torch.device) -> bool:
    # The CPU takes the reference (tests run the kernel interpreted). Cached: the op's Python
    # runs at every call outside CUDA graphs.
    return device.type == "cuda" and triton_unavailable_reason(device, fp8=False) is None


def _runs_triton(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    d = q.shape[-1]
    return (
        _kernel_runs_on(q.device)
        and q.dtype in (torch.float16, torch.bfloat16)
        and k_cache.dtype == q.dtype
        and d >= 16
        and d & (d - 1) == 0
    )


@torch.library.custom_op("qshard::decode_attention", mutates_args=())
def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    input_pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, Hq, 1, D], caches [B, Hkv, S, D], input_pos [1] -> [B, Hq, 1, D] in q's dtype."""
    _check(q, k_cache, v_cache, input_pos)
    if not _runs_triton(q, k_cache):
        return decode_attention_reference(q, k_cache, v_cache, input_pos, scale)
    from .decode_attention_triton import decode_attention_launch  # imports Triton: deferred

    q, k_cache, v_cache = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_cache, v_cache)
    )
    return decode_attention_launch(q, k_cache, v_cache, input_pos.reshape(1), scale)


@decode_attention.register_fake
def _(q, k_cache, v_cache, input_pos, scale):
    _check(q, k_cache, v_cache, input_pos)
    return torch.empty_like(q)
