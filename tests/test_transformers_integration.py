"""transformers' save_pretrained / from_pretrained of qshard models (quant_method "qshard",
qshard/integrations/transformers.py), on tiny random Llama and Qwen3-MoE models."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import zlib

import moe_models
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3MoeForCausalLM
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

import qshard
from qshard.integrations.transformers import QShardConfig, QShardHfQuantizer
from qshard.io.format import CHUNK_BYTES, chunk_crcs

ROOT = pathlib.Path(__file__).resolve().parents[1]

LAYOUTS = {
    "int4": qshard.Int4WeightOnlyConfig(group_size=32),
    "fp8_block": qshard.Fp8BlockwiseConfig(),
    "fp8_row": qshard.Fp8RowwiseConfig(),
    "nvfp4": qshard.NVFP4WeightOnlyConfig(),
    "mxfp4": qshard.MXFP4WeightOnlyConfig(),
}


def tiny_llama() -> LlamaForCausalLM:
    """Sizes chosen so that no float tensor of the model has a quantized weight's shape
    (q 64x64, k/v 32x64, gate/up 96x64, down 64x96) except those weights."""
    config = LlamaConfig(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def assert_same_weights(expected: torch.nn.Module, actual: torch.nn.Module, dtype=None) -> int:
    """Every state_dict entry equal: QTensors of the same class and attributes with every inner
    tensor bit for bit (standing for `dtype` when given); returns how many were quantized."""
    want, got = expected.state_dict(), actual.state_dict()
    assert want.keys() == got.keys()
    quantized = 0
    for key, a in want.items():
        b = got[key]
        assert type(a) is type(b), key
        if isinstance(a, qshard.QTensor):
            quantized += 1
            assert a.attrs() == b.attrs() and a.logical_shape == b.logical_shape, key
            assert b.dtype == (dtype or a.dtype), key
            for name, t in a.inner_tensors().items():
                u = b.inner_tensors()[name]
                assert t.dtype == u.dtype and torch.equal(t, u), f"{key}.{name}"
        else:
            assert torch.equal(a.to(b.dtype), b), key
    return quantized


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_save_pretrained_then_from_pretrained_is_bit_exact(tmp_path, layout):
    model = tiny_llama()
    qshard.quantize_(model, LAYOUTS[layout])
    assert isinstance(model.hf_quantizer, QShardHfQuantizer)  # attached by quantize_
    ids = torch.randint(0, 160, (2, 9))
    expected = model(ids).logits

    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "qshard"
    (group,) = config["config_groups"].values()
    assert qshard.config_from_dict(group["config"]) == LAYOUTS[layout]
    quantized = [n for n, p in model.named_parameters() if isinstance(p, qshard.QTensor)]
    assert len(quantized) == 14 and sorted(group["targets"]) == sorted(quantized)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.down_proj.weight.qdata" in keys
    assert "model.layers.0.mlp.down_proj.weight" not in keys

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is LlamaForCausalLM
    assert isinstance(loaded.hf_quantizer, QShardHfQuantizer)
    assert isinstance(loaded.config.quantization_config, QShardConfig)
    assert assert_same_weights(model, loaded) == 14  # 7 linears x 2 layers; lm_head stays float
    assert not loaded.model.layers[0].mlp.down_proj.weight.requires_grad
    assert torch.equal(loaded(ids).logits, expected)

    # Saved again from the loaded model: the same checkpoint once more.
    loaded.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert_same_weights(model, again)
    # qshard.load reads the same files: it is qshard's own format.
    state = qshard.load(tmp_path)
    assert all(
        torch.equal(state[k].qdata, v.qdata)
        for k, v in model.state_dict().items()
        if isinstance(v, qshard.QTensor)
    )


def test_qwen3_moe_experts_round_trip_as_fused_3d_entries(tmp_path):
    model = moe_models.qwen3_moe()
    qshard.quantize_(
        model, qshard.Int4WeightOnlyConfig(group_size=32), include=["*.experts.*", "*.self_attn.*"]
    )
    ids = torch.randint(0, moe_models.VOCAB, (1, 12))
    expected = model(ids).logits
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    # qshard's names, as qshard.save stores them: the 3-D experts whole, not per expert.
    assert "model.layers.1.mlp.experts.gate_up_proj.qdata" in keys
    assert not [k for k in keys if ".experts.0." in k]

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is Qwen3MoeForCausalLM
    experts = loaded.model.layers[1].mlp.experts.gate_up_proj
    assert isinstance(experts, qshard.Int4Tensor) and experts.shape == (8, 64, 64)
    assert assert_same_weights(model, loaded) == 2 * (4 + 2)
    # Under the default experts implementation, as `expected` was made: transformers' eager
    # and grouped_mm experts differ in the last bits (the float model's logits by 8e-7 with
    # transformers 5.24.0), so the two are compared only with each other below.
    assert torch.equal(loaded(ids).logits, expected)
    for implementation in ("grouped_mm", "eager"):
        model.set_experts_implementation(implementation)
        loaded.set_experts_implementation(implementation)
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_tied_embeddings_stay_tied(tmp_path):
    config = LlamaConfig(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    qshard.quantize_(model, qshard.Fp8BlockwiseConfig())
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, 160, (1, 5))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    state = qshard.load(tmp_path)  # stored once, an alias in qshard's header
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]


def test_dtype_device_map_and_several_files(tmp_path):
    model = tiny_llama()
    qshard.quantize_(model, qshard.Fp8BlockwiseConfig())
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map="cpu")
    # The codes and scales as saved; the weights stand for bfloat16 now, as the rest does.
    assert_same_weights(model, loaded, dtype=torch.bfloat16)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 160, (1, 7))
    bf16 = model.to(torch.bfloat16)  # the same conversion, made on the model itself, but
    rotary = loaded.model.rotary_emb  # .to() also rounds rotary's float32 inv_freq (in no file)
    assert rotary.inv_freq.dtype == torch.float32
    bf16.model.rotary_emb.inv_freq = rotary.inv_freq.clone()
    assert torch.equal(loaded(ids).logits, bf16(ids).logits)


def test_qshard_load_reads_a_save_pretrained_checkpoint_split_into_several_files(tmp_path):
    # save_pretrained repeats one qshard header (describing every entry) in each file, and a
    # weight's qdata and scale may lie in different files: qshard.load reads across them.
    model = tiny_llama()
    qshard.quantize_(model, qshard.Int4WeightOnlyConfig(group_size=32))
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    with qshard.empty_weights():
        fresh = LlamaForCausalLM(model.config)
    loaded = qshard.load(tmp_path, fresh).eval()
    assert assert_same_weights(model, loaded) == 14
    ids = torch.randint(0, 160, (1, 7))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    # A rank's slice reads each inner tensor from the file that holds it.
    key = "model.layers.1.mlp.gate_proj.weight"
    with qshard.io.Checkpoint(tmp_path) as checkpoint:
        parts = [checkpoint.read_shard(key, 0, 2, rank) for rank in range(2)]
    whole = model.get_parameter(key).dequantize()
    assert torch.equal(torch.cat([p.dequantize() for p in parts]), whole)


class _FloatTensors(TorchDispatchMode):
    """Records the shape of every real (not meta) plain float tensor an op makes."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, list | tuple) else [out]:
            plain = type(t) in (torch.Tensor, torch.nn.Parameter)
            if plain and t.is_floating_point() and not t.is_meta:
                self.shapes.add(tuple(t.shape))
        return out


def test_from_pretrained_makes_no_float_weight_for_quantized_params(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DEACTIVATE_ASYNC_LOAD", "1")  # reads in this thread, which the mode sees
    model = tiny_llama()
    qshard.quantize_(model, qshard.Int4WeightOnlyConfig(group_size=32))
    model.save_pretrained(tmp_path)
    weights = {tuple(p.shape) for p in model.parameters() if isinstance(p, qshard.QTensor)}
    assert weights == {(64, 64), (32, 64), (96, 64), (64, 96)}
    with _FloatTensors() as seen:
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded.model.layers[1].self_attn.k_proj.weight, qshard.Int4Tensor)
    assert (160, 64) in seen.shapes  # the float embedding was loaded: the mode saw the load
    assert not seen.shapes & (weights | {s[::-1] for s in weights})


# ---- every read is checked --------------------------------------------------------------------


def _rewrite(path: pathlib.Path, change, fix_checksums: bool) -> None:
    """Rewrite a safetensors file with `change(tensors)` applied; with fix_checksums, the qshard
    header's checksums are updated to the new bytes (so that only qshard's value checks can
    catch the change)."""
    with safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (no __iter__)
        metadata = f.metadata()
    changed = change(tensors)
    if fix_checksums:
        header = json.loads(metadata["qshard"])
        for record in header["entries"].values():
            for stored in record.get("inner", {}).values():
                if stored["key"] in changed:
                    data = tensors[stored["key"]].contiguous()
                    stored["crc32"], chunks = chunk_crcs(data, CHUNK_BYTES)
                    stored["chunk_crc32"] = list(chunks)
        text = json.dumps(header, separators=(",", ":"))
        metadata = {**metadata, "qshard": text, "qshard_crc32": f"{zlib.crc32(text.encode()):08x}"}
    save_file(tensors, path, metadata=metadata)


def _saved(tmp_path) -> pathlib.Path:
    model = tiny_llama()
    qshard.quantize_(model, qshard.Int4WeightOnlyConfig(group_size=32))
    model.save_pretrained(tmp_path)
    return tmp_path / "model.safetensors"


def test_nan_scale_is_refused_even_with_matching_checksums(tmp_path):
    key = "model.layers.1.mlp.up_proj.weight.scale"

    def nan_scale(tensors):
        tensors[key] = tensors[key].clone()
        tensors[key][3, 1] = float("nan")
        return {key}

    _rewrite(_saved(tmp_path), nan_scale, fix_checksums=True)
    with pytest.raises(qshard.CheckpointError, match=r"up_proj\.weight.*(NaN|finite)"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_flipped_byte_is_refused_by_its_checksum(tmp_path):
    key = "model.layers.0.self_attn.o_proj.weight.qdata"

    def flip(tensors):
        tensors[key] = tensors[key].clone()
        tensors[key][0, 0] ^= 0x10
        return {key}

    _rewrite(_saved(tmp_path), flip, fix_checksums=False)
    with pytest.raises(qshard.CheckpointError, match=r"o_proj\.weight.*checksum"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_a_flipped_float_tensor_is_refused_by_its_checksum(tmp_path):
    """transformers reads the float tensors itself; the quantizer verifies their CRC-32 first,
    as qshard.load does (a norm weight changed on disk loaded silently before)."""
    key = "model.layers.0.input_layernorm.weight"

    def change(tensors):
        tensors[key] = tensors[key].clone()
        tensors[key][0] = 4.0
        return {key}

    _rewrite(_saved(tmp_path), change, fix_checksums=False)
    with pytest.raises(qshard.CheckpointError, match=r"input_layernorm\.weight.*checksum"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(qshard.CheckpointError, match="checksum"):
        qshard.load(tmp_path)


def test_config_that_does_not_describe_the_checkpoint_is_refused(tmp_path):
    _saved(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        qshard.CheckpointError,
        match=r"gate_proj.weight. is \[96, 64\] in the checkpoint and \[128, 64\]",
    ):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_float_checkpoint_claiming_qshard_is_refused(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path)  # float
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = QShardConfig().to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(qshard.CheckpointError, match="holds no qshard-quantized tensor"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_a_qshard_config_without_a_config_says_what_to_pass(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    with pytest.raises(qshard.ConfigError, match=r"QShardConfig\(config=qshard\."):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=QShardConfig())


# ---- quantizing while loading ----------------------------------------------------------------


def _no_quantize_after_loading(monkeypatch):
    """Fail if from_pretrained falls back to quantize_ once loaded: every weight must have been
    quantized as it was read (the fallback is for tied or missing weights only)."""

    def refuse(*args, **kwargs):
        raise AssertionError("quantize_ ran after loading: a weight was not quantized as read")

    monkeypatch.setattr(qshard.api, "quantize_", refuse)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_quantizing_while_loading_equals_quantize_after_loading(tmp_path, monkeypatch, layout):
    tiny_llama().save_pretrained(tmp_path / "float")
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "float", dtype=torch.bfloat16)
    report = qshard.quantize_(expected, LAYOUTS[layout])
    with monkeypatch.context() as patch:
        _no_quantize_after_loading(patch)
        loaded = AutoModelForCausalLM.from_pretrained(
            tmp_path / "float",
            dtype=torch.bfloat16,
            quantization_config=QShardConfig(config=LAYOUTS[layout]),
        )
    assert assert_same_weights(expected, loaded) == len(report.quantized) == 14
    assert isinstance(loaded.lm_head.weight, torch.nn.Parameter)  # kept float, as quantize_ does
    groups = loaded.config.quantization_config.to_dict()["config_groups"]
    assert [g["config"] for g in groups.values()] == [LAYOUTS[layout].to_dict()]
    ids = torch.randint(0, 160, (1, 6))
    assert torch.equal(loaded(ids).logits, expected(ids).logits)
    # ... and it is a qshard model: save_pretrained writes a qshard checkpoint.
    loaded.save_pretrained(tmp_path / "quantized")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "quantized")
    assert assert_same_weights(expected, again) == 14


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_quantizing_moe_experts_while_loading(tmp_path, monkeypatch, name):
    # gpt-oss stores its experts transposed ([E, K, N]): quantized along K, as quantize_ does.
    moe_models.build(name).save_pretrained(tmp_path)
    config = qshard.Int4WeightOnlyConfig(group_size=32)
    expected = AutoModelForCausalLM.from_pretrained(tmp_path)
    report = qshard.quantize_(expected, config, include=["*.experts.*"])
    with monkeypatch.context() as patch:
        _no_quantize_after_loading(patch)
        loaded = AutoModelForCausalLM.from_pretrained(
            tmp_path, quantization_config=QShardConfig(config=config, include=["*.experts.*"])
        )
    assert assert_same_weights(expected, loaded) == len(report.quantized) == 4
    ids = torch.randint(0, moe_models.VOCAB, (1, 8))
    assert torch.equal(loaded(ids).logits, expected(ids).logits)


def test_quantizing_while_loading_refuses_a_checkpoint_of_another_shape(tmp_path):
    # transformers skips its own shape check for parameters a quantizer quantizes on load.
    tiny_llama().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    shapes = r"(\[96, 64\] in the checkpoint and \[128, 64\]|\[64, 96\] .* \[64, 128\])"
    with pytest.raises(qshard.CheckpointError, match=shapes + " in the model"):
        AutoModelForCausalLM.from_pretrained(
            tmp_path, quantization_config=QShardConfig(config=LAYOUTS["int4"])
        )


def test_quantizing_while_loading_a_converter_that_splits_one_tensor_into_several(tmp_path):
    # HRM-Text stores a fused gqkv / gate_up projection that transformers' converter chunks into
    # several parameters: one conversion call hands the quantizer all of them.
    from transformers import HrmTextConfig

    config = HrmTextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=32,
        H_cycles=1,
        L_cycles=1,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    int4 = LAYOUTS["int4"]
    expected = AutoModelForCausalLM.from_pretrained(tmp_path)
    report = qshard.quantize_(expected, int4)
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=QShardConfig(config=int4)
    )
    assert assert_same_weights(expected, loaded) == len(report.quantized) > 0


def test_quantizing_while_loading_leaves_tied_weights_to_quantize_(tmp_path):
    # A tied model whose checkpoint holds both keys (as converted checkpoints do): the head,
    # asked for, stays float and tied, as quantize_ leaves it, and a warning says why.
    from safetensors.torch import load_file

    model = tiny_llama()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = QShardConfig(config=LAYOUTS["int4"], include=["lm_head", "*.q_proj"], keep_float=[])
    with pytest.warns(UserWarning, match=r"stayed float: lm_head: its weight is tied"):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert not isinstance(loaded.lm_head.weight, qshard.QTensor)
    assert isinstance(loaded.model.layers[1].self_attn.q_proj.weight, qshard.Int4Tensor)


def test_quantizing_while_loading_names_the_weight_it_cannot_quantize(tmp_path):
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("inf")
    model.save_pretrained(tmp_path)
    with pytest.raises(qshard.QShardError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight'"):
        AutoModelForCausalLM.from_pretrained(
            tmp_path, quantization_config=QShardConfig(config=LAYOUTS["fp8_block"])
        )


def test_qshard_config_patterns_are_checked_and_a_string_is_one_pattern():
    config = QShardConfig(config=LAYOUTS["int4"], keep_float="lm_head")
    assert config.keep_float == ["lm_head"]
    with pytest.raises(qshard.ConfigError, match=r"include=5; pass a fnmatch pattern"):
        QShardConfig(config=LAYOUTS["int4"], include=5)


def test_quantizing_while_loading_selects_as_quantize_does(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    with pytest.raises(qshard.ConfigError, match=r"'layers\.\*' matches no weight.*'\*layers"):
        AutoModelForCausalLM.from_pretrained(
            tmp_path, quantization_config=QShardConfig(config=LAYOUTS["int4"], include="layers.*")
        )
    # A tied output head asked for is left float, tied, as quantize_ leaves it (and says).
    config = QShardConfig(config=LAYOUTS["int4"], include=["lm_head", "*.q_proj"], keep_float=[])
    model = tiny_llama()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(tmp_path / "tied")
    with pytest.warns(UserWarning, match=r"1 selected weights stayed float: lm_head: its weight"):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "tied", quantization_config=config)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert not isinstance(loaded.lm_head.weight, qshard.QTensor)
    quantized = [n for n, p in loaded.named_parameters() if isinstance(p, qshard.QTensor)]
    assert quantized == [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(2)]


def test_bad_quantization_config_is_a_typed_error():
    with pytest.raises(qshard.ConfigError, match="unknown fields"):
        QShardConfig.from_dict({"quant_method": "qshard", "bits": 4})
    with pytest.raises(qshard.ConfigError):
        QShardConfig(config_groups={"group_0": {"config": {"kind": "nope"}, "targets": []}})


# ---- registration ---------------------------------------------------------------------------


def test_an_older_transformers_is_not_registered_with(monkeypatch):
    import transformers

    from qshard.integrations import transformers as integration

    monkeypatch.setattr(transformers, "__version__", "4.57.1")
    with pytest.raises(ImportError, match=r"4\.57\.1 is older than 5\.23.*upgrade transformers"):
        integration.register()


def test_quantize_with_an_older_transformers_quantizes_and_warns(monkeypatch):
    # The integration module cannot load; quantize_ still quantizes and says what it cannot do.
    import transformers

    model = tiny_llama()
    monkeypatch.setattr(transformers, "__version__", "4.57.1")
    monkeypatch.delitem(sys.modules, "qshard.integrations.transformers")
    with pytest.warns(UserWarning, match=r"save_pretrained will not write this model"):
        qshard.quantize_(model, LAYOUTS["int4"])
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, qshard.Int4Tensor)


def test_registered_with_transformers_api():
    assert AUTO_QUANTIZATION_CONFIG_MAPPING["qshard"] is QShardConfig
    assert AUTO_QUANTIZER_MAPPING["qshard"] is QShardHfQuantizer


@pytest.mark.parametrize(
    "code",
    [
        "import qshard\nassert 'transformers' not in sys.modules\n"
        "import transformers.modeling_utils",
        "import transformers.modeling_utils\nimport qshard",
    ],
    ids=["qshard_first", "transformers_first"],
)
def test_registration_in_either_import_order(code):
    script = (
        f"import sys\n{code}\n"
        "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as m\n"
        "print(m['qshard'].__module__)"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["qshard.integrations.transformers"]


def test_save_pretrained_after_qshard_load(tmp_path):
    """qshard.load into a transformers model attaches qshard's quantizer, as quantize_ does:
    save_pretrained then writes qshard's format (it failed with torch's 'invalid python
    storage'), and from_pretrained reads it back bit for bit."""
    model = tiny_llama()
    qshard.quantize_(model, qshard.Int4WeightOnlyConfig(group_size=32))
    qshard.save(model, tmp_path / "first")
    with qshard.empty_weights():
        fresh = tiny_llama()
    qshard.load(tmp_path / "first", fresh)
    fresh.save_pretrained(tmp_path / "second")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "second")
    for name, param in model.named_parameters():
        if isinstance(param, qshard.QTensor):
            got = again.get_parameter(name)
            assert all(torch.equal(getattr(got, n), t) for n, t in param.inner_tensors().items())


def test_a_qshard_quantize_output_is_a_model_directory_transformers_loads(tmp_path):
    """`qshard quantize` (quantize_directory) writes config.json with qshard's
    quantization_config and copies the tokenizer and generation files: from_pretrained loads
    it as the model quantize_ gives (the same selection rule), weight for weight."""
    from qshard.cli.quantize import quantize_directory

    model = tiny_llama()
    model.save_pretrained(tmp_path / "float")
    (tmp_path / "float" / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    quantize_directory(tmp_path / "float", tmp_path / "q", "int4-g64", progress=False)
    for name in ("tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "q" / name).read_bytes() == (tmp_path / "float" / name).read_bytes()
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "qshard"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    expected = tiny_llama()
    qshard.quantize_(expected, qshard.Int4WeightOnlyConfig(group_size=64))
    assert assert_same_weights(expected, loaded) == 14  # 2 layers x 7 linears; lm_head float
    ids = torch.tensor([[1, 5, 9, 77, 3]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected(ids).logits)


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_an_index_naming_files_outside_the_checkpoint_is_refused(tmp_path, where):
    """qshard.load reads only inside the checkpoint's directory; from_pretrained of a qshard
    checkpoint does too (transformers itself opens whatever the index names)."""
    import shutil

    model = moe_models.qwen3_moe()
    qshard.quantize_(model, qshard.Fp8BlockwiseConfig(block_size=(32, 32)))
    directory = tmp_path / "ckpt"
    model.save_pretrained(directory, max_shard_size="100KB")
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    moved = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / "outside").mkdir()
    shutil.move(directory / moved, tmp_path / "outside" / moved)
    name = f"../outside/{moved}" if where == "parent" else str(tmp_path / "outside" / moved)
    index["weight_map"] = {k: name if v == moved else v for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    with pytest.raises(qshard.CheckpointError, match=r"names files outside that directory"):
        AutoModelForCausalLM.from_pretrained(directory)
    with pytest.raises(qshard.CheckpointError, match=r"file names in the index's directory"):
        qshard.load(directory, moe_models.qwen3_moe())


def test_half_is_refused_and_to_dtype_casts_whichever_way_the_model_was_quantized(tmp_path):
    """One behaviour for a model quantize_ quantized and one from_pretrained loaded quantized:
    transformers refuses `.half()` on both (its quantized-model rule), `.to(dtype)` casts."""
    model = moe_models.qwen3_moe()
    qshard.quantize_(model, qshard.Int4WeightOnlyConfig(group_size=32))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for quantized in (model, loaded):
        with pytest.raises(ValueError, match=r"`.half\(\)` is not supported for quantized model"):
            quantized.half()
        quantized.to(torch.float16)
        assert quantized.model.layers[0].self_attn.q_proj.weight.dtype == torch.float16
