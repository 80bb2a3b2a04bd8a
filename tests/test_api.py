"""quantize_: what it quantizes, what it skips and why, and that it never half-quantizes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import qshard
from qshard import ConfigError, Fp8BlockwiseConfig, NonFiniteWeightError, QTensor


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 64)
        self.attn = nn.ModuleDict({"qkv": nn.Linear(64, 192), "o": nn.Linear(64, 64)})
        self.mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 10, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        q, _, _ = self.attn["qkv"](h).chunk(3, -1)
        h = h + self.attn["o"](q)
        return self.head(self.norm(h + self.mlp(h)))


LINEARS = ["attn.qkv", "attn.o", "mlp.0", "mlp.2", "head"]
# A fresh random Block's logits (10 tokens of 10 classes) with every linear FP8 blockwise (W8A8)
# against float: measured 22.6 to 33.3 dB over 10,000 draws on the CPU (median 27.9; 1 in 1,000
# under 24.2, each dB lower about 10x rarer), floor 21: the spread of so few logits leaves no
# more room.
FP8_LOGITS_MIN_SQNR_DB = 21.0


def test_quantize_reports_every_linear_and_matches_float():
    model = Block()
    tokens = torch.randint(0, 10, (2, 5))
    expected = model(tokens)
    report = qshard.quantize_(model, Fp8BlockwiseConfig())
    assert [m.name for m in report.quantized] == LINEARS and not report.skipped
    for name in LINEARS:
        weight = model.get_submodule(name).weight
        assert isinstance(weight, qshard.Fp8BlockwiseTensor) and isinstance(weight, QTensor)
        assert isinstance(weight, nn.Parameter) and not weight.requires_grad
    assert report.bytes_after * 3.9 < report.bytes_before  # fp32 -> fp8 plus small scales
    measured = qshard.sqnr_db(expected, model(tokens))
    assert measured >= FP8_LOGITS_MIN_SQNR_DB, f"SQNR {measured:.1f} dB < {FP8_LOGITS_MIN_SQNR_DB}"
    text = str(report)
    assert all(name in text for name in LINEARS) and "5 quantized, 0 skipped" in text


def test_include_exclude_and_filter_fn_are_reported():
    model = Block()
    report = qshard.quantize_(
        model,
        Fp8BlockwiseConfig(),
        include=["attn.*", "mlp.*", "head"],
        exclude="head",
        filter_fn=lambda module, name: name != "mlp.2",
    )
    assert [m.name for m in report.quantized] == ["attn.qkv", "attn.o", "mlp.0"]
    reasons = {s.name: s.reason for s in report.skipped}
    assert reasons == {"mlp.2": "filter_fn returned False", "head": "excluded by pattern 'head'"}
    again = qshard.quantize_(model, Fp8BlockwiseConfig(), include="mlp.*")
    reasons = {s.name: s.reason for s in again.skipped}
    assert reasons["mlp.0"].startswith("already quantized") and "include" in reasons["head"]


def test_weights_the_layout_cannot_take_are_skipped_with_reason():
    model = Block()
    model.head.weight.data = model.head.weight.data.double()
    report = qshard.quantize_(model, Fp8BlockwiseConfig())
    (skipped,) = report.skipped
    assert skipped.name == "head" and "float64" in skipped.reason
    assert model.head.weight.dtype == torch.float64


def test_an_error_leaves_the_model_unchanged():
    model = Block()
    model.mlp[2].weight.data[3, 7] = float("nan")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NonFiniteWeightError, match=r"mlp\.2"):
        qshard.quantize_(model, Fp8BlockwiseConfig())
    for key, value in model.state_dict().items():
        assert not isinstance(value, QTensor)
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, equal_nan=True)


def test_unknown_config_and_custom_handler():
    @dataclasses.dataclass(frozen=True)
    class HalfConfig(qshard.QuantConfig):
        pass

    with pytest.raises(ConfigError, match="register_handler"):
        qshard.quantize_(Block(), HalfConfig())

    calls = []

    @qshard.register_handler(HalfConfig)
    def _handler(weight, config):
        calls.append(tuple(weight.shape))
        return qshard.Fp8BlockwiseTensor.from_float(weight)

    report = qshard.quantize_(Block(), HalfConfig())
    assert len(calls) == len(LINEARS) and len(report.quantized) == len(LINEARS)


def test_a_bare_linear_is_quantized():
    linear = nn.Linear(64, 32)
    report = qshard.quantize_(linear, Fp8BlockwiseConfig())
    assert [m.name for m in report.quantized] == [""]
    assert isinstance(linear.weight, qshard.Fp8BlockwiseTensor)


def test_model_to_dtype_and_device_keep_quantized_weights():
    model = Block()
    qshard.quantize_(model, Fp8BlockwiseConfig())
    model.to(torch.bfloat16)
    weight = model.mlp[0].weight
    assert isinstance(weight, qshard.Fp8BlockwiseTensor) and weight.dtype == torch.bfloat16
    assert isinstance(weight, nn.Parameter)
    with torch.no_grad():  # a live autograd graph would hold the weights and block swapping
        out = model(torch.randint(0, 10, (2, 3)))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    model.to("meta")
    assert model.mlp[0].weight.qdata.is_meta


def test_tied_weights_stay_tied_or_are_skipped_together():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    model[1].weight = model[0].weight
    report = qshard.quantize_(model, Fp8BlockwiseConfig())
    assert model[0].weight is model[1].weight and isinstance(model[1].weight, QTensor)
    assert [(m.name, m.tied_to) for m in report.quantized] == [("0", None), ("1", "0"), ("2", None)]
    assert report.bytes_before == 2 * 64 * 64 * 4  # the shared weight counts once
    assert "tied to 0" in str(report)

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    model[1].weight = model[0].weight
    report = qshard.quantize_(model, Fp8BlockwiseConfig(), exclude="0")
    assert {s.name: s.reason for s in report.skipped}["1"] == "its weight is tied to '0'"
    assert not isinstance(model[1].weight, QTensor)


def test_weight_tied_to_an_embedding_is_skipped():
    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 64)
            self.head = nn.Linear(64, 10, bias=False)
            self.head.weight = self.embed.weight

    model = TiedLM()
    report = qshard.quantize_(model, Fp8BlockwiseConfig())
    (skipped,) = report.skipped
    assert skipped.name == "head" and "embed.weight" in skipped.reason
    assert model.head.weight is model.embed.weight
    assert "weights" not in str(report).splitlines()[-1]  # nothing quantized: no size summary


def test_weights_a_parametrization_or_a_hook_computes_are_skipped_with_reason():
    """weight_norm (a parametrization) and the older spectral_norm (a forward pre-hook) compute
    `weight` from other parameters: quantizing it would assign a value the next forward
    overwrites (or fails to). Skipped, named, and the rest of the model quantized and running."""
    from torch.nn.utils import parametrizations, spectral_norm

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 64),
        parametrizations.weight_norm(nn.Linear(64, 64)),
        spectral_norm(nn.Linear(64, 64)),
        nn.Linear(64, 64),
    )
    report = qshard.quantize_(model, qshard.Int4WeightOnlyConfig(group_size=32))
    assert [m.name for m in report.quantized] == ["0", "3"]
    assert [s.name for s in report.skipped] == ["1", "2"]
    assert all("remove_parametrizations" in s.reason for s in report.skipped)
    assert isinstance(model[0].weight, QTensor) and not isinstance(model[1].weight, QTensor)
    assert torch.isfinite(model(torch.randn(2, 64))).all()


def test_lazy_modules_and_config_classes():
    report = qshard.quantize_(nn.Sequential(nn.LazyLinear(8)), Fp8BlockwiseConfig())
    assert "lazy" in report.skipped[0].reason
    with pytest.raises(ConfigError, match=r"Fp8BlockwiseConfig\(\)"):
        qshard.quantize_(Block(), Fp8BlockwiseConfig)


# ---- one selection rule for quantize_ and `qshard quantize`; patterns that match nothing ------


class HFShaped(nn.Module):
    """Names as transformers gives them: everything under `model.`, the head beside it."""

    def __init__(self):
        super().__init__()
        layer = nn.ModuleDict({"q_proj": nn.Linear(64, 64), "down_proj": nn.Linear(64, 64)})
        self.model = nn.ModuleDict(
            {"embed_tokens": nn.Embedding(10, 64), "layers": nn.ModuleList([layer])}
        )
        self.lm_head = nn.Linear(64, 10, bias=False)


HF_LINEARS = ["model.layers.0.q_proj", "model.layers.0.down_proj"]


def test_output_heads_stay_float_unless_asked_and_the_report_says_so():
    model = HFShaped()
    report = qshard.quantize_(model, Fp8BlockwiseConfig())
    assert [m.name for m in report.quantized] == HF_LINEARS
    (skipped,) = report.skipped
    assert skipped.name == "lm_head" and "kept in float" in skipped.reason
    assert "keep_float=()" in skipped.reason and "'lm_head'" in str(report)
    assert not isinstance(model.lm_head.weight, QTensor)

    # Asked by name through include, or for everything with keep_float=().
    model = HFShaped()
    report = qshard.quantize_(model, Fp8BlockwiseConfig(), include=["lm_head"])
    assert [m.name for m in report.quantized] == ["lm_head"]
    model = HFShaped()
    report = qshard.quantize_(model, Fp8BlockwiseConfig(), keep_float=())
    assert [m.name for m in report.quantized] == [*HF_LINEARS, "lm_head"]
    assert isinstance(model.lm_head.weight, QTensor)


def test_quantize_and_the_command_line_keep_the_same_weights_float(tmp_path):
    from safetensors.torch import save_file

    from qshard.cli.quantize import quantize_directory

    model = HFShaped()
    model.add_module("output", nn.Linear(64, 10))  # gpt-fast's name for the head
    model.model.add_module("pooler", nn.Linear(64, 64))
    source = tmp_path / "model"
    source.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(source / "model.safetensors"))
    done = quantize_directory(source, tmp_path / "q", "fp8-block", progress=False)
    report = qshard.quantize_(model, Fp8BlockwiseConfig())
    assert {n.removesuffix(".weight") for n in done["quantized"]} == set(HF_LINEARS)
    assert [m.name for m in report.quantized] == HF_LINEARS
    assert report.skipped_names() == {"lm_head", "output", "model.pooler"}


@pytest.mark.parametrize("kind", ["include", "exclude"])
def test_a_pattern_that_matches_nothing_names_real_modules_and_changes_nothing(kind):
    model = HFShaped()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError) as info:
        qshard.quantize_(model, Fp8BlockwiseConfig(), **{kind: ["layers.*.q_proj"]})
    message = str(info.value)
    assert f"{kind} pattern 'layers.*.q_proj' matches no weight" in message
    assert "model.layers.0.q_proj" in message  # a real name, HF's `model.` prefix shown
    assert "did you mean '*layers.*.q_proj'?" in message and "Nothing was changed" in message
    after = model.state_dict()
    assert all(
        type(after[k]) is torch.Tensor and torch.equal(after[k], v) for k, v in before.items()
    )

    # One good and one mistyped pattern: still refused, naming the bad one.
    with pytest.raises(ConfigError, match=r"'\*dwon_proj'"):
        qshard.quantize_(model, Fp8BlockwiseConfig(), exclude=["*q_proj", "*dwon_proj"])
    assert not any(isinstance(p, QTensor) for p in model.parameters())


def test_gptq_and_the_command_line_refuse_a_pattern_that_matches_nothing(tmp_path, capsys):
    from safetensors.torch import save_file

    model = HFShaped()
    with pytest.raises(ConfigError, match="gptq_: include pattern 'q_proj'"):
        qshard.gptq_(model, qshard.Int4WeightOnlyConfig(), [torch.randn(4, 64)], include="q_proj")

    source, out = tmp_path / "model", tmp_path / "q"
    source.mkdir()
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(source / "model.safetensors"),
    )
    from qshard_cli import main

    args = ["quantize", str(source), "--config", "fp8-block", "--out", str(out)]
    assert main([*args, "--exclude", "*.mlp.*"]) == 1
    err = capsys.readouterr().err
    assert "--exclude pattern '*.mlp.*' matches no weight" in err and "model.layers.0" in err
    assert not out.exists()


def test_export_refuses_a_model_with_nothing_quantized(tmp_path):
    model = HFShaped()
    with pytest.raises(qshard.NotQuantizedError, match="no quantized weight") as info:
        qshard.export(model, tmp_path / "out", format="compressed-tensors")
    assert "qshard.quantize_" in str(info.value)
    assert not (tmp_path / "out").exists()


def test_the_keep_float_rule_catches_heads_not_projections_named_like_them():
    """Output heads are kept by whole name (lm_head, top-level output), not as substrings: a
    diffusers-style `norm1.linear`, a `layernorm_proj` or an `lm_head_proj` are quantized."""
    model = nn.Module()
    for name in ("lm_head", "output", "layernorm_proj", "lm_head_proj", "x_embedder"):
        model.add_module(name, nn.Linear(64, 64))
    model.norm1 = nn.Module()
    model.norm1.linear = nn.Linear(64, 64)
    report = qshard.quantize_(model, qshard.Int4WeightOnlyConfig(group_size=32))
    kept = {s.name for s in report.skipped}
    assert kept == {"lm_head", "output", "x_embedder"}, report
    assert isinstance(model.norm1.linear.weight, qshard.QTensor)
