"""Small reference models that qshard quantizes, saves, loads and shards in its tests and demo."""

from .bert import TP_PLAN as BERT_TP_PLAN
from .bert import BertConfig, BertModel, mean_pooled_embeddings
from .llama import TP_PLAN, Llama, LlamaConfig, decode_one_token, generate, prefill
from .moe import EP_PLAN

__all__ = [
    "BERT_TP_PLAN",
    "EP_PLAN",
    "TP_PLAN",
    "BertConfig",
    "BertModel",
    "Llama",
    "LlamaConfig",
    "decode_one_token",
    "generate",
    "mean_pooled_embeddings",
    "prefill",
]
