"""qshard.load_pretrained reads qshard's own checkpoints too, and takes format= (the names of
the README's formats table): detected when left out, checked when given."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_qtensor

import qshard
from qshard.errors import CheckpointError, QShardError


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 64))
    qshard.quantize_(model, qshard.Int4WeightOnlyConfig(group_size=64))
    return model


def _meta() -> torch.nn.Sequential:
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 64))


@pytest.mark.parametrize("format", [None, "qshard"])
def test_a_qshard_checkpoint_loads_through_load_pretrained(tmp_path, format):
    model = _model()
    qshard.save(model, tmp_path / "q")
    state = qshard.load_pretrained(tmp_path / "q", format=format)
    assert_same_qtensor(state["0.weight"], model[0].weight)
    loaded = qshard.load_pretrained(tmp_path / "q", model=_meta(), format=format)
    x = torch.randn(3, 256)
    assert torch.equal(loaded(x), model(x))


def test_an_explicit_format_is_checked_against_the_directory(tmp_path):
    model = _model()
    qshard.export(model, tmp_path / "ct", format="compressed-tensors")
    qshard.save(model, tmp_path / "q")
    state = qshard.load_pretrained(tmp_path / "ct", format="compressed-tensors")
    assert isinstance(state["0.weight"], qshard.Int4Tensor)
    with pytest.raises(
        CheckpointError,
        match=r"format='deepseek-fp8' was asked for.*"
        r"'compressed-tensors'",
    ):
        qshard.load_pretrained(tmp_path / "ct", format="deepseek-fp8")
    with pytest.raises(CheckpointError, match=r"format='compressed-tensors'.*say 'qshard'"):
        qshard.load_pretrained(tmp_path / "q", format="compressed-tensors")
    with pytest.raises(QShardError, match=r"format='gguf' is not one of \[.*'qshard'\]"):
        qshard.load_pretrained(tmp_path / "q", format="gguf")


@pytest.mark.parametrize("format", ["modelopt-nvfp4", "compressed-tensors"])
def test_an_export_never_carries_qshards_own_quantization_config(tmp_path, format):
    """quantize_ gives a transformers model qshard's quantization_config (for save_pretrained);
    an export is the format's checkpoint, and its config.json must not say qshard."""
    import json

    import moe_models

    model = moe_models.qwen3_moe()
    qshard.quantize_(model, qshard.NVFP4WeightOnlyConfig())
    assert model.config.to_dict()["quantization_config"]["quant_method"] == "qshard"
    qshard.export(model, tmp_path / "out", format=format)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config.get("quantization_config", {}).get("quant_method") != "qshard"
    assert qshard.formats.detect_format(tmp_path / "out") == format
