"""Malformed and mismatched checkpoints of other producers (issue 21): every one is a
CheckpointError that names the file, the field or tensor, the value and the rule, never a raw
AttributeError / TypeError / KeyError / ZeroDivisionError / JSONDecodeError, and never a layout
the layout itself refuses or tensors reinterpreted byte by byte."""

from __future__ import annotations

import json
import re

import pytest
import torch
from test_pretrained_formats import (
    compressed_int4_checkpoint,
    deepseek_checkpoint,
    float8_entry,
    random_bytes,
    random_e4m3,
    torchao_checkpoint,
    write_checkpoint,
)

import qshard
from qshard import CheckpointError


def edit_config(directory, change) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


def refused(directory, *fragments: str) -> str:
    """load_pretrained's CheckpointError, whose message (the directory written DIR, since
    pytest names it after the test) holds every fragment."""
    with pytest.raises(CheckpointError) as info:
        qshard.load_pretrained(directory)
    message = str(info.value).replace(str(directory), "DIR")
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# ---- quantization_config itself -----------------------------------------------------------


@pytest.mark.parametrize("value", ["abc", 5, [1, 2], True])
def test_a_quantization_config_that_is_not_an_object_is_a_checkpoint_error(tmp_path, value):
    deepseek_checkpoint(tmp_path)
    edit_config(tmp_path, lambda c: c.update(quantization_config=value))
    with pytest.raises(CheckpointError, match=r"quantization_config is .* it must be a JSON obj"):
        qshard.formats.detect_format(tmp_path)
    # Format detection sees the parsed config.json, not its directory.
    refused(tmp_path, "config.json: quantization_config", repr(value))


# ---- DeepSeek block FP8 -----------------------------------------------------------------------

DEEPSEEK_FIELDS = [
    ("weight_block_size", "abc"),
    ("weight_block_size", [0, 0]),
    ("weight_block_size", [16]),
    ("weight_block_size", [16.5, 16]),
    ("weight_block_size", [2**100, 128]),
    ("weight_block_size", None),
    ("fmt", 5),
    ("fmt", "e5m2"),
    ("activation_scheme", ["dynamic"]),
    ("scale_fmt", {}),
]


@pytest.mark.parametrize(
    ("field", "value"), DEEPSEEK_FIELDS, ids=[f"{f}={v!r}" for f, v in DEEPSEEK_FIELDS]
)
def test_deepseek_config_fields_are_checked(tmp_path, field, value):
    deepseek_checkpoint(tmp_path)
    edit_config(tmp_path, lambda c: c["quantization_config"].update({field: value}))
    shown = "is missing" if value is None else repr(value)
    refused(tmp_path, "DIR/config.json", f"quantization_config.{field}", shown)


# ---- compressed-tensors -----------------------------------------------------------------------


def set_path(config: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    node = config["quantization_config"]
    for name in parents:
        node = node[name]
    node[last] = value


CT_FIELDS = [
    ("config_groups", [{"weights": {}}], "config_groups"),
    ("config_groups.group_0", "x", "config_groups.group_0"),
    ("config_groups.group_0.weights", [4], "config_groups.group_0.weights"),
    ("config_groups.group_0.weights.group_size", 0, "weights.group_size"),
    ("config_groups.group_0.weights.group_size", "abc", "weights.group_size"),
    ("config_groups.group_0.weights.group_size", -5, "weights.group_size"),
    ("config_groups.group_0.weights.num_bits", "4", "weights.num_bits"),
    ("config_groups.group_0.weights.num_bits", 0, "weights.num_bits"),
    ("config_groups.group_0.weights.strategy", "rows", "weights.strategy"),
    ("config_groups.group_0.weights.type", 5, "weights.type"),
    ("config_groups.group_0.weights.symmetric", "yes", "weights.symmetric"),
    ("config_groups.group_0.targets", "Linear", "group_0.targets"),
    ("config_groups.group_0.targets", ["re:(fc"], "group_0.targets"),
    ("config_groups.group_0.format", 7, "group_0.format"),
    ("format", ["pack-quantized"], "quantization_config.format"),
]


@pytest.mark.parametrize(
    ("path", "value", "named"), CT_FIELDS, ids=[f"{p}={v!r}" for p, v, _ in CT_FIELDS]
)
def test_compressed_tensors_config_fields_are_checked(tmp_path, path, value, named):
    compressed_int4_checkpoint(tmp_path, symmetric=False)
    edit_config(tmp_path, lambda c: set_path(c, path, value))
    refused(tmp_path, "DIR/config.json", named, repr(value))


# ---- ModelOpt ---------------------------------------------------------------------------------


def modelopt_checkpoint(directory, quantization, config=None):
    n, k = 32, 64
    tensors = {
        "fc.weight": random_bytes(n, k // 2, seed=3),
        "fc.weight_scale": random_e4m3(n, k // 16, seed=4),
        "fc.weight_scale_2": torch.tensor(2e-4),
    }
    hf_quant = {"producer": {"name": "modelopt"}, "quantization": quantization}
    return write_checkpoint(directory, tensors, config or {}, hf_quant)


def test_modelopt_config_fields_are_checked(tmp_path):
    modelopt_checkpoint(tmp_path / "a", ["NVFP4"])
    refused(tmp_path / "a", "hf_quant_config.json: quantization is ['NVFP4']")
    modelopt_checkpoint(tmp_path / "b", {"quant_algo": "NVFP4", "group_size": "16"})
    refused(tmp_path / "b", "DIR/hf_quant_config.json", "quantization.group_size", "'16'")
    modelopt_checkpoint(tmp_path / "c", {"quant_algo": "NVFP4", "group_size": 32})
    refused(tmp_path / "c", "quantization.group_size", "32", "16")


# ---- torchao ----------------------------------------------------------------------------------


def torchao_float8(directory, entries: dict | None = None, metadata: dict | None = None):
    """A torchao checkpoint with one 256 x 384 128x128-block Float8Tensor, its entries or raw
    metadata strings replaced as given."""
    tensors = {"0._weight_qdata": random_e4m3(256, 384), "0._weight_scale": torch.ones(2, 3)}
    torchao_checkpoint(directory, entries or {"0.weight": float8_entry([128, 128])}, tensors)
    if metadata is not None:
        from safetensors.torch import load_file, save_file

        stored = load_file(directory / "model.safetensors")
        save_file(stored, str(directory / "model.safetensors"), metadata=metadata)
    return directory


def float8_with(**data):
    entry = float8_entry([128, 128])
    entry["_data"].update(data)
    return {"0.weight": entry}


TORCHAO_METADATA = [
    ({"tensor_names": "[abc"}, "tensor_names"),
    ({"tensor_names": '{"a": 1}'}, "tensor_names"),
    ({"tensor_names": "[1, 2]"}, "tensor_names"),
    ({"tensor_names": '["0.weight"]'}, "no entry for '0.weight'"),
    ({"tensor_names": '["0.weight"]', "0.weight": "{oops"}, "'0.weight'"),
    ({"tensor_names": '["0.weight"]', "0.weight": "[1]"}, "'0.weight'"),
    ({"tensor_names": '["0.weight"]', "0.weight": '{"_type": 5}'}, "_type"),
    (
        {"tensor_names": '["0.weight"]', "0.weight": '{"_type": "Float8Tensor", "_data": "x"}'},
        "_data",
    ),
    ({"tensor_names": '["0.weight"]', "0.weight": "[" * 100000}, "nested too deeply"),
]


@pytest.mark.parametrize(
    ("metadata", "named"), TORCHAO_METADATA, ids=[str(i) for i in range(len(TORCHAO_METADATA))]
)
def test_torchao_metadata_is_parsed_with_checks(tmp_path, metadata, named):
    torchao_float8(tmp_path, metadata=metadata)
    refused(tmp_path, "safetensors metadata", named)


@pytest.mark.parametrize("block", ["abc", [1.5, 128], [1], [0, 128], None])
def test_torchao_block_sizes_are_checked(tmp_path, block):
    torchao_float8(tmp_path, entries=float8_with(block_size=block))
    refused(tmp_path, "block_size", "is missing" if block is None else repr(block))


def test_torchao_int4_shape_is_checked(tmp_path):
    entry = {
        "_type": "Int4Tensor",
        "_data": {"block_size": [1, 128], "shape": "256x768"},
        "_tensor_data_names": ["qdata", "scale", "zero_point"],
    }
    tensors = {"0._weight_qdata": torch.zeros(256, 384, dtype=torch.int8)}
    torchao_checkpoint(tmp_path, {"0.weight": entry}, tensors)
    refused(tmp_path, "'0.weight'._data.shape", "'256x768'")


def test_error_messages_give_the_rule_and_a_fix(tmp_path):
    deepseek_checkpoint(tmp_path)
    edit_config(tmp_path, lambda c: c["quantization_config"].update(weight_block_size=[0, 0]))
    message = refused(tmp_path)
    assert re.search(r"must be a list of 2 integers in 1\.\.\d+", message)
    assert "re-export" in message or "fix" in message


# ---- a layout is built only from attributes the layout accepts (problem 10) --------------------


@pytest.mark.parametrize("block", [[1, 1], [100, 100], [16, 24], [2**17, 128]])
def test_deepseek_block_sizes_the_fp8_layout_refuses_are_a_checkpoint_error(tmp_path, block):
    """The layout's own rules (power-of-two sides in 16..65536) run on the config's block size
    before anything is built from it; they used to build Fp8BlockwiseTensors the layout's
    config refuses (and qshard.save then refused to write)."""
    deepseek_checkpoint(tmp_path)
    edit_config(tmp_path, lambda c: c["quantization_config"].update(weight_block_size=block))
    refused(
        tmp_path,
        "DIR/config.json",
        "quantization_config.weight_block_size",
        str(block),
        "power of two",
    )


def test_compressed_tensors_fp8_block_structures_the_layout_refuses_name_the_field(tmp_path):
    weights = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [1, 1]}
    qc = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }
    tensors = {"fc.weight": random_e4m3(20, 30), "fc.weight_scale": torch.ones(20, 30)}
    write_checkpoint(tmp_path, {**tensors}, {"quantization_config": qc})
    refused(tmp_path, "DIR/config.json", "'group_0' weights.block_structure [1, 1]", "power of two")


# ---- every stored tensor's dtype and shape (problem 4) -------------------------------------------


def replace_tensor(directory, key: str, value: torch.Tensor | None) -> None:
    """Rewrite model.safetensors with `key` replaced (or removed, for None)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = directory / "model.safetensors"
    with safe_open(path, "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118
    if value is None:
        del tensors[key]
    else:
        tensors[key] = value.contiguous()
    save_file(tensors, str(path), metadata=metadata)


def ct_nvfp4(directory, n=32, k=64):
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
    qc = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }
    tensors = {
        "fc.weight_packed": random_bytes(n, k // 2, seed=6),
        "fc.weight_scale": random_e4m3(n, k // 16, seed=7),
        "fc.weight_global_scale": torch.tensor([2.9e3]),
    }
    return write_checkpoint(directory, tensors, {"quantization_config": qc})


def ct_fp8(directory, n=48, k=64):
    weights = {"num_bits": 8, "type": "float", "strategy": "channel"}
    acts = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    qc = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}
        },
    }
    tensors = {"fc.weight": random_e4m3(n, k), "fc.weight_scale": torch.rand(n, 1) / 448}
    return write_checkpoint(directory, tensors, {"quantization_config": qc})


def fbgemm(directory, n=48, k=64):
    qc = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}
    tensors = {"fc.weight": random_e4m3(n, k), "fc.weight_scale": torch.rand(n, 1) / 448}
    return write_checkpoint(directory, tensors, {"quantization_config": qc})


def torchao_int4(directory):
    entry = {
        "_type": "Int4Tensor",
        "_data": {"block_size": [1, 128], "shape": [16, 256]},
        "_tensor_data_names": ["qdata", "scale", "zero_point"],
    }
    tensors = {
        "0._weight_qdata": torch.zeros(16, 128, dtype=torch.int8),
        "0._weight_scale": torch.ones(2, 16, dtype=torch.bfloat16),
        "0._weight_zero_point": torch.zeros(2, 16, dtype=torch.bfloat16),
    }
    return torchao_checkpoint(directory, {"0.weight": entry}, tensors)


def ct_int4(directory):
    return compressed_int4_checkpoint(directory, symmetric=False)


def deepseek(directory):
    return deepseek_checkpoint(directory)


def modelopt(directory):
    return modelopt_checkpoint(directory, {"quant_algo": "NVFP4", "group_size": 16})


# (writer, stored key, replacement, what the message names): each replacement is a tensor the
# format does not store there; the old readers reinterpreted most of them byte by byte.
STORED = [
    (ct_int4, "fc.weight_zero_point", lambda t: t.float(), "weight_zero_point is float32"),
    (ct_int4, "fc.weight_zero_point", lambda t: t.long(), "weight_zero_point is int64"),
    (ct_int4, "fc.weight_zero_point", lambda t: t[:, :2], "weight_zero_point is int32[5, 2]"),
    (ct_int4, "fc.weight_packed", lambda t: t.long(), "weight_packed is int64"),
    (ct_int4, "fc.weight_packed", lambda t: t.view(torch.uint8), "weight_packed is uint8"),
    (ct_int4, "fc.weight_scale", lambda t: t.double(), "weight_scale is float64"),
    (ct_int4, "fc.weight_scale", lambda t: t[:, :2], "weight_scale is bfloat16[40, 2]"),
    (ct_int4, "fc.weight_shape", lambda t: t.float(), "weight_shape is float32"),
    (ct_int4, "fc.weight_shape", lambda t: torch.tensor([40, 320, 1]), "weight_shape is int64[3]"),
    (ct_int4, "fc.weight_shape", lambda t: torch.tensor([0, 320]), "weight_shape is [0, 320]"),
    (ct_int4, "fc.weight_shape", lambda t: torch.tensor([40, 2**40]), "weight_shape is [40, 10"),
    (
        ct_int4,
        "fc.weight_shape",
        lambda t: torch.tensor([40, 640]),
        "weight_packed is int32[40, 40]",
    ),
    (ct_nvfp4, "fc.weight_global_scale", lambda t: t.double(), "weight_global_scale is float64"),
    (
        ct_nvfp4,
        "fc.weight_global_scale",
        lambda t: t.repeat(2),
        "weight_global_scale is float32[2]",
    ),
    (ct_nvfp4, "fc.weight_scale", lambda t: t.float(), "weight_scale is float32"),
    (ct_nvfp4, "fc.weight_packed", lambda t: t.view(torch.int8), "weight_packed is int8"),
    (ct_fp8, "fc.weight_scale", lambda t: t.double(), "weight_scale is float64"),
    (ct_fp8, "fc.weight_scale", lambda t: t[:3], "weight_scale is float32[3, 1]"),
    (ct_fp8, "fc.weight", lambda t: t.float(), "weight is float32"),
    (
        deepseek,
        "layers.0.mlp.weight_scale_inv",
        lambda t: t.double(),
        "weight_scale_inv is float64",
    ),
    (
        deepseek,
        "layers.0.mlp.weight_scale_inv",
        lambda t: t.to(torch.float8_e5m2),
        "weight_scale_inv is float8_e5m2",
    ),
    (deepseek, "layers.0.mlp.weight", lambda t: t.to(torch.float8_e5m2), "weight is float8_e5m2"),
    (modelopt, "fc.weight_scale_2", lambda t: t.bfloat16(), "weight_scale_2 is bfloat16"),
    (modelopt, "fc.weight_scale_2", lambda t: t.repeat(2), "weight_scale_2 is float32[2]"),
    (modelopt, "fc.weight_scale", lambda t: t.float(), "weight_scale is float32"),
    (modelopt, "fc.weight", lambda t: t.view(torch.int8), "weight is int8"),
    (fbgemm, "fc.weight_scale", lambda t: t.double(), "weight_scale is float64"),
    (fbgemm, "fc.weight_scale", lambda t: t.repeat(1, 2), "weight_scale is float32[48, 2]"),
    (torchao_int4, "0._weight_qdata", lambda t: t.view(torch.uint8), "qdata is uint8"),
    (torchao_int4, "0._weight_scale", lambda t: t.double(), "scale is float64"),
    (torchao_int4, "0._weight_zero_point", lambda t: t.t(), "zero_point is bfloat16[16, 2]"),
    (torchao_float8, "0._weight_scale", lambda t: t.double(), "scale is float64"),
    (torchao_float8, "0._weight_scale", lambda t: t.bfloat16(), "scale is bfloat16"),
]


@pytest.mark.parametrize(
    ("write", "key", "change", "named"), STORED, ids=[f"{w.__name__}-{n}" for w, _, _, n in STORED]
)
def test_every_stored_tensor_has_the_formats_dtype_and_shape(tmp_path, write, key, change, named):
    write(tmp_path)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        original = f.get_tensor(key)
    replace_tensor(tmp_path, key, change(original))
    message = refused(tmp_path, named)
    assert "the format stores" in message or "it must be" in message, message


def test_a_deepseek_scale_without_its_weight_is_refused(tmp_path):
    deepseek_checkpoint(tmp_path)
    replace_tensor(tmp_path, "layers.0.mlp.weight", None)
    refused(tmp_path, "'layers.0.mlp.weight_scale_inv' has no weight beside it")
