"""Writes model.safetensors and config.json here with torchao itself (run once; CI only reads
them): the checkpoint of a 4-linear model saved by torchao's safetensors support, one tensor
subclass per convention qshard loads. Made with torchao 0.18.0 and torch 2.13.0 (CPU):

    PYTHONPATH=<torchao 0.18.0> python tests/data/torchao/make_fixture.py

Int4Tensor's own quantizer needs mslk (CUDA), so its tensors are computed here the way
mslk/fbgemm's `int4_row_quantize_zp` and `pack_int4` do and wrapped in torchao's Int4Tensor.
"""

import json
import pathlib

import torch
from safetensors.torch import save_file
from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict
from torchao.quantization import Float8Tensor, Int4Tensor, PerBlock, PerRow, PerTensor
from torchao.quantization.quantize_.workflows import QuantizeTensorToFloat8Kwargs

HERE = pathlib.Path(__file__).parent


def int4_row_quantize_zp(w: torch.Tensor, group: int):
    """fbgemm/mslk: min-max per group, 15 steps, zero = min + 8 * scale, q = code - 8."""
    chunks = w.float().reshape(-1, group)
    low, high = chunks.amin(1, keepdim=True), chunks.amax(1, keepdim=True)
    scale = (high - low).clamp(min=1e-6) / 15
    zero = low + scale * 8
    q = (chunks.sub(low).div(scale).round().clamp_(0, 15) - 8).to(torch.int8).reshape(w.shape)
    return (
        q,
        scale.view(w.shape[0], -1).t().contiguous(),
        zero.view(w.shape[0], -1).t().contiguous(),
    )


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Even index in the low nibble (two's complement), odd index in the high nibble."""
    return torch.bitwise_or(
        torch.bitwise_and(q[:, ::2], 0xF), torch.bitwise_left_shift(q[:, 1::2], 4)
    )


def main():
    torch.manual_seed(0)
    weights = {
        name: torch.randn(shape, dtype=torch.bfloat16) * 0.02
        for name, shape in {
            "rows": (96, 128),
            "rows_wo": (64, 96),
            "tensor": (48, 64),
            "blocks": (128, 256),
            "int4": (80, 256),
        }.items()
    }
    per_token = QuantizeTensorToFloat8Kwargs(granularity=PerRow())
    state = {
        "rows.weight": Float8Tensor.from_hp(
            weights["rows"], granularity=PerRow(), act_quant_kwargs=per_token
        ),
        "rows_wo.weight": Float8Tensor.from_hp(weights["rows_wo"], granularity=PerRow()),
        "tensor.weight": Float8Tensor.from_hp(
            weights["tensor"],
            granularity=PerTensor(),
            act_quant_kwargs=QuantizeTensorToFloat8Kwargs(granularity=PerTensor()),
        ),
        "blocks.weight": Float8Tensor.from_hp(
            weights["blocks"],
            granularity=PerBlock([128, 128]),
            act_quant_kwargs=QuantizeTensorToFloat8Kwargs(granularity=PerBlock([1, 128])),
        ),
        "rows.bias": torch.randn(96, dtype=torch.bfloat16),
    }
    q, scale, zero = int4_row_quantize_zp(weights["int4"], 128)
    state["int4.weight"] = Int4Tensor(
        pack_int4(q),
        scale.to(torch.bfloat16),
        zero.to(torch.bfloat16),
        [1, 128],
        weights["int4"].shape,
    )
    tensors, metadata = flatten_tensor_state_dict(state)
    save_file(tensors, str(HERE / "model.safetensors"), metadata=metadata)
    config = {"torch_dtype": "bfloat16", "quantization_config": {"quant_method": "torchao"}}
    (HERE / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    # What torchao dequantizes each weight to, for the test to compare with.
    expected = {
        k: v.dequantize()
        for k, v in state.items()
        if k.endswith("weight") and not isinstance(v, Int4Tensor)
    }
    save_file(expected, str(HERE / "torchao_dequantized.safetensors"))


if __name__ == "__main__":
    main()
