"""qshard.gptq_: GPTQ-calibrated 4-bit weights are ordinary layout tensors whose outputs, on
inputs like the calibration's, are closer to float than round-to-nearest's; bad input is
refused before anything changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qshard
from qshard.layouts.int4 import ZeroPointDomain

CONFIGS = [
    qshard.Int4WeightOnlyConfig(group_size=64),
    qshard.Int4WeightOnlyConfig(group_size=32, symmetric=True),
    qshard.Int4WeightOnlyConfig(group_size=128, zero_point_domain=ZeroPointDomain.FLOAT),
    qshard.MXFP4WeightOnlyConfig(),
    qshard.NVFP4WeightOnlyConfig(),
]


def correlated_inputs(tokens: int, k: int, seed: int) -> torch.Tensor:
    """Inputs with correlated channels and a few large ones, as a transformer's hidden states
    have (what GPTQ uses and round to nearest ignores); the mixing is fixed, the tokens vary."""
    mixing = torch.randn(32, k, generator=torch.Generator().manual_seed(0))
    channel_scale = torch.ones(k)
    channel_scale[:8] = 8.0
    latent = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(seed))
    noise = 0.1 * torch.randn(tokens, k, generator=torch.Generator().manual_seed(seed + 1))
    return (latent @ mixing + noise) * channel_scale


def output_error(layer: nn.Linear, reference: nn.Linear, x: torch.Tensor) -> float:
    with torch.no_grad():
        expected = reference(x)
        return float((layer(x) - expected).norm() / expected.norm())


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{type(c).__name__}-{c}"[:60])
def test_gptq_beats_round_to_nearest_on_held_out_inputs(config):
    torch.manual_seed(0)
    reference = nn.Linear(256, 96, bias=False)
    rtn, gptq = nn.Linear(256, 96, bias=False), nn.Linear(256, 96, bias=False)
    rtn.load_state_dict(reference.state_dict())
    gptq.load_state_dict(reference.state_dict())
    qshard.quantize_(rtn, config)
    calibration = [correlated_inputs(256, 256, seed) for seed in (1, 3)]
    report = qshard.gptq_(gptq, config, calibration)
    assert [q.name for q in report.quantized] == [""]
    assert type(gptq.weight) is type(rtn.weight)  # an ordinary layout tensor
    held_out = correlated_inputs(512, 256, seed=7)
    rtn_error, gptq_error = (
        output_error(rtn, reference, held_out),
        output_error(gptq, reference, held_out),
    )
    assert gptq_error < 0.5 * rtn_error, (rtn_error, gptq_error)


@pytest.mark.parametrize("config", CONFIGS[::2], ids=lambda c: type(c).__name__)
def test_the_calibrated_weight_is_on_its_own_grid_and_saves(config, tmp_path):
    """Quantizing its dequantized values again with its own group parameters gives back its
    codes; it saves and loads as any weight of its layout."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32))
    qshard.gptq_(model, config, [torch.randn(64, 128)], scale_search=False)
    for layer in (model[0], model[2]):
        weight = layer.weight
        params = {
            name: getattr(weight, name) for name in ("scale", "zero") if hasattr(weight, name)
        }
        extra = {"global_scale": weight.global_scale} if hasattr(weight, "global_scale") else {}
        again = type(weight).from_float(weight.dequantize(torch.float32), config, **extra,
                                        group_params=params)  # fmt: skip
        assert torch.equal(again.qdata, weight.qdata)
    x = torch.randn(3, 128)
    expected = model(x)
    qshard.save(model, tmp_path)
    fresh = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32))
    torch.testing.assert_close(qshard.load(tmp_path, fresh)(x), expected)


def test_selection_and_unreached_modules():
    """exclude keeps a module float; a selected module no batch reaches is rounded to nearest,
    with a warning naming it."""
    torch.manual_seed(2)

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused, self.kept = (nn.Linear(64, 64) for _ in range(3))

        def forward(self, x):
            return self.kept(self.used(x))

    model = TwoHeads()
    unused_float = model.unused.weight.detach().clone()
    config = qshard.MXFP4WeightOnlyConfig()
    with pytest.warns(UserWarning, match=r"no calibration input reached \['unused'\]"):
        qshard.gptq_(model, config, [torch.randn(32, 64)], exclude="kept")
    assert isinstance(model.kept.weight, nn.Parameter) and not isinstance(
        model.kept.weight, qshard.QTensor
    )
    rounded = qshard.Mxfp4Tensor.from_float(unused_float, config)
    assert torch.equal(model.unused.weight.qdata, rounded.qdata)
    assert isinstance(model.used.weight, qshard.Mxfp4Tensor)


@pytest.mark.parametrize(
    ("config", "calibration", "damp", "message"),
    [
        (qshard.Fp8BlockwiseConfig(), [torch.randn(4, 256)], 0.1, "4-bit weight-only configs"),
        (qshard.Int4WeightOnlyConfig, [torch.randn(4, 256)], 0.1, "not a config"),
        (qshard.Int4WeightOnlyConfig(), [], 0.1, "gave no batch"),
        (qshard.Int4WeightOnlyConfig(), [torch.randn(4, 256)], 0.0, r"damp=0.0 must be in"),
    ],
)
def test_bad_input_is_refused_and_nothing_changes(config, calibration, damp, message):
    model = nn.Linear(256, 64)
    before = model.weight.detach().clone()
    with pytest.raises(qshard.ConfigError, match=message):
        qshard.gptq_(model, config, calibration, damp=damp)
    assert type(model.weight) is nn.Parameter and torch.equal(model.weight, before)


def test_a_non_finite_weight_is_named_and_nothing_changes():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    with torch.no_grad():
        model[1].weight[3, 5] = float("nan")
    first = model[0].weight.detach().clone()
    with pytest.raises(qshard.NonFiniteWeightError, match="gptq_: module '1'"):
        qshard.gptq_(model, qshard.NVFP4WeightOnlyConfig(), [torch.randn(16, 64)])
    assert type(model[0].weight) is nn.Parameter and torch.equal(model[0].weight, first)
