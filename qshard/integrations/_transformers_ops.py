"""transformers' conversion ops for qshard checkpoints (imported on first load: transformers'
core_model_loading is not yet importable while transformers registers its quantizers), and qshard
weights under transformers' own tensor and expert parallelism
(`from_pretrained(path, tp_plan="auto")`, `distributed_config=DistributedConfig(tp_size=...,
ep_size=...)`).

How transformers 5.23 shards a parameter while it loads (file:line of 5.23):

- `preprocess_model` (quantizers/base.py:184) calls the quantizer's `update_parallel_plan` with
  the model's tp_plan and ep_plan; then `maybe_distribute_model` (distributed/mixin.py:304)
  expands the plans to one style per parameter (its own rule, else its module's:
  `_resolve_parallel_plans`, mixin.py:233) and `apply_tensor_parallelism`
  (distributed/tensor_parallel.py:639) / `apply_expert_parallelism` run each style: `shard_param`
  replaces the meta parameter by a meta DTensor on the 1-D "tp" (or "ep") mesh
  (`distribute_tensor(meta, mesh, [placement], src_data_rank=None)`): colwise `Shard(ndim - 2)`,
  rowwise `Shard(-1)`, packed_colwise `_StridedShard(ndim - 2, split_factor=2)`, packed_rowwise
  `_StridedShard(-1, 2)`, grouped_gemm (EP) `Shard(0)`; `install_forward` wraps the module's
  forward (input / output redistribution; rowwise all-reduces its partial output).
- `convert_and_load_state_dict_in_model` (core_model_loading.py:1799) reads every checkpoint
  tensor of a DTensor parameter cut as that placement cuts the parameter
  (`DtensorShardOperation.shard_tensor`, distributed/sharding_utils.py:103); the conversion op
  returns this rank's *local* tensor, which `set_param_for_module` (core_model_loading.py:1465)
  wraps as the meta parameter is placed (`_dtensor_from_local_like`: `DTensor.from_local(local,
  mesh, placements, shape=, stride=)`) after checking its shape against the meta local shard.

A qshard weight's inner tensors are not the weight (an FP8 scale [N/128, K/128] cut as if it were
[N, K] is wrong), and a cut tensor cannot be checked against its checksum. So for a sharded
parameter `QShardDeserialize` reads the inner tensors whole (`QShardHfQuantizer.read_whole`),
builds and checks the QTensor exactly as without a plan, and cuts this rank's part with qshard's
own slicing (`local_part`): the ranges transformers cuts the float weight into, after
`QTensor.realign` with every rank's boundaries (so that every rank holds the same packing; FP8
re-blocks a cut inside a block, a layout that cannot raises MisalignedSliceError). The module
runs its local shard (`_hf_quantized_needs_local_tp`, as transformers' torchao and FP8 modules),
under transformers' own hooks.

Styles (`SHARDED_STYLES`, `WHOLE_STYLES`) are checked before anything loads
(`check_parallel_plans`, called by the quantizer's `update_parallel_plan`); any other style of a
quantized weight, an FSDP plan, or quantizing while loading a sharded model is a QShardError that
names the parameter, the style and what to do instead.
"""

from __future__ import annotations

import logging

import torch
import transformers
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.distributed.utils import is_dtensor

from ..errors import CheckpointError, MisalignedSliceError, QShardError
from ..qtensor import QTensor
from ..shards import chunk_bounds

__all__ = [
    "SHARDED_STYLES",
    "WHOLE_STYLES",
    "QShardDeserialize",
    "QShardQuantize",
    "check_parallel_plans",
    "local_part",
    "rank_ranges",
]

# transformers' styles whose placement qshard cuts a quantized weight by (any Shard or
# _StridedShard of a 1-D mesh); their forward hooks run on the local QTensor.
SHARDED_STYLES = frozenset(
    {
        "colwise",
        "colwise_gather_output",
        "colwise_rep",
        "rowwise",
        "rowwise_split_input",
        "rowwise_rep",
        "packed_colwise",  # fused [gate; up] rows (2-D) or experts [E, 2I, H]
        "packed_rowwise",  # experts [E, H, 2I] (Llama4, Aria)
        "grouped_gemm",  # expert parallelism: whole experts per rank
    }
)
# Styles that leave a parameter whole (shard_param is a no-op; the hooks are the module's).
WHOLE_STYLES = frozenset(
    {
        "replicate",
        "moe_tp_experts",
        "moe_identity_expert",
        "ep_dispatch_experts",
        "local_params",
        "all_reduce",
        "mla_kv_a_proj",
        "replicated_with_grad_allreduce",
    }
)

_INSTEAD = (
    "load it without a tp_plan and shard it with qshard.tp.parallelize(model, mesh, plan), or "
    "with qshard.load(path, model, mesh=, plan=)"
)


# ---- the plan, before anything loads ---------------------------------------------------------


def check_parallel_plans(quantizer, model) -> None:
    """QShardError, before any weight is read, for a distributed from_pretrained that would
    shard a quantized weight in a way qshard does not: a style outside SHARDED_STYLES and
    WHOLE_STYLES, FSDP, or a float weight quantized while loading. Keeps {parameter: style} of
    the quantized weights on the quantizer (`parallel_styles`) for the messages of the cuts."""
    if hasattr(quantizer, "parallel_styles"):  # transformers calls it for tp_plan and ep_plan
        return
    quantizer.parallel_styles = {}
    config = getattr(model.config, "distributed_config", None)
    if config is None or (config.tp_size <= 1 and config.ep_size <= 1 and config.dp_size <= 1):
        return
    names = set(quantizer.records) | set(getattr(quantizer, "selected", {}))
    if not names:
        return
    if config.dp_size > 1:
        raise QShardError(
            f"from_pretrained with a distributed_config of fsdp_size {config.fsdp_size} and "
            f"dp_replicate_size {config.dp_replicate_size}: FSDP all-gathers parameters through "
            f"collectives, which a qshard weight (e.g. {sorted(names)[0]!r}) cannot go through; "
            f"use tensor parallelism only (tp_size), or {_INSTEAD}"
        )
    tp_plan, ep_plan = _resolved_plans(model, config)
    styles = {n: ep_plan.get(n, tp_plan.get(n)) for n in sorted(names)}
    styles = {n: s for n, s in styles.items() if s is not None}
    quantizer.parallel_styles = styles
    for name, style in styles.items():
        if not quantizer.pre_quantized and style not in WHOLE_STYLES:
            raise QShardError(_quantize_while_sharding(name))
        if style not in SHARDED_STYLES | WHOLE_STYLES:
            raise QShardError(
                f"from_pretrained with a tp_plan: {name!r} is a qshard weight and its plan style "
                f"is {style!r}, which qshard does not apply to quantized weights (it shards them "
                f"with {sorted(SHARDED_STYLES)}); give it one of those styles in "
                f"DistributedConfig(tp_plan={{...}}), or {_INSTEAD}"
            )


def _resolved_plans(model, config) -> tuple[dict[str, str], dict[str, str]]:
    """{parameter or module name: style} of the tp_plan and ep_plan transformers is about to
    apply (its own resolution, mixin.py:233: overrides merged, EP rules first, `*` expanded),
    without its warnings about rules that match nothing (it gives them itself right after)."""

    logger = logging.getLogger("transformers.distributed.mixin")
    disabled, logger.disabled = logger.disabled, True
    try:
        tp_plan, ep_plan, _ = model._resolve_parallel_plans(config)
    finally:
        logger.disabled = disabled
    return tp_plan, ep_plan


def _quantize_while_sharding(name: str) -> str:
    return (
        f"from_pretrained with a tp_plan and a QShardConfig: {name!r} is sharded by "
        f"transformers; quantizing while loading a sharded model is not supported: load the "
        f"float model with tp_plan, then qshard.quantize_(model, config), which quantizes each "
        f"rank's shard"
    )


# ---- this rank's part of a weight ------------------------------------------------------------


def rank_ranges(size: int, placement, world: int, rank: int) -> list[tuple[int, int]]:
    """[start, end) ranges of a dim of `size` that `rank` holds, in order, as transformers cuts
    a checkpoint tensor (sharding_utils.py:139, 204): `Shard` a torch.chunk piece; `_StridedShard(d,
    split_factor=s)` the dim split in s groups of ceil(size / s), a chunk of each."""
    # Deferred: DTensor's import takes a third of a second; only tp_plan loads need it.
    from torch.distributed.tensor.placement_types import _StridedShard

    groups = placement.split_factor if isinstance(placement, _StridedShard) else 1
    width = -(-size // groups) if size else 0
    ranges = []
    for g in range(groups):
        first, last = min(g * width, size), min((g + 1) * width, size)
        start, end = chunk_bounds(last - first, world, rank)
        if end > start:
            ranges.append((first + start, first + end))
    return ranges


def local_part(weight: QTensor, target, key: str, style: str | None, record=None) -> QTensor:
    """This rank's part of `weight` (the whole QTensor of parameter `key`) for `target`, the
    meta DTensor transformers placed the parameter as: the same rows / columns / experts as
    transformers cuts the float weight, in qshard's layout (a copy in storage of its own)."""
    from torch.distributed.tensor import Replicate, Shard  # deferred, as above

    # Deferred: DTensor's import takes a third of a second; only tp_plan loads need it.
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh, placements = target.device_mesh, tuple(target.placements)
    where = f"from_pretrained with a tp_plan: {key!r} (style {style!r}, placed {placements})"
    if mesh.ndim != 1 or len(placements) != 1:
        raise QShardError(
            f"{where} is placed on a {mesh.ndim}-D mesh; qshard cuts quantized "
            f"weights over one mesh dimension: {_INSTEAD}"
        )
    (placement,) = placements
    if isinstance(placement, Replicate):
        return weight
    if not isinstance(placement, Shard | _StridedShard):
        raise QShardError(
            f"{where}: qshard cuts quantized weights by Shard and _StridedShard "
            f"placements, not {placement}; {_INSTEAD}"
        )
    world, rank = mesh.size(), mesh.get_local_rank()
    dim = placement.dim % weight.dim()
    realigned = _realigned(weight, dim, placement, world, where, record)
    ranges = rank_ranges(weight.shape[dim], placement, world, rank) or [(0, 0)]
    parts = [realigned.narrow(dim, a, b - a) for a, b in ranges]
    local = torch.cat(parts, dim) if len(parts) > 1 else parts[0].clone()
    expected = tuple(target.to_local().shape)
    if tuple(local.shape) != expected:  # transformers would report it mismatched and re-init it
        raise QShardError(
            f"{where}: qshard's part of rank {rank} is {list(local.shape)}, transformers expects "
            f"{list(expected)}; {_INSTEAD}"
        )
    return local


def _cuts(size: int, placement, world: int) -> list[int]:
    bounds = {
        o for r in range(world) for a, b in rank_ranges(size, placement, world, r) for o in (a, b)
    }
    return sorted(bounds - {0, size})


def _realigned(weight: QTensor, dim: int, placement, world: int, where: str, record) -> QTensor:
    """`weight` re-packed for every rank's cuts of outer `dim`, or a MisalignedSliceError that
    names the tensor-parallel sizes that would work."""
    from ..tp.plan import CANDIDATE_TP_SIZES  # imports torch.distributed.tensor: on use only

    logical = weight.logical_dim(dim)
    try:
        return weight.realign(logical, _cuts(weight.shape[dim], placement, world))
    except MisalignedSliceError as e:
        probe = record.meta() if record is not None else weight  # no data: cheap to re-align

        def fits(size: int) -> bool:
            try:
                probe.realign(logical, _cuts(weight.shape[dim], placement, size))
            except MisalignedSliceError:
                return False
            return True

        working = [size for size in CANDIDATE_TP_SIZES if fits(size)]
        raise MisalignedSliceError(
            f"{where} on {world} ranks cuts quantized blocks: {e}. Tensor-parallel sizes that "
            f"work for this weight: {working}; or re-quantize it with smaller blocks"
        ) from e


# ---- conversion ops --------------------------------------------------------------------------


class QShardDeserialize(ConversionOps):
    """The inner tensors of one quantized parameter (collected by their stored names, e.g.
    "weight\\.qdata" and "weight\\.scale") -> its QTensor Parameter, checked by the quantizer;
    for a parameter transformers shards, this rank's part of it (see the module docstring)."""

    def __init__(self, hf_quantizer):
        # transformers leaves tensors a quantizer's op reads in their stored dtype (get_new_dtype)
        self.hf_quantizer = hf_quantizer

    def __deepcopy__(self, memo):
        # transformers deep-copies a converter per parameter: share the one quantizer (its
        # records and the failures it raises at the end) instead of copying it each time
        return type(self)(self.hf_quantizer)

    def convert(self, input_dict, source_patterns=None, model=None, full_layer_name=None, **kwargs):
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
            if not is_dtensor(target):
                weight = quantizer.build(full_layer_name, inner, target.dtype)
                return {full_layer_name: nn.Parameter(weight, requires_grad=False)}
            if not hasattr(quantizer, "parallel_styles"):  # no update_parallel_plan call
                raise QShardError(
                    f"from_pretrained with a tp_plan: {full_layer_name!r} is sharded by "
                    f"transformers {transformers.__version__}, which did not show qshard its "
                    f"plan before loading (HfQuantizer.update_parallel_plan), so qshard cannot "
                    f"check the style; upgrade transformers, or {_INSTEAD}"
                )
            # transformers read each inner tensor cut as if it were the weight: read them whole
            device = next(iter(inner.values())).device
            whole = quantizer.build(
                full_layer_name, quantizer.read_whole(full_layer_name), target.dtype
            )
            style = getattr(quantizer, "parallel_styles", {}).get(full_layer_name)
            record = quantizer.records[full_layer_name]
            local = local_part(whole, target, full_layer_name, style, record)
            del whole
            local = local.to(device).repack_for_device()
        except Exception as e:
            # transformers would log it and raise a RuntimeError after its report; the quantizer
            # raises this typed error itself once loading ends (postprocess_model)
            quantizer.failures.append(e)
            return {}
        # set_param_for_module wraps the local tensor as the meta DTensor is placed, with its
        # requires_grad: frozen, as an unsharded qshard weight
        target.requires_grad_(False)
        module = model.get_submodule(full_layer_name.rpartition(".")[0])
        module._hf_quantized_needs_local_tp = True  # transformers' hooks run the local QTensor
        return {full_layer_name: local}


class QShardQuantize(ConversionOps):
    """One float weight of a float checkpoint, as read -> its QTensor Parameter (quantized
    while loading: `from_pretrained(float_dir, quantization_config=QShardConfig(config=...))`).
    The float tensor is dropped once quantized, so no whole float model is ever held."""

    def __init__(self, hf_quantizer):
        self.hf_quantizer = hf_quantizer

    def __deepcopy__(self, memo):
        return type(self)(self.hf_quantizer)  # one quantizer for every parameter (see above)

    def convert(self, input_dict, full_layer_name=None, model=None, **kwargs):
        """{parameter name: tensor} for every parameter transformers' converter made from the
        checkpoint (a split fused qkv gives several): the selected ones quantized, the others
        passed through."""
        quantizer = self.hf_quantizer
        out = {}
        try:
            for key, value in input_dict.items():
                if isinstance(value, list):
                    if len(value) != 1:
                        raise quantizer_error(key, key, len(value))
                    value = value[0]
                if key not in quantizer.selected:
                    out[key] = value
                    continue
                target = model.get_parameter(key)  # on meta: the model's dtype and shape
                if is_dtensor(target):
                    raise QShardError(_quantize_while_sharding(key))
                weight = quantizer.quantize(key, value, target)
                frozen = isinstance(weight, QTensor)  # a float fallback stays trainable
                out[key] = nn.Parameter(weight, requires_grad=not frozen)
        except Exception as e:
            quantizer.failures.append(e)  # raised, typed, once loading ends (see above)
            return {}
        return out


def quantizer_error(key: str, pattern: str, count: int):
    return CheckpointError(
        f"from_pretrained: {count} checkpoint tensors for {key!r} matched {pattern!r}; a qshard "
        f"checkpoint stores each inner tensor of a weight once"
    )
