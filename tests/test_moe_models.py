"""transformers' own tiny random MoE models (tests/moe_models.py) quantized by qshard: every
registered layout, every experts implementation ("eager", "grouped_mm", "batched_mm").

The strong check: the quantized model's logits equal those of the same float model whose
quantized weights are replaced by their `dequantize()` (weight-only forms: only rounding differs).
W8A8 forms also quantize activations, so there the three implementations must agree with each
other, and each experts module must stay within the layout's SQNR of the dequantized one.
Against the float model the check is per experts module, on the float model's own inputs and
routing: whole-model logits also carry routing flips (a token's top-2 changes when its hidden
state moves a little), which say nothing about the layout.
"""

from __future__ import annotations

import dataclasses
import functools

import moe_models
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qshard
from qshard.api import experts_params
from qshard.layouts import registered_layouts
from qshard.metrics import sqnr_db
from qshard.qtensor import stored_nbytes

IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
MODELS = list(moe_models.BUILDERS)

# One representative config per registered layout, sized for the tiny models (FP8 blocks of
# 32x32 so a 64x64 expert has several blocks; int4 groups of 32).
REPRESENTATIVE = {
    qshard.Fp8BlockwiseTensor: qshard.Fp8BlockwiseConfig(block_size=(32, 32)),
    qshard.Fp8RowwiseTensor: qshard.Fp8RowwiseConfig(),
    qshard.Int4Tensor: qshard.Int4WeightOnlyConfig(group_size=32),
    qshard.Mxfp4Tensor: qshard.MXFP4WeightOnlyConfig(),
    qshard.Nvfp4Tensor: qshard.NVFP4WeightOnlyConfig(),
}
LAYOUTS = registered_layouts()
LAYOUT_IDS = [cls.__name__ for cls in LAYOUTS]

# float32 reference paths vs float32 matmuls of the dequantized weights: only the order of the
# roundings differs (measured 124-129 dB).
EQUAL_SQNR_DB = 90.0
# An experts module chains two quantized matmuls (gate_up, then down after the gate): their
# errors add (~3 dB below one linear's), and 18 tokens over 8 experts is a small sample.
CHAINED_MARGIN_DB = 4.5
# Zeroing every expert must change the logits far more than this: otherwise the models' experts
# would not matter and no test here could see a wrong expert weight.
EXPERTS_MATTER_MAX_SQNR_DB = 12.0


def input_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, moe_models.VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))


def weight_only(config):
    """The config with activations left in float (FP8's W8A16), or itself."""
    if getattr(config, "weight_only", True):
        return config
    return dataclasses.replace(config, weight_only=True)


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if experts_params(m)}


def experts_weight_names(model: nn.Module) -> list[str]:
    """Names of the 3-D expert weights, found independently of qshard's rules."""
    return [
        name
        for name, p in model.named_parameters()
        if p.dim() == 3 and name.rsplit(".", 1)[-1] in ("gate_up_proj", "down_proj")
    ]


@functools.cache
def float_model(name: str) -> nn.Module:
    return moe_models.build(name)


@functools.cache
def quantized_model(name: str, config, include: str | None = None) -> nn.Module:
    model = moe_models.build(name)
    qshard.quantize_(model, config, include=include)
    return model


def dequantized_twin(name: str, quantized: nn.Module) -> nn.Module:
    """The float model with every quantized weight replaced by its dequantize()."""
    model = moe_models.build(name)
    weights = dict(quantized.named_parameters())
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            q = weights[param_name]
            if isinstance(q, qshard.QTensor):
                param.copy_(q.dequantize(param.dtype))
    return model


def logits(model: nn.Module, implementation: str, ids: torch.Tensor) -> torch.Tensor:
    model.set_experts_implementation(implementation)
    with torch.no_grad():
        return model(ids).logits


def experts_inputs(model: nn.Module, ids: torch.Tensor) -> dict[str, tuple]:
    """{experts module name: (args, kwargs) of its call} on one forward of `model`."""
    seen = {}
    hooks = [
        module.register_forward_pre_hook(
            lambda m, args, kwargs, name=name: seen.__setitem__(name, (args, kwargs)),
            with_kwargs=True,
        )
        for name, module in experts_modules(model).items()
    ]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def experts_sqnrs(reference: nn.Module, model: nn.Module, inputs: dict) -> dict[str, float]:
    """Per experts module: SQNR of `model`'s output vs `reference`'s, on the same inputs."""
    ours, theirs = experts_modules(model), experts_modules(reference)
    out = {}
    with torch.no_grad():
        for name, (args, kwargs) in inputs.items():
            out[name] = sqnr_db(theirs[name](*args, **kwargs), ours[name](*args, **kwargs))
    return out


def test_every_registered_layout_has_a_representative_config():
    missing = [cls.__name__ for cls in LAYOUTS if cls not in REPRESENTATIVE]
    assert not missing, f"add a tiny-model config for {missing} to REPRESENTATIVE"


@pytest.mark.parametrize("name", MODELS)
def test_the_tiny_models_experts_matter(name):
    """Sanity of the fixtures: the logits depend strongly on the expert weights, and every
    experts implementation gives the float model's logits."""
    model, ids = float_model(name), input_ids()
    expected = logits(model, "eager", ids)
    for implementation in IMPLEMENTATIONS[1:]:
        got = logits(model, implementation, ids)
        assert sqnr_db(expected, got) >= EQUAL_SQNR_DB, implementation
    zeroed = moe_models.build(name)
    with torch.no_grad():
        for module in experts_modules(zeroed).values():
            for param, _ in experts_params(module):
                getattr(module, param).zero_()
    measured = sqnr_db(expected, logits(zeroed, "eager", ids))
    assert measured < EXPERTS_MATTER_MAX_SQNR_DB, measured


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("name", MODELS)
def test_quantized_model_equals_its_dequantized_float_model(name, layout):
    """Weight-only forms: the quantized model is the float model with dequantized weights, under
    every experts implementation (each a different path: F.linear on w[e], grouped_mm, bmm)."""
    config = weight_only(REPRESENTATIVE[layout])
    model = quantized_model(name, config)
    twin = dequantized_twin(name, model)
    ids = input_ids()
    for implementation in IMPLEMENTATIONS:
        expected = logits(twin, implementation, ids)
        measured = sqnr_db(expected, logits(model, implementation, ids))
        assert measured >= EQUAL_SQNR_DB, (
            f"{implementation}: {measured:.1f} dB < {EQUAL_SQNR_DB} dB vs the dequantized model"
        )


@pytest.mark.parametrize(
    "layout",
    [c for c in LAYOUTS if weight_only(REPRESENTATIVE[c]) is not REPRESENTATIVE[c]],
    ids=lambda c: c.__name__,
)
@pytest.mark.parametrize("name", MODELS)
def test_w8a8_implementations_agree_and_stay_near_the_dequantized_model(name, layout):
    """W8A8 forms: activations are quantized per token, so every implementation gives the same
    logits (each token's row is quantized alone); each experts module is within the layout's
    SQNR of the dequantized weights' module (the activation rounding alone)."""
    config = REPRESENTATIVE[layout]
    model, ids = quantized_model(name, config), input_ids()
    expected = logits(model, "eager", ids)
    for implementation in IMPLEMENTATIONS[1:]:
        measured = sqnr_db(expected, logits(model, implementation, ids))
        assert measured >= EQUAL_SQNR_DB, (implementation, measured)
    twin = dequantized_twin(name, model)
    for module, measured in experts_sqnrs(twin, model, experts_inputs(twin, ids)).items():
        assert measured >= layout.min_linear_sqnr_db, (module, measured)


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("name", MODELS)
def test_quantized_experts_are_close_to_float(name, layout):
    """Each experts module vs the float one on the float model's inputs and routing, and the
    logits with only the experts quantized, within the layout's linear SQNR minus the margin
    for two chained matmuls."""
    config, ids = REPRESENTATIVE[layout], input_ids(seed=1)
    reference = float_model(name)
    model = quantized_model(name, config, include="*.experts.*")
    allowed = layout.min_linear_sqnr_db - CHAINED_MARGIN_DB
    inputs = experts_inputs(reference, ids)
    for module, measured in experts_sqnrs(reference, model, inputs).items():
        assert measured >= allowed, f"{module}: {measured:.1f} dB < {allowed} dB"
    for implementation in IMPLEMENTATIONS:
        measured = sqnr_db(logits(reference, "eager", ids), logits(model, implementation, ids))
        assert measured >= allowed, f"logits, {implementation}: {measured:.1f} dB < {allowed} dB"


@pytest.mark.parametrize("name", MODELS)
def test_report_lists_every_expert_weight_and_the_router_stays_float(name):
    model = moe_models.build(name)
    floats = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = qshard.quantize_(model, qshard.Int4WeightOnlyConfig(group_size=32))
    quantized = {m.name: m for m in report.quantized}
    expected = experts_weight_names(model)
    assert len(expected) == 2 * len(experts_modules(model)) > 0
    for weight_name in expected:
        entry = quantized[weight_name]
        weight = model.get_parameter(weight_name)
        assert entry.layout == "Int4Tensor" and isinstance(weight, qshard.Int4Tensor)
        assert entry.shape == tuple(floats[weight_name].shape) == tuple(weight.shape)
        assert entry.bytes_before == floats[weight_name].numel() * 4
        assert entry.bytes_after == stored_nbytes(weight) < entry.bytes_before / 4
        assert weight_name in str(report)
    routers = [n for n in floats if n.endswith(("mlp.gate.weight", "mlp.router.weight"))]
    assert routers
    for router in routers:
        assert router.rsplit(".", 1)[0] not in quantized
        param = model.get_parameter(router)
        assert type(param) is nn.Parameter and torch.equal(param, floats[router])
    # gpt-oss's expert biases stay float beside their quantized weights.
    for bias in (n for n in floats if n.endswith("_proj_bias")):
        assert type(model.get_parameter(bias)) is nn.Parameter


@pytest.mark.parametrize(
    ("include", "exclude", "quantized_experts"),
    [
        ("*.experts.*", None, ("gate_up_proj", "down_proj")),
        (None, "*.experts.*", ()),
        (None, "*.experts.down_proj", ("gate_up_proj",)),
        ("*.experts.gate_up_proj", None, ("gate_up_proj",)),
    ],
)
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_include_and_exclude_patterns_select_expert_weights(
    name, include, exclude, quantized_experts
):
    model = moe_models.build(name)
    report = qshard.quantize_(
        model, qshard.MXFP4WeightOnlyConfig(), include=include, exclude=exclude
    )
    quantized = {m.name for m in report.quantized}
    skipped = report.skipped_names()
    for weight_name in experts_weight_names(model):
        selected = weight_name.endswith(quantized_experts) if quantized_experts else False
        assert (weight_name in quantized) is selected, weight_name
        assert (weight_name in skipped) is not selected, weight_name
        assert isinstance(model.get_parameter(weight_name), qshard.QTensor) is selected
    others = quantized - set(experts_weight_names(model))
    assert bool(others) is (include is None), others  # the attention linears
    assert torch.isfinite(logits(model, "grouped_mm", input_ids())).all()


@pytest.mark.parametrize("name", MODELS)
def test_generate_matches_the_dequantized_model(name):
    """Greedy decoding with a KV cache (a few tokens at a time: experts with one token or none)
    gives the dequantized float model's tokens."""
    config = REPRESENTATIVE[qshard.Nvfp4Tensor]
    model = quantized_model(name, config)
    twin = dequantized_twin(name, model)
    ids = input_ids(seed=2)[:1, :5]
    outputs = []
    for m in (model, twin):
        m.set_experts_implementation("grouped_mm")
        with torch.no_grad():
            outputs.append(m.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0))
    assert outputs[0].shape == (1, 9)
    assert torch.equal(outputs[0], outputs[1]), outputs


def compile_counts(fn, calls) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """(backend compilations so far after each call, compiled outputs, eager outputs) of fn
    over calls (arg tuples)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    counts, got, expected = [], [], []
    with torch.no_grad():
        for args in calls:
            got.append(compiled(*args))
            counts.append(counter.frame_count)
            expected.append(fn(*args))
    return counts, got, expected


def random_routing(tokens: int, dtype=torch.bfloat16) -> tuple[torch.Tensor, ...]:
    """(hidden, top_k_index, top_k_weights) of `tokens` tokens: an experts module's inputs."""
    gen = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, moe_models.HIDDEN, generator=gen).to(dtype)
    ids = torch.randint(0, moe_models.EXPERTS, (tokens, moe_models.TOP_K), generator=gen)
    return hidden, ids, torch.rand(tokens, moe_models.TOP_K, generator=gen).to(dtype)


# bf16 outputs, compiled vs eager: inductor computes the gate's elementwise ops in fp32 and
# rounds once (measured 40-45 dB on the logits, 38+ on the experts).
COMPILED_SQNR_DB = 30.0


@pytest.mark.slow
def test_compiled_grouped_mm_experts_do_not_recompile():
    """torch.compile(fullgraph=True) of an experts module (grouped_mm) compiles once for every
    token count (one qshard::experts_linear node whatever the offsets). bf16: transformers uses
    its own fallback op for other dtypes under compile (handled as _grouped_mm)."""
    model = moe_models.build("qwen3_moe").to(torch.bfloat16)
    qshard.quantize_(model, REPRESENTATIVE[qshard.Int4Tensor], include="*.experts.*")
    model.set_experts_implementation("grouped_mm")
    experts = next(iter(experts_modules(model).values()))
    torch._dynamo.utils.counters.clear()
    counts, got, expected = compile_counts(experts, [random_routing(t) for t in (5, 11, 3)])
    assert counts[0] >= 1 and counts[1:] == [counts[0]] * 2, f"compilations after each: {counts}"
    assert not torch._dynamo.utils.counters["graph_break"]
    for g, e in zip(got, expected, strict=True):
        assert sqnr_db(e, g) >= COMPILED_SQNR_DB


@pytest.mark.slow
def test_compiled_whole_model_does_not_recompile():
    """The whole gpt-oss model (transposed experts with biases, clamped SwiGLU; MXFP4, its own
    checkpoints' layout, everywhere) compiles with fullgraph=True and not again for other
    lengths. (Weight-only: with W8A8, inductor's fused bf16 elementwise ops round an
    activation differently and its fp8 code moves: one FP8 linear after a fused silu compares
    at 35 dB in bf16 (exact in float32), this model's logits at 26 dB.)"""
    model = moe_models.build("gpt_oss").to(torch.bfloat16)
    qshard.quantize_(model, REPRESENTATIVE[qshard.Mxfp4Tensor])
    model.set_experts_implementation("grouped_mm")

    def forward(ids):
        return model(ids, use_cache=False).logits

    # Ids whose routing has no near tie (top-2 router logits lead the third by >= 0.04 in
    # every layer): with one, bf16 rounding that differs once compiled may pick the other
    # expert (seen: 0.006 apart, 14 dB on that token), which says nothing about qshard.
    ids = torch.randint(0, moe_models.VOCAB, (1, 9), generator=torch.Generator().manual_seed(7))
    assert first_near_tie(model, ids, margin=0.04) == 9, "pick ids with no near tie"
    calls = [(ids[:, :n],) for n in (7, 9, 4)]
    torch._dynamo.utils.counters.clear()
    counts, got, expected = compile_counts(forward, calls)
    # The first call may reach the backend twice (with dynamic=True dynamo restarts its
    # analysis once to make gpt-oss's float SwiGLU limit a tensor: _tensorify_python_scalars);
    # a new length must not reach it again.
    assert counts[0] >= 1 and counts[1:] == [counts[0]] * 2, f"compilations after each: {counts}"
    assert not torch._dynamo.utils.counters["graph_break"]
    for g, e in zip(got, expected, strict=True):
        assert sqnr_db(e, g) >= COMPILED_SQNR_DB


def first_near_tie(model: nn.Module, ids: torch.Tensor, margin: float) -> int:
    """The first position whose top-k router logits in some layer lead the next by less than
    `margin` (gpt-oss's routers), or the length."""
    gaps = []

    def record(router, args, out):
        scores = F.linear(args[0].float(), router.weight.float(), router.bias.float())
        top = scores.topk(router.top_k + 1, dim=-1).values
        gaps.append(top[:, -2] - top[:, -1])

    hooks = [layer.mlp.router.register_forward_hook(record) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    tied = (torch.stack(gaps) < margin).any(0).nonzero()
    return int(tied[0]) if len(tied) else ids.shape[1]


def test_transformers_grouped_mm_fallback_op_on_quantized_experts():
    import transformers.integrations.moe  # noqa: F401  (registers the op)

    model = quantized_model("qwen3_moe", REPRESENTATIVE[qshard.Int4Tensor])
    weight = model.get_parameter("model.layers.0.mlp.experts.gate_up_proj")
    x = torch.randn(6, moe_models.HIDDEN)
    offs = torch.tensor([1, 1, 3, 3, 4, 6, 6, 6], dtype=torch.int32)
    got = torch.ops.transformers.grouped_mm_fallback(x, weight.transpose(-2, -1), offs)
    expected = torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    "offs",
    [
        torch.tensor([1, 2, 2, 3, 4, 5, 5, 6], dtype=torch.int64),  # not int32
        torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.int32),  # not one per expert
        torch.tensor([[1, 2, 2, 3, 4, 5, 5, 6]], dtype=torch.int32),  # not 1-D
        torch.tensor([1, 3, 2, 3, 4, 5, 5, 6], dtype=torch.int32),  # decreasing
        torch.tensor([-1, 2, 2, 3, 4, 5, 5, 6], dtype=torch.int32),  # before the first row
        torch.tensor([1, 2, 2, 3, 4, 5, 5, 7], dtype=torch.int32),  # beyond the 6 tokens
    ],
    ids=["int64", "short", "2d", "decreasing", "negative", "beyond"],
)
@pytest.mark.parametrize("op", ["_grouped_mm", "F.grouped_mm"])
def test_bad_offsets_are_a_typed_error(offs, op):
    model = quantized_model("qwen3_moe", REPRESENTATIVE[qshard.Int4Tensor])
    weight = model.get_parameter("model.layers.0.mlp.experts.gate_up_proj")
    fn = torch._grouped_mm if op == "_grouped_mm" else torch.nn.functional.grouped_mm
    with pytest.raises(qshard.InputMismatchError, match="offs"):
        fn(torch.randn(6, moe_models.HIDDEN), weight.transpose(-2, -1), offs=offs)
