"""Tensor parallelism for quantized models with torch.distributed (DTensor).

qshard.quantize_(model, qshard.Fp8BlockwiseConfig())
qshard.tp.parallelize(model, mesh, {"*.qkv": "colwise", "*.o": "rowwise"})
model = qshard.tp.to_local(model)  # compiled inference: plain local shards, a graph that freezes
model = torch.compile(model, fullgraph=True)
"""

from .local import LocalLinear, to_local
from .plan import CANDIDATE_TP_SIZES, parallelize, resolve_plan
from .styles import QuantColwiseParallel, QuantRowwiseParallel, chunk_bounds, shard_cuts

__all__ = [
    "CANDIDATE_TP_SIZES",
    "LocalLinear",
    "QuantColwiseParallel",
    "QuantRowwiseParallel",
    "chunk_bounds",
    "parallelize",
    "resolve_plan",
    "shard_cuts",
    "to_local",
]
