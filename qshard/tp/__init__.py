"""Tensor parallelism for quantized models with torch.distributed (DTensor).

qshard.quantize_(model, qshard.Fp8BlockwiseConfig())
qshard.tp.parallelize(model, mesh, {"*.qkv": "colwise", "*.o": "rowwise"})
model = qshard.tp.to_local(model)  # compiled inference: plain local shards, a graph that freezes
model = torch.compile(model, fullgraph=True)

Mixture-of-experts: shard each experts module by expert or along each expert's intermediate dim:
qshard.tp.parallelize(model, mesh, {"model.layers.*.mlp.experts": qshard.tp.ExpertParallel()})
qshard.tp.parallelize(model, mesh, {"model.layers.*.mlp.experts": "expert_tensor_parallel"})
"""

from .experts import ExpertParallel, ExpertParallelError, ExpertTensorParallel, experts_to_local
from .local import LocalLinear, to_local
from .plan import CANDIDATE_TP_SIZES, parallelize, resolve_plan
from .runtime import deadline, init_process_group, shutdown
from .styles import QuantColwiseParallel, QuantRowwiseParallel, chunk_bounds, shard_cuts

__all__ = [
    "CANDIDATE_TP_SIZES",
    "ExpertParallel",
    "ExpertParallelError",
    "ExpertTensorParallel",
    "LocalLinear",
    "QuantColwiseParallel",
    "QuantRowwiseParallel",
    "chunk_bounds",
    "deadline",
    "experts_to_local",
    "init_process_group",
    "parallelize",
    "resolve_plan",
    "shard_cuts",
    "shutdown",
    "to_local",
]
