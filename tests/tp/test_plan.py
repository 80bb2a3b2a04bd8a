"""Plan tables: resolution (torch's per-segment patterns), conversion and validation, all
checked before a model changes. No process group needed."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.placement_types import Replicate, Shard

import qshard
from qshard import QShardError
from qshard.tp import QuantColwiseParallel, QuantRowwiseParallel, resolve_plan
from qshard.tp.plan import _validate


def stack(quantize: bool = True) -> nn.Module:
    layer = lambda: nn.ModuleDict(  # noqa: E731
        {"attn": nn.ModuleDict({"qkv": nn.Linear(256, 768), "o": nn.Linear(256, 256)})}
    )
    model = nn.Module()
    model.layers = nn.ModuleList([layer(), layer()])
    if quantize:
        qshard.quantize_(model, qshard.Fp8BlockwiseConfig())
    return model


def test_a_star_matches_one_dotted_segment_like_torch():
    model = stack()
    plan = {
        "layers.*": PrepareModuleInput(
            input_layouts=Replicate(), desired_input_layouts=Replicate()
        ),
        "layers.*.attn.qkv": "colwise",
        "layers.*.attn.o": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    resolved = resolve_plan(model, plan)
    assert sorted(resolved) == [
        "layers.0",
        "layers.0.attn.o",
        "layers.0.attn.qkv",
        "layers.1",
        "layers.1.attn.o",
        "layers.1.attn.qkv",
    ]
    assert isinstance(resolved["layers.0"], PrepareModuleInput)
    assert type(resolved["layers.1.attn.qkv"]) is QuantColwiseParallel
    rowwise = resolved["layers.0.attn.o"]  # torch's style, converted, its layouts kept
    assert type(rowwise) is QuantRowwiseParallel and rowwise.output_layouts == (Shard(1),)
    assert rowwise.use_local_output is False
    _validate(model, resolved, 2)


def test_plan_mistakes_raise_before_any_change():
    model = stack()
    with pytest.raises(QShardError, match="matched by both"):
        resolve_plan(model, {"layers.*.attn.*": "colwise", "layers.0.attn.o": "rowwise"})
    with pytest.raises(QShardError, match="matches no module"):
        resolve_plan(model, {"layers.*.qkv": "colwise"})
    with pytest.raises(QShardError, match="'colwise', 'rowwise'"):
        resolve_plan(model, {"layers.0.attn.qkv": "column"})
    with pytest.raises(QShardError, match="ModuleDict"):
        _validate(model, resolve_plan(model, {"layers.0.attn": "colwise"}), 2)
    for style in (SequenceParallel(), ColwiseParallel(), RowwiseParallel()):

        class Custom(type(style)):  # a user's subclass would broadcast or scatter the weight
            pass

        custom = Custom.__new__(Custom)
        custom.__dict__.update(style.__dict__)
        with pytest.raises(QShardError, match="collective"):
            _validate(model, resolve_plan(model, {"layers.0.attn.qkv": custom}), 2)


def test_root_style_and_empty_key():
    linear = nn.Linear(64, 128)
    assert list(resolve_plan(linear, "colwise")) == [""]
    assert list(resolve_plan(linear, {"": ColwiseParallel()})) == [""]


def test_working_sizes_are_listed_beyond_powers_of_two():
    model = nn.Sequential(nn.Linear(256, 240))  # 240 rows: TP 3, 5 and 15 cut at 16s
    qshard.quantize_(model, qshard.Fp8BlockwiseConfig())
    with pytest.raises(QShardError) as info:
        _validate(model, resolve_plan(model, {"0": "colwise"}), 2)  # cuts at 120: 8s
    assert "work for this model: [1, 3, 5, 15]" in str(info.value)


def test_dtensors_of_different_quantized_layouts_do_not_share_compiled_graphs(tmp_path):
    """torch keys a DTensor in the AOT autograd cache by its spec alone; qshard adds the local
    QTensor's hash (qshard/dtensor_cache_key.py), or an int4 TP block ran the FP8 block's graph."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = torch.randn(256, 256)
        cases = [
            (qshard.Fp8BlockwiseTensor, qshard.Fp8BlockwiseConfig()),
            (qshard.Fp8BlockwiseTensor, qshard.Fp8BlockwiseConfig(scale_format="ue8m0")),
            (qshard.Int4Tensor, qshard.Int4WeightOnlyConfig()),
        ]
        keys = {
            DTensor.from_local(
                cls.from_float(weight, config), mesh, [Replicate()]
            )._stable_hash_for_caching()
            for cls, config in cases
        }
        assert len(keys) == len(cases)
        # A plain DTensor keeps torch's key, its spec alone: other values of the same spec
        # share it (their graphs are the same), and it is none of the quantized ones'.
        plain = DTensor.from_local(weight, mesh, [Replicate()])._stable_hash_for_caching()
        other = DTensor.from_local(weight + 1, mesh, [Replicate()])._stable_hash_for_caching()
        assert plain == other and plain not in keys
    finally:
        dist.destroy_process_group()
