"""qshard: quantized weight tensors for PyTorch that shard, compile and serialize.

import qshard
report = qshard.quantize_(model, qshard.Fp8BlockwiseConfig())
print(report)
qshard.save(model, "ckpt/")
model = qshard.load("ckpt/", model_built_on_meta)
"""

import importlib
import warnings

from .api import (
    QuantizationReport,
    quantize_,
    register_experts,
    register_handler,
    repack_for_device,
)
from .calibration import gptq_
from .config import Backend, QuantConfig, ScaleFormat, config_from_dict
from .dtensor_cache_key import patch_dtensor_cache_key
from .errors import (
    BackendUnavailableError,
    CheckpointError,
    ConfigError,
    ExpertParallelError,
    InputMismatchError,
    LayoutMismatchError,
    MisalignedSliceError,
    NonFiniteWeightError,
    NotQuantizedError,
    QShardError,
    UnsupportedOpError,
    UnsupportedWeightError,
)
from .formats import export, load_pretrained
from .hooks import register_model_hook
from .import_hooks import after_import
from .integrations import attach_to_transformers
from .io import empty_weights, load, save
from .layouts import (
    Fp8BlockwiseConfig,
    Fp8BlockwiseTensor,
    Fp8RowwiseConfig,
    Fp8RowwiseTensor,
    Int4Tensor,
    Int4WeightOnlyConfig,
    Mxfp4Tensor,
    MXFP4WeightOnlyConfig,
    Nvfp4Tensor,
    NVFP4WeightOnlyConfig,
    register_layout,
    registered_layouts,
)
from .metrics import sqnr_db
from .qtensor import QTensor
from .version import __version__


def _register_with_transformers() -> None:
    try:
        # Imported only now: it imports transformers, an optional dependency.
        from .integrations import transformers  # registers on import  # noqa: F401
    except Exception as e:  # never break transformers' own import
        warnings.warn(f"qshard: not registered with transformers ({e!r})", stacklevel=2)


# DTensors of quantized layouts must not share compiled graphs: fix DTensor's cache key when
# torch.distributed.tensor is imported (not now: it takes a third of a second, and the CLI's
# --help, `import qshard` and single-device use never need it).
after_import("torch.distributed.tensor", patch_dtensor_cache_key)
# quant_method "qshard" in transformers: registered once transformers loads its quantizers
# (from_pretrained and save_pretrained need them), so that `import qshard` never imports it.
after_import("transformers.quantizers.auto", _register_with_transformers)
# After quantize_ / qshard.load: a transformers model gets qshard's quantizer attached.
register_model_hook(attach_to_transformers)


def __getattr__(name: str):
    # `qshard.tp` without `import qshard.tp`: imported on first use (it imports DTensor).
    if name == "tp":
        return importlib.import_module(".tp", __name__)
    raise AttributeError(f"module 'qshard' has no attribute {name!r}")


__all__ = [
    "Backend",
    "BackendUnavailableError",
    "CheckpointError",
    "ConfigError",
    "ExpertParallelError",
    "Fp8BlockwiseConfig",
    "Fp8BlockwiseTensor",
    "Fp8RowwiseConfig",
    "Fp8RowwiseTensor",
    "InputMismatchError",
    "Int4Tensor",
    "Int4WeightOnlyConfig",
    "LayoutMismatchError",
    "MXFP4WeightOnlyConfig",
    "MisalignedSliceError",
    "Mxfp4Tensor",
    "NVFP4WeightOnlyConfig",
    "NonFiniteWeightError",
    "NotQuantizedError",
    "Nvfp4Tensor",
    "QShardError",
    "QTensor",
    "QuantConfig",
    "QuantizationReport",
    "ScaleFormat",
    "UnsupportedOpError",
    "UnsupportedWeightError",
    "__version__",
    "config_from_dict",
    "empty_weights",
    "export",
    "gptq_",
    "load",
    "load_pretrained",
    "quantize_",
    "register_experts",
    "register_handler",
    "register_layout",
    "registered_layouts",
    "repack_for_device",
    "save",
    "sqnr_db",
]
