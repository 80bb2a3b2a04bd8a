"""Decode attention, `torch.ops.qshard.decode_attention(q, k_cache, v_cache, input_pos, scale)`:
one query token per sequence attending to the positions 0..input_pos of a static KV cache, with
grouped-query heads (query head h reads KV head h // (Hq / Hkv)). `qshard.models.Llama` runs it
at one-token steps against its cache where `kernel_applies` (else SDPA with the causal mask row).

On CUDA (sm_80+, Triton; fp16 or bf16; head dims 16-256, powers of two) it runs the split-K
kernels of `decode_attention_triton.py`, which read only the filled positions; elsewhere the
float32 reference below (for the CPU and tests: it copies the cache to float32). Why a kernel
of its own: at batch 1 SDPA with the mask row took 14 us a Llama-3.1-8B layer on an H200 for a
1288-position cache (5.3 MB of K and V), the kernels 6.8 (docs/kernels/decode_attention.md).
"""

from __future__ import annotations

import torch

from ..errors import InputMismatchError
from .availability import triton_unavailable_reason

__all__ = ["decode_attention", "decode_attention_reference", "kernel_applies"]


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
    return out.reshape(b, hq, s, d).to(q.dtype).contiguous()


def _fail(rule: str) -> None:
    raise InputMismatchError(f"decode_attention: {rule}")


def _check(q, k_cache, v_cache, input_pos) -> None:
    """Every rule the kernels and the reference rely on, each failure naming the values."""
    if q.dim() != 4 or q.shape[2] != 1:
        _fail(
            f"q has shape {tuple(q.shape)}; it takes one query token per sequence, [batch, "
            "heads, 1, head_dim] (run a prompt through F.scaled_dot_product_attention)"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        _fail(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
            "[batch, kv_heads, positions, head_dim], the same shape"
        )
    b, hq, _, d = q.shape
    batch, hkv, positions, head_dim = k_cache.shape
    if batch != b or head_dim != d or hkv == 0 or hq % hkv or positions == 0:
        _fail(
            f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}: they need the "
            "same batch and head_dim, query heads a multiple of the (non-zero) KV heads, and "
            "at least one position; give the cache of this layer and this batch"
        )
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        _fail(
            f"q, k_cache and v_cache are {q.dtype}, {k_cache.dtype}, {v_cache.dtype}; cast "
            "them to one dtype"
        )
    if input_pos.numel() != 1 or input_pos.dtype.is_floating_point or input_pos.is_complex():
        _fail(
            f"input_pos is {input_pos.dtype} with {input_pos.numel()} values; it takes the one "
            "integer position of the decoded token, e.g. torch.tensor([pos])"
        )
    if not q.device == k_cache.device == v_cache.device == input_pos.device:
        _fail(
            f"q, k_cache, v_cache and input_pos are on {q.device}, {k_cache.device}, "
            f"{v_cache.device}, {input_pos.device}; move them to one device"
        )


_RUNS_ON: dict[torch.device, bool] = {}


@torch.compiler.assume_constant_result  # a compiled model asks it while tracing
def _kernel_runs_on(device: torch.device) -> bool:
    # Cached: the op's Python runs at every call outside CUDA graphs.
    if device not in _RUNS_ON:
        usable = device.type == "cuda" and triton_unavailable_reason(device, fp8=False) is None
        _RUNS_ON[device] = usable
    return _RUNS_ON[device]


def kernel_applies(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the op runs its Triton kernels for q and this cache (else the reference): a
    CUDA GPU with Triton, fp16 or bf16, a head dim that is a power of two from 16 to 256 (the
    CPU takes the reference; tests run the kernels under the interpreter directly)."""
    d = q.shape[-1]
    return (
        _kernel_runs_on(q.device)
        and q.dtype in (torch.float16, torch.bfloat16)
        and 16 <= d <= 256
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
    """q [B, Hq, 1, D], caches [B, Hkv, S, D], input_pos [1] -> [B, Hq, 1, D] in q's dtype,
    contiguous."""
    _check(q, k_cache, v_cache, input_pos)
    if not kernel_applies(q, k_cache):
        return decode_attention_reference(q, k_cache, v_cache, input_pos, scale)
    from .decode_attention_triton import decode_attention_launch  # imports Triton: deferred

    q, k_cache, v_cache = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_cache, v_cache)
    )
    return decode_attention_launch(q, k_cache, v_cache, input_pos.reshape(1), scale)


@decode_attention.register_fake
def _(q, k_cache, v_cache, input_pos, scale):
    _check(q, k_cache, v_cache, input_pos)
    return q.new_empty(q.shape)  # contiguous, as both paths return
