"""transformers' conversion ops for qshard checkpoints (imported on first load: transformers'
core_model_loading is not yet importable while transformers registers its quantizers)."""

from __future__ import annotations

from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.distributed.utils import is_dtensor

from ..errors import QShardError

__all__ = ["QShardDeserialize", "QShardQuantize"]


class QShardDeserialize(ConversionOps):
    """The inner tensors of one quantized parameter (collected by their stored names, e.g.
    "weight\\.qdata" and "weight\\.scale") -> its QTensor Parameter, checked by the quantizer."""

    def __init__(self, hf_quantizer):
        # transformers leaves tensors a quantizer's op reads in their stored dtype (get_new_dtype)
        self.hf_quantizer = hf_quantizer

    def __deepcopy__(self, memo):
        # transformers deep-copies a converter per parameter: share the one quantizer (its
        # records and the failures it raises at the end) instead of copying it each time
        return type(self)(self.hf_quantizer)

    def convert(self, input_dict, source_patterns=None, model=None, full_layer_name=None,
                **kwargs):  # fmt: skip
        quantizer = self.hf_quantizer
        try:
            inner = {}
            for pattern, tensors in input_dict.items():
                tensors = tensors if isinstance(tensors, list) else [tensors]
                name = pattern.rpartition("\\.")[2]
                if len(tensors) != 1 or name in inner:
                    raise quantizer_error(full_layer_name, pattern, len(tensors))
                inner[name] = tensors[0]
            target = model.get_parameter(full_layer_name)  # on meta: the model's dtype
            if is_dtensor(target):
                raise QShardError(
                    f"from_pretrained with a tp_plan: {full_layer_name!r} is sharded by "
                    f"transformers, which cuts a qshard weight's inner tensors as if they were "
                    f"the float weight; load without tp_plan, then qshard.tp.parallelize(model, "
                    f"mesh, plan), or use qshard.load(path, model, mesh=, plan=)"
                )
            dtype = target.dtype
            weight = quantizer.build(full_layer_name, inner, dtype)
        except Exception as e:
            # transformers would log it and raise a RuntimeError after its report; the quantizer
            # raises this typed error itself once loading ends (postprocess_model)
            quantizer.failures.append(e)
            return {}
        return {full_layer_name: nn.Parameter(weight, requires_grad=False)}


class QShardQuantize(ConversionOps):
    """One float weight of a float checkpoint, as read -> its QTensor Parameter (quantized
    while loading: `from_pretrained(float_dir, quantization_config=QShardConfig(config=...))`).
    The float tensor is dropped once quantized, so no whole float model is ever held."""

    def __init__(self, hf_quantizer):
        self.hf_quantizer = hf_quantizer

    def __deepcopy__(self, memo):
        return type(self)(self.hf_quantizer)  # one quantizer for every parameter (see above)

    def convert(self, input_dict, full_layer_name=None, model=None, **kwargs):
        quantizer = self.hf_quantizer
        try:
            (value,) = input_dict.values()
            value = value[0] if isinstance(value, list) else value
            target = model.get_parameter(full_layer_name)  # on meta: the model's dtype
            if is_dtensor(target):
                raise QShardError(
                    f"from_pretrained with a tp_plan and a QShardConfig: {full_layer_name!r} is "
                    f"sharded by transformers; quantizing while loading a sharded model is not "
                    f"supported: load the float model with tp_plan, then qshard.quantize_(model, "
                    f"config), which quantizes each rank's shard"
                )
            weight = quantizer.quantize(full_layer_name, value, target.dtype)
        except Exception as e:
            quantizer.failures.append(e)  # raised, typed, once loading ends (see above)
            return {}
        return {full_layer_name: nn.Parameter(weight, requires_grad=False)}


def quantizer_error(key: str, pattern: str, count: int):
    from ..errors import CheckpointError

    return CheckpointError(
        f"from_pretrained: {count} checkpoint tensors for {key!r} matched {pattern!r}; a qshard "
        f"checkpoint stores each inner tensor of a weight once"
    )
