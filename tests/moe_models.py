"""Tiny random transformers mixture-of-experts models for the tests (imported as `moe_models`;
tests/ is on sys.path via conftest).

Each builder returns a fresh model in eval mode, the same weights on every call (its own seed;
the global RNG is left as it was). All share: hidden 64, 2 layers, 8 experts, top-2, a vocabulary
of 128, and expert intermediate sizes that are multiples of 32, so every layout's groups and
blocks (int4 g32, MXFP4 32, NVFP4 16, FP8 blocks of 32) fit every expert weight.

Weights are drawn with std 1/sqrt(hidden) (not transformers' 0.02): with 0.02 the experts' output
is a few percent of the residual stream and the logits barely see how the experts are quantized.
gpt-oss's expert biases (zeros at init) are made random and its SwiGLU limit small, so that the
biases and the clamp both matter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["BUILDERS", "build", "deepseek_v3", "gpt_oss", "mixtral", "qwen3_moe"]

HIDDEN = 64
EXPERTS = 8
TOP_K = 2
VOCAB = 128
STD = HIDDEN**-0.5

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=STD,
    num_experts_per_tok=TOP_K,
)


def qwen3_moe() -> nn.Module:
    """Qwen3MoeForCausalLM: experts [E, 2I, H] and [E, H, I], gate rows then up rows."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **COMMON,
        head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=EXPERTS,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return _seeded(lambda: Qwen3MoeForCausalLM(config), seed=1)


def gpt_oss() -> nn.Module:
    """GptOssForCausalLM: transposed experts [E, H, 2I] and [E, I, H], interleaved gate/up,
    biases, clamped SwiGLU (limit 1.0 here, so the clamp is hit)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        **COMMON,
        head_dim=16,
        intermediate_size=32,
        num_local_experts=EXPERTS,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=16,
        swiglu_limit=1.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )

    def make():
        model = GptOssForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                for bias in (layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias):
                    bias.normal_(0.0, 0.1)
        return model

    return _seeded(make, seed=2)


def deepseek_v3() -> nn.Module:
    """DeepseekV3ForCausalLM: MLA attention (q/kv LoRA, rope dims), layer 0 dense, layer 1 MoE
    with one shared expert; grouped top-k routing with one group."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    common = {**COMMON, "num_key_value_heads": 4}
    config = DeepseekV3Config(
        **common,
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=EXPERTS,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
    )
    return _seeded(lambda: DeepseekV3ForCausalLM(config), seed=3)


def mixtral() -> nn.Module:
    """MixtralForCausalLM: experts [E, 2I, H] and [E, H, I]."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**COMMON, head_dim=16, intermediate_size=32, num_local_experts=EXPERTS)
    return _seeded(lambda: MixtralForCausalLM(config), seed=4)


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "qwen3_moe": qwen3_moe,
    "gpt_oss": gpt_oss,
    "deepseek_v3": deepseek_v3,
    "mixtral": mixtral,
}


def build(name: str) -> nn.Module:
    """A fresh tiny model by its BUILDERS name."""
    return BUILDERS[name]()


def _seeded(make: Callable[[], nn.Module], seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make().eval()
