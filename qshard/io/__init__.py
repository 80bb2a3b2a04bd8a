"""Saving and loading quantized models as safetensors (see `format.py` for the file layout).

qshard.save(model, "ckpt/")                                  # any model, TP-sharded ones too
model = qshard.load("ckpt/", meta_model)                     # no float weights allocated
model = qshard.load("ckpt/", meta_model, mesh=mesh, plan=plan)  # each rank reads its slices
"""

from .checkpoint import INDEX_NAME, SINGLE_FILE_NAME, Checkpoint
from .format import FORMAT_VERSION
from .loading import empty_weights, load
from .saving import DEFAULT_MAX_SHARD_SIZE, QUANTIZATION_CONFIG_NAME, parse_size, save

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "FORMAT_VERSION",
    "INDEX_NAME",
    "QUANTIZATION_CONFIG_NAME",
    "SINGLE_FILE_NAME",
    "Checkpoint",
    "empty_weights",
    "load",
    "parse_size",
    "save",
]
