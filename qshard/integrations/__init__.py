"""qshard inside other libraries, through their public extension points.

transformers.py   quant_method "qshard": a QuantizationConfigMixin and an HfQuantizer registered
                  with transformers' registration API, so that `save_pretrained` and
                  `from_pretrained` handle qshard models. Imported (and registered) by
                  `import qshard` only once transformers loads its quantizers.

`attach_to_transformers` is the model hook (qshard/hooks.py) that `import qshard` registers:
`quantize_` and `qshard.load` run it on the model they quantized.
"""

from __future__ import annotations

import sys
import warnings

from torch import nn

__all__ = ["attach_to_transformers"]


def attach_to_transformers(model: nn.Module) -> None:
    """If `model` is a transformers model holding qshard weights (quantize_, qshard.load),
    attach qshard's quantizer as from_pretrained would, so that save_pretrained writes qshard's
    format (integrations/transformers.py)."""
    hf = sys.modules.get("transformers.modeling_utils")
    if hf is None or not isinstance(model, hf.PreTrainedModel):
        return
    try:
        # Imported here: it imports transformers, an optional dependency.
        from .transformers import attach
    except ImportError as e:  # an unsupported transformers: the model is quantized anyway
        warnings.warn(f"qshard: save_pretrained will not write this model ({e})", stacklevel=4)
        return
    attach(model)
