"""qshard.models' mixture-of-experts Llama (`models/moe.py`, the model bench/bench_decode.py
times at Qwen3-30B-A3B's shapes): its experts are quantized as 3-D weights, its router stays
float, and the compiled decode step (inductor freezing, as the benchmark) equals eager."""

from __future__ import annotations

import pytest
import torch

import qshard
from qshard.models import Llama, LlamaConfig, decode_one_token, generate

CONFIG = LlamaConfig(
    vocab_size=256,
    dim=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    hidden=256,
    n_experts=8,
    top_k=2,
    expert_hidden=64,
)


def model() -> Llama:
    torch.manual_seed(0)
    m = Llama(CONFIG).eval()
    m.setup_caches(2, 32)
    return m


@torch.no_grad()
def test_experts_quantize_and_match_the_dequantized_model():
    m = model()
    report = qshard.quantize_(m, qshard.Int4WeightOnlyConfig(group_size=32))
    names = {q.name for q in report.quantized}
    assert "layers.1.feed_forward.experts.gate_up_proj" in names
    assert not any("router" in n for n in names)
    experts = m.layers[0].feed_forward.experts
    assert experts.gate_up_proj.shape == (8, 128, 128) and experts.down_proj.shape == (8, 128, 64)
    ids, pos = torch.randint(0, 256, (2, 8)), torch.arange(8)
    out = m(ids, pos)
    twin = model()  # the same model with every quantized weight dequantized
    for name, param in m.named_parameters():
        if isinstance(param, qshard.QTensor):
            twin.get_parameter(name).copy_(param.dequantize())
    assert qshard.sqnr_db(twin(ids, pos), out) > 40


@pytest.mark.slow
@torch.no_grad()
def test_compiled_decode_step_equals_eager():
    m = model()
    qshard.quantize_(m, qshard.Fp8BlockwiseConfig(block_size=(32, 32)))
    prompt = torch.randint(0, 256, (2, 6))
    eager = generate(m, prompt, new_tokens=3)
    torch._dynamo.reset()
    with torch._inductor.config.patch(freezing=True):
        step = torch.compile(decode_one_token, fullgraph=True)
        compiled = generate(m, prompt, new_tokens=3, step=step)
    assert torch.equal(compiled, eager)
