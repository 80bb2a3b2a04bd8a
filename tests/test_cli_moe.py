"""`qshard quantize` on a transformers MoE directory (a tiny Qwen3-MoE saved by
`save_pretrained`, which writes one tensor per expert): run as a user runs it, in a subprocess;
the result loads with `from_pretrained` and `qshard.load`, bit for bit what `from_pretrained`
+ `quantize_` give, experts fused into the model's 3-D weights, routers float."""

from __future__ import annotations

import subprocess
import sys

import moe_models
import pytest
import torch
from helpers import assert_same_qtensor

import qshard

CONFIGS = {"fp8-block": qshard.Fp8BlockwiseConfig(), "int4-g64": qshard.Int4WeightOnlyConfig(64)}


# (model, config): every family whose save_pretrained writes one tensor per expert
CASES = [
    ("qwen3_moe", "fp8-block"),
    ("qwen3_moe", "int4-g64"),
    ("mixtral", "fp8-block"),
    ("deepseek_v3", "int4-g64"),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{model name: the directory its save_pretrained wrote}, made once each."""
    made = {}

    def directory(name: str):
        if name not in made:
            made[name] = tmp_path_factory.mktemp(name)
            getattr(moe_models, name)().save_pretrained(made[name])
        return made[name]

    return directory


def _quantize(source, out, config: str) -> str:
    command = [
        sys.executable,
        "-m",
        "qshard",
        "quantize",
        str(source),
        "--config",
        config,
        "--out",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize(("model", "config"), CASES)
def test_quantize_a_moe_directory_equals_from_pretrained_and_quantize(
    saved, tmp_path, model, config
):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    moe_dir = saved(model)
    stored = list(safe_open(str(moe_dir / "model.safetensors"), "pt").keys())
    assert any(".experts.0." in key for key in stored), stored  # one tensor per expert
    out = tmp_path / "q"
    printed = _quantize(moe_dir, out, config)
    assert "as quantize_ selects on " in printed, printed
    expected = AutoModelForCausalLM.from_pretrained(moe_dir)
    report = qshard.quantize_(expected, CONFIGS[config])
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for name, param in expected.named_parameters():
        got = loaded.get_parameter(name)
        if isinstance(param, qshard.QTensor):
            assert_same_qtensor(got, param)
        else:
            assert not isinstance(got, qshard.QTensor) and torch.equal(got, param), name
    layer = loaded.model.layers[-1]  # (DeepSeek-V3's first layers are dense)
    experts = layer.mlp.experts
    assert isinstance(experts.gate_up_proj, qshard.QTensor) and experts.gate_up_proj.dim() == 3
    assert not isinstance(layer.mlp.gate.weight, qshard.QTensor)  # the router
    quantized = {q.name for q in report.quantized}
    assert f"model.layers.{len(loaded.model.layers) - 1}.mlp.experts.gate_up_proj" in quantized
    ids = torch.randint(0, moe_models.VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected(ids).logits)
    # qshard's own loader reads the same directory into a model built from its config.
    with qshard.empty_weights():
        fresh = AutoModelForCausalLM.from_config(expected.config)
    again = qshard.load(out, fresh)
    for name, param in loaded.named_parameters():
        if isinstance(param, qshard.QTensor):
            assert_same_qtensor(again.get_parameter(name), param)


def test_inspect_of_the_float_directory_points_to_quantize_and_reads_the_result(saved, tmp_path):
    moe_dir = saved("qwen3_moe")
    command = [sys.executable, "-m", "qshard", "inspect", str(moe_dir)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "is a float model" in done.stderr and f"qshard quantize {moe_dir}" in done.stderr
    _quantize(moe_dir, tmp_path / "q", "fp8-block")
    command = [sys.executable, "-m", "qshard", "inspect", str(tmp_path / "q")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| model.layers.0.mlp.experts.gate_up_proj | Fp8BlockwiseTensor | [8, 64, 64] |" in (
        done.stdout
    ), done.stdout[:3000]


BAD_MOE = {
    "missing": (
        lambda t: t.pop("model.layers.0.mlp.experts.3.up_proj.weight"),
        r"experts \[3\] have no up_proj.weight",
    ),
    "nan": (
        lambda t: (
            t["model.layers.1.mlp.experts.2.down_proj.weight"].view(-1)[0].fill_(float("nan"))
        ),
        r"model.layers.1.mlp.experts.2.down_proj.weight: .*NaN",
    ),
    "twice": (
        lambda t: t.update(
            {
                "model.layers.0.mlp.experts.01.gate_proj.weight": t[
                    "model.layers.0.mlp.experts.1.gate_proj.weight"
                ].clone()
            }
        ),
        r"both name expert 1",
    ),
}


@pytest.mark.parametrize("case", list(BAD_MOE))
def test_a_bad_moe_directory_is_refused_and_nothing_is_written(saved, tmp_path, capsys, case):
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    from qshard_cli import main

    change, message = BAD_MOE[case]
    directory = tmp_path / "bad"
    shutil.copytree(saved("qwen3_moe"), directory)
    tensors = load_file(str(directory / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"))
    out = tmp_path / "q"
    assert main(["quantize", str(directory), "--config", "fp8-block", "--out", str(out)]) == 1
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()


def test_keys_that_are_not_the_models_names_fall_back_to_name_and_shape(saved, tmp_path, capsys):
    """A checkpoint of the base model (no `model.` prefix) under a config naming the causal LM:
    quantize_'s selection finds none of its keys, so the command says so and quantizes by name
    and shape instead of writing a checkpoint with nothing quantized."""
    import shutil

    from safetensors.torch import load_file, save_file

    from qshard_cli import main

    directory = tmp_path / "base"
    shutil.copytree(saved("qwen3_moe"), directory)
    tensors = load_file(str(directory / "model.safetensors"))
    save_file(
        {k.removeprefix("model."): v for k, v in tensors.items()},
        str(directory / "model.safetensors"),
    )
    out = tmp_path / "q"
    assert main(["quantize", str(directory), "--config", "fp8-block", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "by name and shape (the checkpoint has no 'model.layers.0.self_attn.q_proj'" in printed
    assert isinstance(qshard.load(out)["layers.0.self_attn.q_proj.weight"], qshard.QTensor)
