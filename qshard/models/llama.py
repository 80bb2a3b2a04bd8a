"""A compact Llama-style decoder (gpt-fast is the model of simplicity): RMSNorm, RoPE,
grouped-query attention over a static KV cache, a SwiGLU MLP; random initialisation from a
config (Llama-3.1-8B's shapes or small ones); a TP plan table; a greedy decode loop whose
one-token step works under `torch.compile(mode="reduce-overhead")`.

Every projection is an nn.Linear (fused q/k/v and o; fused gate/up and down: four GEMMs a
layer, each one GEMV at decode, as serving stacks fuse them), so `qshard.quantize_` and
`qshard.tp.parallelize(model, mesh, TP_PLAN)` apply unchanged. The fused rows are ordered so
that a column-parallel shard holds whole KV groups and whole gate/up units: under TP each rank
holds n_heads / world query heads and n_kv_heads / world KV heads, the attention infers its
local head counts from its projection's output size, and `setup_caches` sizes the cache for
them.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, InputMismatchError
from ..kernels.decode_attention import decode_attention, kernel_applies
from .moe import MoEFeedForward

__all__ = ["TP_PLAN", "Llama", "LlamaConfig", "decode_one_token", "generate", "prefill"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 128256
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    hidden: int = 14336
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    # Mixture of experts (`models/moe.py`): n_experts > 0 replaces every layer's feed-forward
    # by top-k of n_experts experts with intermediate size `expert_hidden`.
    n_experts: int = 0
    top_k: int = 0
    expert_hidden: int = 0
    # One-token steps against the KV cache run qshard's decode attention op where its kernels
    # apply (`kernels/decode_attention.py`: CUDA, fp16/bf16; split-K, only the filled positions
    # read); otherwise, and with False, F.scaled_dot_product_attention with the causal mask row.
    decode_kernel: bool = True

    def __post_init__(self):
        counts = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden")
        for field in (*counts, "n_experts", "top_k", "expert_hidden"):
            value = getattr(self, field)
            floor = 1 if field in counts else 0
            if not isinstance(value, int) or isinstance(value, bool) or value < floor:
                raise ConfigError(f"LlamaConfig: {field}={value!r} must be an int >= {floor}")
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads or self.head_dim % 2:
            raise ConfigError(
                f"LlamaConfig: dim={self.dim}, n_heads={self.n_heads}, n_kv_heads="
                f"{self.n_kv_heads}: n_heads must divide dim into an even head_dim (RoPE turns "
                "pairs of channels) and n_kv_heads must divide n_heads"
            )
        moe = (self.n_experts, self.top_k, self.expert_hidden)
        if any(moe) and not (
            self.n_experts and self.expert_hidden and self.top_k <= self.n_experts
        ):
            raise ConfigError(
                f"LlamaConfig: n_experts={self.n_experts}, top_k={self.top_k}, expert_hidden="
                f"{self.expert_hidden}: a mixture of experts needs all three, top_k <= n_experts "
                "(or all 0 for a dense feed-forward)"
            )
        if not isinstance(self.decode_kernel, bool):
            raise ConfigError(f"LlamaConfig: decode_kernel={self.decode_kernel!r}: True or False")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def llama_3_1_8b(cls) -> LlamaConfig:
        return cls()

    @classmethod
    def llama_3_1_70b(cls, n_layers: int = 80) -> LlamaConfig:
        """Llama-3.1-70B's shapes (hidden 8192, 64 query and 8 KV heads, MLP 28672)."""
        return cls(dim=8192, n_layers=n_layers, n_heads=64, hidden=28672)

    @classmethod
    def deepseek_v3_moe(cls, n_layers: int = 61) -> LlamaConfig:
        """DeepSeek-V3's MoE layers (its config.json: 256 routed experts of 2048, top-8, hidden
        7168, vocabulary 129280) under this model's grouped-query attention (56 heads of 128, 8
        KV heads) in place of MLA, with no shared expert and no dense first layers: a model
        of its expert shapes, not of DeepSeek-V3."""
        return cls(
            vocab_size=129280,
            dim=7168,
            n_layers=n_layers,
            n_heads=56,
            n_kv_heads=8,
            hidden=2048,
            rope_theta=10000.0,
            norm_eps=1e-6,
            n_experts=256,
            top_k=8,
            expert_hidden=2048,
        )

    @classmethod
    def qwen3_30b_a3b(cls, n_layers: int = 48) -> LlamaConfig:
        """Qwen3-30B-A3B's shapes (its config.json): 128 experts of 768, top-8, hidden 2048."""
        return cls(
            vocab_size=151936,
            dim=2048,
            n_layers=n_layers,
            n_heads=32,
            n_kv_heads=4,
            hidden=768,
            rope_theta=1e6,
            norm_eps=1e-6,
            n_experts=128,
            top_k=8,
            expert_hidden=768,
        )

    @classmethod
    def tiny(cls) -> LlamaConfig:
        """A small model with Llama's proportions, for tests and CPU demos."""
        return cls(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, hidden=768)


# Column-parallel fused q/k/v and gate/up (whole KV groups and gate/up units per rank),
# row-parallel o and down. TP N needs n_kv_heads and hidden / 128 divisible by N.
TP_PLAN = {
    "layers.*.attention.wqkv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w13": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
}


class KVCache(nn.Module):
    def __init__(self, batch: int, max_seq: int, kv_heads: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (batch, kv_heads, max_seq, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class Attention(nn.Module):
    """Grouped-query attention with q, k and v in one projection (one GEMM, one GEMV at decode).

    `wqkv`'s rows go KV group by KV group: for each KV head g, the query heads that share it,
    then k_g, then v_g, so any cut between groups (a column-parallel TP shard) holds whole groups
    and the same code runs on a rank's shard."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.head_dim = c.head_dim
        self.group_heads = c.n_heads // c.n_kv_heads  # query heads per KV head
        self.decode_kernel = c.decode_kernel
        self.wqkv = nn.Linear(c.dim, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x, rope, mask, input_pos):
        b, s, _ = x.shape
        rep = self.group_heads
        qkv = self.wqkv(x).view(b, s, -1, rep + 2, self.head_dim)  # local groups under TP
        q = qkv[:, :, :, :rep].reshape(b, s, -1, self.head_dim)
        k, v = qkv[:, :, :, rep], qkv[:, :, :, rep + 1]
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
        if self.kv_cache is not None and s == 1 and self.decode_kernel and kernel_applies(q, k):
            out = decode_attention(q, k, v, input_pos, self.head_dim**-0.5)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU with gate and up in one projection: `w13`'s rows alternate `UNIT` gate rows and
    the `UNIT` up rows of the same channels, so a column-parallel cut between pairs keeps
    each channel's gate and up together."""

    UNIT = 128

    def __init__(self, c: LlamaConfig):
        super().__init__()
        if c.hidden % self.UNIT and not c.n_experts:
            raise ConfigError(
                f"Llama: hidden={c.hidden} is not a multiple of the gate/up unit {self.UNIT}"
            )
        self.w13 = nn.Linear(c.dim, 2 * c.hidden, bias=False)  # [gate_i, up_i] per unit i
        self.w2 = nn.Linear(c.hidden, c.dim, bias=False)  # down

    def forward(self, x):
        b, s, _ = x.shape
        gate, up = self.w13(x).view(b, s, -1, 2, self.UNIT).unbind(3)
        return self.w2((F.silu(gate) * up).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.attention = Attention(c)
        self.ffn_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        if c.n_experts:
            self.feed_forward = MoEFeedForward(c.dim, c.n_experts, c.top_k, c.expert_hidden)
        else:
            self.feed_forward = FeedForward(c)

    def forward(self, x, rope, mask, input_pos):
        x = x + self.attention(self.attention_norm(x), rope, mask, input_pos)
        return x + self.feed_forward(self.ffn_norm(x))


def rope_table(c: LlamaConfig, max_seq: int, device=None) -> torch.Tensor:
    """[max_seq, head_dim / 2, 2]: cos and sin of each position's rotation per frequency."""
    freqs = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, device=device) / c.head_dim))
    angles = torch.outer(torch.arange(max_seq, device=device, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x [b, s, heads, head_dim] rotated by rope [s, head_dim / 2, 2] (pairs of channels)."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = rope[None, :, None, :, 0], rope[None, :, None, :, 1]
    real = pairs[..., 0] * cos - pairs[..., 1] * sin
    imag = pairs[..., 1] * cos + pairs[..., 0] * sin
    return torch.stack([real, imag], dim=-1).flatten(3).to(x.dtype)


class Llama(nn.Module):
    """tokens [b, s] and their positions [s] -> logits [b, s, vocab]."""

    def __init__(self, config: LlamaConfig, init_std: float = 0.02):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.max_seq = 0
        for p in self.parameters():
            if p.dim() in (2, 3) and p.device.type != "meta":
                nn.init.normal_(p, std=init_std)

    def setup_caches(self, batch: int, max_seq: int, tp_world: int = 1) -> None:
        """Static KV caches for `batch` sequences of up to `max_seq` tokens (on the weights'
        device and in the norm's dtype), sized for this rank's KV heads under TP."""
        c = self.config
        # (an MoE layer's experts are cut by the expert styles, which check their own sizes)
        units = tp_world if c.n_experts else c.hidden // FeedForward.UNIT
        if c.n_kv_heads % tp_world or units % tp_world:
            works = [
                n
                for n in range(1, c.n_kv_heads + 1)
                if c.n_kv_heads % n == 0 and (c.n_experts or units % n == 0)
            ]
            raise ConfigError(
                f"Llama: TP {tp_world} would split a KV group ({c.n_kv_heads} KV heads) or a "
                f"gate/up unit ({units} of {FeedForward.UNIT}); use a TP size in {works}"
            )
        device, dtype = self.norm.weight.device, self.norm.weight.dtype
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(
                batch, max_seq, c.n_kv_heads // tp_world, c.head_dim, dtype, device
            )
        self.register_buffer("rope", rope_table(c, max_seq, device), persistent=False)
        causal = torch.ones(max_seq, max_seq, dtype=torch.bool, device=device).tril()
        self.register_buffer("causal_mask", causal, persistent=False)
        self.max_seq = max_seq

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        if not self.max_seq:
            raise ConfigError("Llama: call model.setup_caches(batch, max_seq) before a forward")
        batch = self.layers[0].attention.kv_cache.k.shape[0]
        if tokens.shape[0] != batch or tokens.shape[1] > self.max_seq:  # shapes: no sync
            raise InputMismatchError(
                f"Llama: tokens {tuple(tokens.shape)} do not fit the caches of {batch} "
                f"sequences of {self.max_seq} positions; call setup_caches(batch, max_seq) "
                "with this batch and at least prompt + new tokens positions"
            )
        mask = self.causal_mask[None, None, input_pos]
        rope = self.rope[input_pos]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, rope, mask, input_pos)
        return self.output(self.norm(x))


def prefill(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    """Run the prompt [b, s] through the model; the greedy next token [b, 1]."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    return model(tokens, positions)[:, -1:].argmax(-1)


def decode_one_token(model: Llama, token: torch.Tensor, input_pos: torch.Tensor):
    """One greedy step: token [b, 1] at position input_pos [1] -> the next token [b, 1]. The
    function to compile (`mode="reduce-overhead"`: shapes never change between steps), with
    `torch._inductor.config.freezing = True` for quantized weights: unfrozen, each call unwraps
    every quantized weight in Python (docs/decode.md)."""
    return model(token, input_pos)[:, -1:].argmax(-1)


def generate(model: Llama, prompt: torch.Tensor, new_tokens: int, step=decode_one_token):
    """Greedy decoding: prompt [b, s] -> [b, s + new_tokens]. `step` may be a compiled
    `decode_one_token`."""
    if new_tokens < 1:
        return prompt
    if prompt.shape[1] + new_tokens > model.max_seq:
        raise InputMismatchError(
            f"generate: a prompt of {prompt.shape[1]} tokens and {new_tokens} new ones need "
            f"{prompt.shape[1] + new_tokens} positions; the caches hold {model.max_seq}: call "
            f"model.setup_caches(batch, max_seq) with max_seq >= {prompt.shape[1] + new_tokens}"
        )
    token = prefill(model, prompt)
    out = [prompt, token]
    position = torch.tensor([prompt.shape[1]], device=prompt.device)
    for _ in range(new_tokens - 1):
        # A copy: a CUDA-graph step (mode="reduce-overhead") overwrites its output next call.
        token = step(model, token, position).clone()
        out.append(token)
        position = position + 1
    return torch.cat(out, dim=1)
