"""nn.Module conversions of quantized models: `.half()` / `.to(dtype)` change the float dtype a
QTensor stands for (packed data unchanged), also while an output with an autograd graph is
alive; values beyond the new dtype's range and `load_state_dict` into a float model are errors
that say what to do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qshard
from qshard import QTensor

CONFIGS = [qshard.Int4WeightOnlyConfig(group_size=32), qshard.Fp8BlockwiseConfig()]


def _model(config, scale: float = 1.0) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    qshard.quantize_(model, config)
    return model


def _inner(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{name}": getattr(m.weight, name).clone()
        for i, m in enumerate(model)
        if isinstance(m, nn.Linear)
        for name in m.weight.inner_names
    }


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: type(c).__name__)
def test_half_changes_the_dtype_a_weight_stands_for_not_its_data(config):
    model = _model(config)
    packed = _inner(model)
    x = torch.randn(3, 128)
    expected = model(x)
    model.half()
    assert all(type(m.weight) is type(model[0].weight) for m in (model[0], model[2]))
    assert model[0].weight.dtype == model[2].weight.dtype == torch.float16
    after = _inner(model)
    assert all(torch.equal(after[k], v) for k, v in packed.items())  # bit for bit
    out = model(x.half())
    assert out.dtype == torch.float16
    assert qshard.sqnr_db(expected, out.float()) > 40  # only fp16 rounding of the activations


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: type(c).__name__)
def test_half_and_to_work_while_an_output_with_a_graph_is_alive(config):
    model = _model(config)
    x = torch.randn(3, 128, requires_grad=True)
    out = model(x)  # grad enabled: the graph keeps the weights' transposes for backward
    assert out.requires_grad
    model.to(torch.bfloat16)  # torch's _apply swaps each QTensor parameter: no live view of it
    assert model[2].weight.dtype == torch.bfloat16 and isinstance(model[2].weight, QTensor)
    out.sum().backward()  # the old graph still runs, on the float32 weights it saved
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    model.half()
    assert model[0].weight.dtype == torch.float16


_OWN_USES = {
    "x @ w.t()": lambda x, w: x @ w.t(),
    "x @ w.T": lambda x, w: x @ w.T,
    "x @ w.mT": lambda x, w: x @ w.mT,
    "x @ w.transpose(0, 1)": lambda x, w: x @ w.transpose(0, 1),
    "torch.matmul(x, w.swapaxes(0, 1))": lambda x, w: torch.matmul(x, w.swapaxes(0, 1)),
    "a view kept by the user": lambda x, w: w.T,  # under grad mode; under no_grad it keeps
}  # the Parameter alive and torch cannot swap it (docs/transformers.md)


@pytest.mark.parametrize("use", sorted(_OWN_USES))
def test_half_works_after_a_forward_of_its_own_uses_the_weight(use):
    # A custom forward (or the user) multiplies by a view of the weight: neither the graph nor
    # the view may hold the Parameter itself, or torch's _apply cannot swap it.
    model = _model(qshard.Int4WeightOnlyConfig(group_size=32))
    x = torch.randn(3, 128, requires_grad=True)
    kept = _OWN_USES[use](x, model[0].weight)
    model.half()
    assert model[0].weight.dtype == torch.float16 and isinstance(model[0].weight, QTensor)
    if kept.dim() == 2 and kept.shape[0] == 3:  # an output: its graph still runs
        kept.sum().backward()
        assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_a_weight_beyond_float16_is_refused_with_the_cause_and_the_fix():
    model = _model(qshard.Int4WeightOnlyConfig(group_size=32), scale=1e6)  # |w| up to ~1e5
    with pytest.raises(qshard.NonFiniteWeightError) as info:
        model.half()
    message = str(info.value)
    assert "float16" in message and "would become Inf" in message
    assert "bfloat16" in message  # the fix
    model.to(torch.bfloat16)  # bfloat16 has float32's range: fine
    assert model[0].weight.dtype == torch.bfloat16


def test_load_state_dict_into_a_float_model_says_to_use_qshard_load_or_assign():
    state = _model(qshard.Fp8BlockwiseConfig()).state_dict()
    fresh = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    with pytest.raises(RuntimeError) as info:
        fresh.load_state_dict(state)
    message = str(info.value)
    assert "qshard.load(" in message and "assign=True" in message
    assert not isinstance(fresh[0].weight, QTensor)
    fresh.load_state_dict(state, assign=True)  # the fix the message names
    assert isinstance(fresh[0].weight, QTensor)
    assert torch.equal(fresh[0].weight.dequantize(), state["0.weight"].dequantize())


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_half_of_quantized_experts_while_an_output_is_alive(name):
    pytest.importorskip("transformers")
    import moe_models

    model = moe_models.build(name)  # grouped_mm experts; gpt-oss's stored transposed
    report = qshard.quantize_(model, qshard.Int4WeightOnlyConfig(group_size=32))
    assert any(m.name.endswith("experts.gate_up_proj") for m in report.quantized)
    out = model(torch.randint(0, 50, (1, 8))).logits
    assert out.requires_grad  # float parameters (norms, router) keep a graph alive
    # (the same module conversion as .half(), which transformers refuses on quantized models)
    model.to(torch.float16)
    experts = next(m for n, m in model.named_modules() if n.endswith("experts"))
    assert isinstance(experts.gate_up_proj, QTensor)
    assert experts.gate_up_proj.dtype == torch.float16
    out.sum().backward()  # the old graph is intact


def test_a_quantized_weight_that_requires_grad_keeps_its_gradient():
    """The detached alias is for frozen Parameters only: F.linear of a QTensor weight that
    requires grad still records it, also when the input does not (the gradient is the dense
    one, as x @ w.t() gives)."""
    weight = qshard.Int4Tensor.from_float(torch.randn(64, 128), qshard.Int4WeightOnlyConfig())
    weight.requires_grad_(True)
    x = torch.randn(3, 128)
    torch.nn.functional.linear(x, weight).sum().backward()
    assert weight.grad is not None
    torch.testing.assert_close(weight.grad.float(), torch.ones(3, 64).t() @ x)


def test_views_and_matmuls_of_weights_under_inference_mode():
    # Under inference_mode, matmul, .T, .mT, swapaxes and narrow reach the QTensor as
    # themselves (no autograd decomposition), and views must not be inference tensors.
    model = _model(qshard.Int4WeightOnlyConfig(group_size=32))
    w = model[0].weight
    x = torch.randn(2, 3, 128)
    expected = x @ w.dequantize().t()
    uses = {
        "x @ w.t()": lambda: x @ w.t(),
        "x @ w.T": lambda: x @ w.T,
        "x @ w.mT": lambda: x @ w.mT,
        "matmul(x, w.swapaxes(0, 1))": lambda: torch.matmul(x, w.swapaxes(0, 1)),
        "F.linear": lambda: torch.nn.functional.linear(x, w),
    }
    with torch.inference_mode():
        for name, use in uses.items():
            torch.testing.assert_close(use(), expected, rtol=1e-5, atol=1e-5, msg=name)
        assert torch.equal(w[0:64].dequantize(), w.dequantize()[0:64])
        assert torch.equal(w.narrow(0, 64, 64).dequantize(), w.dequantize()[64:128])
        w.narrow(0, 0, 64).copy_(w[64:128])  # the loading pattern writes into the weight
    assert torch.equal(w.dequantize()[0:64], w.dequantize()[64:128])
    model.half()
    assert model[0].weight.dtype == torch.float16


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_quantized_experts_run_under_inference_mode(implementation):
    import moe_models

    model = moe_models.build("gpt_oss")  # transposed experts: indexing, views and bmm
    qshard.quantize_(model, qshard.Int4WeightOnlyConfig(group_size=32))
    model.set_experts_implementation(implementation)
    ids = torch.randint(0, moe_models.VOCAB, (1, 8))
    with torch.no_grad():
        expected = model(ids).logits
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
