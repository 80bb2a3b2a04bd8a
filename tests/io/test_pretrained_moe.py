"""Mixture-of-experts checkpoints other producers write (docs/design.md, "Formats", §8), written
here in each
producer's own per-expert or 3-D convention from transformers' tiny random MoE models, loaded
with qshard.load_pretrained into the models' fused 3-D experts (gate_up_proj, down_proj) with no
float round trip: every loaded experts weight dequantizes to exactly what the format's formula
gives, and the model runs as the same model with those dequantized weights. Export writes them
back in the format's own layout; a checkpoint that does not fit the model is refused, with the
model unchanged."""

from __future__ import annotations

import json
import pathlib

import moe_models
import pytest
import torch
from helpers import assert_same_qtensor, relative_error
from safetensors.torch import load_file, save_file
from torch import nn

import qshard
from qshard import CheckpointError, QShardError

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
TOKENS = torch.tensor([[3, 17, 42, 99, 5, 64, 120, 8, 31, 77]])
# Relative error of the logits against the model with the dequantized weights. Weight-only
# layouts on the CPU reference path run the same bf16 weights (0.0 measured; summation order
# at most); W8A8 FP8 also quantizes activations per 1x128 group (0.014 / 0.026 measured for
# Qwen3-MoE / DeepSeek-V3; measured: 0.037 per matmul on random weights).
WEIGHT_ONLY_TOLERANCE = 1e-3
W8A8_TOLERANCE = 0.06


def write_checkpoint(directory: pathlib.Path, tensors: dict, model: nn.Module, qc: dict):
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    config = {**model.config.to_dict(), "torch_dtype": "bfloat16", "quantization_config": qc}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if n.endswith("mlp.experts")}


def reference(model: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    """`model` with the float `weights` (dequantized experts) in place of its parameters."""
    for key, value in weights.items():
        module, _, name = key.rpartition(".")
        setattr(model.get_submodule(module), name, nn.Parameter(value.to(torch.bfloat16)))
    return model


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits.float()


# ---- DeepSeek-V3 / Qwen3-MoE block FP8: per-expert linears, fused -----------------------------


def fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's block quantization of a float [N, K] weight, written out here: per 128 x 128
    block (partial at the edges), scale = amax / 448, codes = e4m3(w / scale); the checkpoint
    stores the codes and the scale as `weight_scale_inv` (a multiplier)."""
    n, k = w.shape
    pad = torch.zeros(-(-n // block) * block, -(-k // block) * block)
    pad[:n, :k] = w.float()
    blocks = pad.reshape(pad.shape[0] // block, block, pad.shape[1] // block, block)
    scale = blocks.abs().amax((1, 3)) / 448
    codes = (pad / scale.repeat_interleave(block, 0).repeat_interleave(block, 1))[:n, :k]
    return codes.to(torch.float8_e4m3fn), scale


def fp8_value(codes: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The format's W = fp8 * weight_scale_inv per block."""
    n, k = codes.shape
    per_element = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return codes.float() * per_element


def per_expert_checkpoint(model: nn.Module, quantize) -> tuple[dict, dict]:
    """(tensors under the producer's keys, the float experts the format's formula gives, under
    the model's keys): every expert's gate_proj / up_proj / down_proj a linear of its own, as
    DeepSeek-V3, Qwen3-MoE and compressed-tensors store them. `quantize(w [N, K], fused)`
    returns the tensors stored for the linear (`weight`, its scales...) and the weight they
    stand for; `fused` is the expert's gate_up (or down) weight that `w` is a part of."""
    tensors, expected = {}, {}
    fused = {f"{m}.{p}" for m in experts_modules(model) for p in ("gate_up_proj", "down_proj")}
    for key, value in model.state_dict().items():
        if key not in fused:
            tensors[key] = value.to(torch.bfloat16)
            continue
        module, _, name = key.rpartition(".")
        stands_for = []
        for e, w in enumerate(value.to(torch.bfloat16)):
            parts = (
                {"down_proj": w}
                if name == "down_proj"
                else dict(zip(("gate_proj", "up_proj"), w.chunk(2), strict=True))
            )
            values = []
            for projection, part in parts.items():
                stored, dequantized = quantize(part, w)
                prefix = f"{module}.{e}.{projection}"
                tensors.update({f"{prefix}.{n}": t for n, t in stored.items()})
                values.append(dequantized)
            stands_for.append(torch.cat(values))
        expected[key] = torch.stack(stands_for)
    return tensors, expected


DEEPSEEK_QC = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def deepseek_fp8(w: torch.Tensor, fused: torch.Tensor) -> tuple[dict, torch.Tensor]:
    codes, scale = fp8_blocks(w)
    return {"weight": codes, "weight_scale_inv": scale}, fp8_value(codes, scale)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_block_fp8_per_expert_checkpoints_load_into_the_fused_experts(name, tmp_path):
    model = moe_models.build(name).to(torch.bfloat16)
    tensors, expected = per_expert_checkpoint(model, deepseek_fp8)
    write_checkpoint(tmp_path, tensors, model, DEEPSEEK_QC)

    state = qshard.load_pretrained(tmp_path)  # no model: transformers' key names
    assert not any(".experts.0." in key for key in state)
    for key, value in expected.items():
        w = state[key]
        assert isinstance(w, qshard.Fp8BlockwiseTensor) and w.shape == value.shape, key
        assert torch.equal(w.dequantize(torch.float32), value), key
        # I = 32: gate and up join inside a 128-row block, re-blocked to 32 rows (exact)
        assert w.block_size == ((32, 128) if key.endswith("gate_up_proj") else (128, 128))

    loaded = qshard.load_pretrained(tmp_path, model=moe_models.build(name).to(torch.bfloat16))
    for key in expected:
        assert_same_qtensor(loaded.get_parameter(key), state[key])
    ref = reference(moe_models.build(name).to(torch.bfloat16), expected)
    error = relative_error(logits(loaded), logits(ref))
    assert error < W8A8_TOLERANCE, f"logits relative error {error:.4f}, allowed {W8A8_TOLERANCE}"

    out = qshard.export(loaded, tmp_path / "export", format="deepseek-fp8")
    written = load_file(out / "model.safetensors")
    for key, value in tensors.items():  # the producer's own tensors, byte for byte
        assert written[key].dtype == value.dtype and torch.equal(
            written[key].view(torch.uint8), value.view(torch.uint8)
        ), key
    assert json.loads((out / "config.json").read_text())["quantization_config"][
        "weight_block_size"
    ] == [128, 128]


# ---- gpt-oss MXFP4: already 3-D, transposed parameters --------------------------------------


def mxfp4_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """OCP MXFP4 of float experts [E, out, in] along `in` (the contraction dim), as gpt-oss
    stores them: (`_blocks` uint8 [E, out, in/32, 16] with the even element in the low nibble,
    `_scales` uint8 [E, out, in/32] e8m0 = exponent + 127, the values they stand for)."""
    e, rows, k = w.shape
    groups = w.float().reshape(e, rows, k // 32, 32)
    exponent = torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=2**-100))) - 2
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitude = (scaled.abs()[..., None] - E2M1).abs().argmin(-1)  # nearest e2m1 (ties low)
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    magnitudes = E2M1[(codes & 7).long()]
    value = torch.where(codes & 8 > 0, -magnitudes, magnitudes)
    value = (value * torch.exp2(exponent)[..., None]).reshape(e, rows, k)
    return blocks, (exponent + 127).to(torch.uint8), value


def test_gpt_oss_mxfp4_loads_into_its_transposed_experts_and_exports_byte_exact(tmp_path):
    model = moe_models.gpt_oss().to(torch.bfloat16)
    tensors, expected = {}, {}
    for key, value in model.state_dict().items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # the model's [E, in, out]; the checkpoint's blocks run along `in`
            blocks, scales, stands_for = mxfp4_experts(value.transpose(-2, -1))
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
            expected[key] = stands_for.transpose(-2, -1)
        else:
            tensors[key] = value
    qc = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    write_checkpoint(tmp_path, tensors, model, qc)

    state = qshard.load_pretrained(tmp_path)
    for key, value in expected.items():
        w = state[key]
        assert isinstance(w, qshard.Mxfp4Tensor) and w.transposed and w.shape == value.shape
        assert torch.equal(w.dequantize(torch.float32), value), key
        assert torch.equal(w[3].dequantize(torch.float32), value[3])  # expert 3, [in, out]
    assert state["model.layers.0.mlp.experts.gate_up_proj_bias"].dtype == torch.bfloat16

    loaded = qshard.load_pretrained(tmp_path, model=moe_models.gpt_oss().to(torch.bfloat16))
    ref = reference(moe_models.gpt_oss().to(torch.bfloat16), expected)
    error = relative_error(logits(loaded), logits(ref))
    assert error < WEIGHT_ONLY_TOLERANCE, f"logits relative error {error:.4f}"

    out = qshard.export(loaded, tmp_path / "export", format="gpt-oss-mxfp4")
    written = load_file(out / "model.safetensors")
    assert sorted(written) == sorted(tensors)
    for key, value in tensors.items():
        assert written[key].dtype == value.dtype and torch.equal(written[key], value), key
    again = qshard.load_pretrained(out)
    for key in expected:
        assert_same_qtensor(again[key], state[key])


# ---- compressed-tensors MoE: per-expert linears, compressed by compressed-tensors itself -------


def ct_quantize(scheme_name: str):
    """A `quantize` for per_expert_checkpoint: compressed-tensors' own compressor for the scheme
    (int4 in groups of 32 asymmetric, or NVFP4A16) on quantization parameters computed here; the
    weight its own decompressor gives back is what the linear stands for."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if scheme_name == "W4A16_G32_ASYM":
        weights = QuantizationArgs(
            num_bits=4, type="int", symmetric=False, strategy="group", group_size=32
        )
    else:
        weights = QuantizationArgs(
            num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16
        )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    compressor = BaseCompressor.get_value_from_registry(infer_module_format(nn.Linear, scheme))

    def quantize(w: torch.Tensor, fused: torch.Tensor) -> tuple[dict, torch.Tensor]:
        n, k = w.shape
        if scheme_name == "W4A16_G32_ASYM":
            groups = w.float().reshape(n, k // 32, 32)
            low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
            scale = ((high - low) / 15).clamp(min=1e-6).to(torch.bfloat16)
            zero = (-8 - torch.round(low / scale.float())).clamp(-8, 7).to(torch.int8)
            params = {"weight_scale": scale, "weight_zero_point": zero}
        else:
            # gate and up of one expert share a global scale (llm-compressor fuses them so)
            global_scale = (448 * 6 / fused.float().abs().max()).reshape(1)
            amax = w.float().reshape(n, k // 16, 16).abs().amax(-1)
            scale = (amax / 6 * global_scale).to(torch.float8_e4m3fn).float()
            params = {"weight_scale": scale, "weight_global_scale": global_scale}
        stored = compressor.compress({"weight": w, **params}, scheme)
        return stored, compressor.decompress(stored, scheme)["weight"].float()

    fmt = infer_module_format(nn.Linear, scheme)
    group = {**scheme.model_dump(), "format": fmt}
    qc = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"],
    }
    return quantize, qc


@pytest.mark.parametrize("scheme", ["W4A16_G32_ASYM", "NVFP4A16"])
def test_compressed_tensors_moe_checkpoints_load_into_the_fused_experts(scheme, tmp_path):
    pytest.importorskip("compressed_tensors")
    model = moe_models.qwen3_moe().to(torch.bfloat16)
    quantize, qc = ct_quantize(scheme)
    tensors, expected = per_expert_checkpoint(model, quantize)
    write_checkpoint(tmp_path, tensors, model, qc)
    layout = qshard.Int4Tensor if scheme.startswith("W4") else qshard.Nvfp4Tensor

    loaded = qshard.load_pretrained(tmp_path, model=moe_models.qwen3_moe().to(torch.bfloat16))
    for key, value in expected.items():
        w = loaded.get_parameter(key)
        assert isinstance(w, layout) and w.shape == value.shape
        mine = w.dequantize(torch.bfloat16).float()
        if layout is qshard.Nvfp4Tensor:  # it divides by the global scale, qshard multiplies
            torch.testing.assert_close(mine, value, rtol=2**-7, atol=0)
        else:
            assert torch.equal(mine, value), key
    ref = reference(moe_models.qwen3_moe().to(torch.bfloat16), expected)
    error = relative_error(logits(loaded), logits(ref))
    assert error < WEIGHT_ONLY_TOLERANCE, f"logits relative error {error:.4f}"

    out = qshard.export(loaded, tmp_path / "export", format="compressed-tensors")
    written = load_file(out / "model.safetensors")
    for key, value in tensors.items():
        if ".experts." in key:
            assert torch.equal(written[key], value), key


# ---- checkpoints that do not fit the model -----------------------------------------------------


def qwen3_moe_with(**changes) -> nn.Module:
    from transformers import Qwen3MoeForCausalLM

    config = moe_models.qwen3_moe().config
    for name, value in changes.items():
        setattr(config, name, value)
    return Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (
            {"num_experts": 4},
            r"is \[8, 64, 64\] in the checkpoint and \[4, 64, 64\] in the model "
            r"\(8 experts in the checkpoint and 4 in the model\)",
        ),
        (
            {"moe_intermediate_size": 64},
            r"is \[8, 64, 64\] in the checkpoint and "
            r"\[8, 128, 64\] in the model \(experts of another shape",
        ),
    ],
    ids=["expert-count", "intermediate-size"],
)
def test_a_checkpoint_of_other_experts_is_refused_and_the_model_unchanged(changes, match, tmp_path):
    model = moe_models.qwen3_moe().to(torch.bfloat16)
    write_checkpoint(tmp_path, per_expert_checkpoint(model, deepseek_fp8)[0], model, DEEPSEEK_QC)
    other = qwen3_moe_with(**changes)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match=match):
        qshard.load_pretrained(tmp_path, model=other)
    after = other.state_dict()
    assert all(
        type(after[k]) is torch.Tensor and torch.equal(after[k], v) for k, v in before.items()
    )


def test_an_expert_missing_from_the_checkpoint_is_refused(tmp_path):
    model = moe_models.qwen3_moe().to(torch.bfloat16)
    tensors = per_expert_checkpoint(model, deepseek_fp8)[0]
    prefix = "model.layers.1.mlp.experts.5.up_proj"
    del tensors[prefix + ".weight"], tensors[prefix + ".weight_scale_inv"]
    write_checkpoint(tmp_path, tensors, model, DEEPSEEK_QC)
    with pytest.raises(
        CheckpointError,
        match=r"model.layers.1.mlp.experts: experts \[5\] have "
        r"no up_proj.weight",
    ):
        qshard.load_pretrained(tmp_path)


def test_two_names_for_one_expert_are_refused_naming_both(tmp_path):
    """experts.1. and experts.01. name the same expert: neither may silently win."""
    model = moe_models.qwen3_moe().to(torch.bfloat16)
    tensors = per_expert_checkpoint(model, deepseek_fp8)[0]
    other = per_expert_checkpoint(qwen3_moe_with(), deepseek_fp8)[0]  # other weights
    prefix, twin = "model.layers.0.mlp.experts.1.up_proj", "model.layers.0.mlp.experts.01.up_proj"
    for suffix in (".weight", ".weight_scale_inv"):
        tensors[twin + suffix] = other[prefix + suffix]
    write_checkpoint(tmp_path, tensors, model, DEEPSEEK_QC)
    with pytest.raises(
        CheckpointError,
        match=r"experts\.01\.up_proj.weight' and '.*experts\.1"
        r"\.up_proj.weight' both name expert 1",
    ):
        qshard.load_pretrained(tmp_path)


def test_export_refuses_transposed_experts_in_a_per_expert_format(tmp_path):
    model = moe_models.gpt_oss().to(torch.bfloat16)
    qshard.quantize_(model, qshard.Fp8BlockwiseConfig(block_size=(32, 32)))
    with pytest.raises(QShardError, match=r"stored transposed \[E, in, out\] \(gpt-oss\)"):
        qshard.export(model, tmp_path / "out", format="deepseek-fp8")
    assert not (tmp_path / "out").exists()
    # Float experts say nothing of their orientation: the model's experts module does.
    model = moe_models.gpt_oss().to(torch.bfloat16)
    qshard.quantize_(model, qshard.Fp8BlockwiseConfig(block_size=(32, 32)), exclude="*.experts.*")
    with pytest.raises(QShardError, match=r"stored transposed \[E, in, out\] \(gpt-oss\)"):
        qshard.export(model, tmp_path / "out", format="deepseek-fp8")
    assert not (tmp_path / "out").exists()


# ---- qshard-quantized MoE models: export -> load_pretrained ------------------------------------


@pytest.mark.parametrize(
    ("fmt", "config"),
    [
        ("deepseek-fp8", qshard.Fp8BlockwiseConfig()),
        ("compressed-tensors", qshard.Int4WeightOnlyConfig(group_size=32)),
        ("compressed-tensors", qshard.NVFP4WeightOnlyConfig()),
        ("modelopt-nvfp4", qshard.NVFP4WeightOnlyConfig()),
    ],
    ids=["deepseek-fp8", "ct-int4", "ct-nvfp4", "modelopt-nvfp4"],
)
def test_a_quantized_moe_model_exports_per_expert_and_loads_back_the_same(fmt, config, tmp_path):
    if fmt == "compressed-tensors":
        pytest.importorskip("compressed_tensors")
    model = moe_models.qwen3_moe().to(torch.bfloat16)
    qshard.quantize_(model, config, exclude=["lm_head"])
    out = qshard.export(model, tmp_path / "out", format=fmt)
    written = load_file(out / "model.safetensors")
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in {
        k.removesuffix("_packed") for k in written
    }
    assert not any(k.endswith("gate_up_proj") for k in written)
    loaded = qshard.load_pretrained(out, model=moe_models.qwen3_moe().to(torch.bfloat16))
    for name, module in experts_modules(model).items():
        for param in ("gate_up_proj", "down_proj"):
            mine, theirs = getattr(module, param), loaded.get_submodule(name).get_parameter(param)
            assert type(mine) is type(theirs) and mine.shape == theirs.shape
            torch.testing.assert_close(  # NVFP4: its global divisor round trip, one fp32 ulp
                theirs.dequantize(torch.float32),
                mine.dequantize(torch.float32),
                rtol=2**-22,
                atol=0,
            )


def test_gate_and_up_that_no_fp8_block_of_16_rows_can_join_are_refused(tmp_path):
    """I = 40: the join at row 40 falls on no power-of-two block of 16 rows or more (the
    smallest FP8 block), so it cannot be made exact."""
    torch.manual_seed(0)
    tensors = {}
    for e in range(2):
        for projection, shape in (
            ("gate_proj", (40, 64)),
            ("up_proj", (40, 64)),
            ("down_proj", (64, 40)),
        ):
            stored, _ = deepseek_fp8(torch.randn(shape) * 0.05, None)
            prefix = f"model.layers.0.mlp.experts.{e}.{projection}"
            tensors.update({f"{prefix}.{n}": t for n, t in stored.items()})
    tmp_path.mkdir(exist_ok=True)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = {"torch_dtype": "bfloat16", "quantization_config": DEEPSEEK_QC}
    (tmp_path / "config.json").write_text(json.dumps(config))
    match = (
        r"model.layers.0.mlp.experts: joining .* I = 40 rows, and Fp8BlockwiseTensor packs "
        r"rows in steps of 128 .* no power-of-two block of 16 rows or more dividing 40"
    )
    with pytest.raises(CheckpointError, match=match):
        qshard.load_pretrained(tmp_path)


# ---- Mixtral's own names: block_sparse_moe.experts.{e}.w1 / w3 / w2 -------------------------


def mixtral_names(key: str) -> str:
    """A transformers 5.x key under the names Mixtral checkpoints use (transformers'
    conversion mapping for "mixtral"): `mlp` -> `block_sparse_moe`, gate/up/down -> w1/w3/w2."""
    key = key.replace(".mlp.", ".block_sparse_moe.")
    for new, old in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        key = key.replace(f".{new}.", f".{old}.")
    return key


def test_mixtral_named_fp8_experts_load_as_the_transformers_names_do(tmp_path):
    model = moe_models.build("mixtral").to(torch.bfloat16)
    tensors, expected = per_expert_checkpoint(model, deepseek_fp8)
    legacy = {mixtral_names(k): v for k, v in tensors.items()}
    assert any(".block_sparse_moe.experts.0.w3.weight_scale_inv" in k for k in legacy)
    assert any(k.endswith(".block_sparse_moe.gate.weight") for k in legacy)  # the router
    write_checkpoint(tmp_path / "legacy", legacy, model, DEEPSEEK_QC)
    write_checkpoint(tmp_path / "modern", tensors, model, DEEPSEEK_QC)

    state = qshard.load_pretrained(tmp_path / "legacy")  # no model: transformers' key names
    assert set(state) == set(qshard.load_pretrained(tmp_path / "modern"))
    for key, value in expected.items():
        assert torch.equal(state[key].dequantize(torch.float32), value), key
    loaded = qshard.load_pretrained(
        tmp_path / "legacy", model=moe_models.build("mixtral").to(torch.bfloat16)
    )
    ref = reference(moe_models.build("mixtral").to(torch.bfloat16), expected)
    error = relative_error(logits(loaded), logits(ref))
    assert error < W8A8_TOLERANCE, f"logits relative error {error:.4f}, allowed {W8A8_TOLERANCE}"
