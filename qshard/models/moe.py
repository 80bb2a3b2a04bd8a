"""A compact mixture-of-experts feed-forward for `qshard.models.Llama` (Qwen3-MoE's shape of
layer): a float router picks the top-k of E experts per token (softmax over the chosen, as
Qwen3-MoE with `norm_topk_prob`), and the experts module runs every expert at once: the routes
sorted by expert, two grouped matmuls (`torch._grouped_mm` with offsets, as transformers'
default experts implementation), gate/up fused. The experts' weights are 3-D parameters of
`Experts` ([E, 2I, dim] and [E, dim, I]), registered with `qshard.register_experts`, so
`qshard.quantize_` turns them into 3-D quantized tensors and the grouped matmuls run qshard's
grouped kernels; the router is a plain parameter and stays float.

`Experts` is called as transformers' experts modules are, `experts(hidden [T, dim],
top_k_index [T, k], top_k_weights [T, k])`, and carries their marks (`is_transposed`,
`has_bias`, `is_concatenated`), so qshard's expert-parallel styles shard it unchanged:
`qshard.tp.parallelize(model, mesh, EP_PLAN)` (attention tensor-parallel as in `TP_PLAN`,
every layer's experts by `ExpertParallel()`; put `"expert_tensor_parallel"` in its place to cut
each expert instead). An expert id of `num_experts` or more is a route to another rank's experts
(ExpertParallel's sentinel): its rows are not computed and it adds nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..targets import register_experts

__all__ = ["EP_PLAN", "Experts", "MoEFeedForward"]

# The MoE Llama over a 1-D mesh: attention as TP_PLAN's (so every rank holds the same tokens
# after its all-reduce), then each layer's experts whole, E / world per rank, their outputs
# summed by one all-reduce (ExpertParallel's default dispatch).
EP_PLAN = {
    "layers.*.attention.wqkv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.experts": "expert_parallel",
}


@register_experts
class Experts(nn.Module):
    """gate_up_proj [E, 2I, dim] (each expert's gate rows, then its up rows), down_proj
    [E, dim, I]."""

    # transformers' experts marks (`use_experts_implementation`): [E, N, K] weights, no biases,
    # gate and up concatenated; and the sentinel ids of other ranks' experts are skipped.
    is_transposed = False
    has_bias = False
    is_concatenated = True
    skips_sentinel_ids = True

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(experts, dim, hidden))

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden [T, dim], top_k_index [T, k] (ids >= num_experts: skipped), top_k_weights
        [T, k] -> [T, dim], each token's routes weighted and summed."""
        tokens, top_k = top_k_index.shape
        ids = top_k_index.reshape(-1)
        here = ids < self.num_experts
        order = ids.argsort(stable=True)  # the skipped routes sort last, past every offset
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=hidden.device)
        # (scatter_add, not bincount: a size known when compiling)
        counts.scatter_add_(0, ids.masked_fill(~here, 0), here.to(torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)
        rows = hidden[order // top_k]
        gate, up = torch._grouped_mm(rows, self.gate_up_proj.transpose(-2, -1), offs=offs).chunk(
            2, -1
        )
        out = torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs=offs)
        # Rows past the last offset are left unwritten by the grouped matmul: zeroed, not
        # multiplied by their zero weight (which would keep a NaN).
        weights = top_k_weights.reshape(-1)[order, None].to(out.dtype)
        out = torch.where(here[order, None], out * weights, 0)
        combined = torch.empty_like(out)
        combined[order] = out
        # (the size named, not -1: a rank of the all-to-all dispatch may get no rows at all)
        return combined.view(tokens, top_k, out.shape[-1]).sum(1)


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
        return self.experts(tokens, ids, weights).view(b, s, dim)
