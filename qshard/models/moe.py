"""A compact mixture-of-experts feed-forward for `qshard.models.Llama` (Qwen3-MoE's shape of
layer): a float router picks the top-k of E experts per token (softmax over the chosen, as
Qwen3-MoE with `norm_topk_prob`), the routed tokens are sorted by expert, and two grouped
matmuls (`torch._grouped_mm` with offsets, as transformers' default experts implementation)
run every expert at once, gate/up fused. The experts' weights are 3-D parameters of
`Experts` ([E, 2I, dim] and [E, dim, I]), registered with `qshard.register_experts`, so
`qshard.quantize_` turns them into 3-D quantized tensors and the grouped matmuls run qshard's
grouped kernels; the router is a plain parameter and stays float.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..api import register_experts

__all__ = ["Experts", "MoEFeedForward"]


@register_experts
class Experts(nn.Module):
    """gate_up_proj [E, 2I, dim] (each expert's gate rows, then its up rows), down_proj
    [E, dim, I]."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(experts, dim, hidden))

    def forward(self, rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """rows [R, dim] sorted by expert, offs int32 [E] (the end row of each expert's)."""
        gate, up = torch._grouped_mm(rows, self.gate_up_proj.transpose(-2, -1), offs=offs).chunk(
            2, -1
        )
        return torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs=offs)


class MoEFeedForward(nn.Module):
    def __init__(self, dim: int, experts: int, top_k: int, hidden: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Parameter(torch.empty(experts, dim))  # a parameter: stays float
        self.experts = Experts(experts, dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        tokens = x.reshape(-1, dim)
        scores = F.linear(tokens, self.router).float()
        weights, ids = scores.topk(self.top_k, dim=-1)
        weights = weights.softmax(-1).to(x.dtype)
        order = ids.reshape(-1).argsort(stable=True)
        experts = self.router.shape[0]
        flat = ids.reshape(-1)  # (scatter_add, not bincount: a size known when compiling)
        counts = torch.zeros(experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)
        out = self.experts(tokens[order // self.top_k], offs)
        combined = torch.empty_like(out)
        combined[order] = out * weights.reshape(-1)[order, None]
        return combined.view(-1, self.top_k, dim).sum(1).view(b, s, dim)
