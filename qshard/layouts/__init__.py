"""Quantized weight layouts, one per file, each registered with `register_layout`."""

from ..qtensor.registry import config_class_of, layout_for, register_layout, registered_layouts
from .fp8_blockwise import Fp8BlockwiseConfig, Fp8BlockwiseTensor
from .fp8_rowwise import Fp8RowwiseConfig, Fp8RowwiseTensor
from .int4 import Int4Tensor, Int4WeightOnlyConfig
from .mxfp4 import Mxfp4Tensor, MXFP4WeightOnlyConfig
from .nvfp4 import Nvfp4Tensor, NVFP4WeightOnlyConfig

__all__ = [
    "Fp8BlockwiseConfig",
    "Fp8BlockwiseTensor",
    "Fp8RowwiseConfig",
    "Fp8RowwiseTensor",
    "Int4Tensor",
    "Int4WeightOnlyConfig",
    "MXFP4WeightOnlyConfig",
    "Mxfp4Tensor",
    "NVFP4WeightOnlyConfig",
    "Nvfp4Tensor",
    "config_class_of",
    "layout_for",
    "register_layout",
    "registered_layouts",
]
