"""Small reference models that qshard quantizes, saves, loads and shards in its tests and demo."""

from .bert import BertConfig, BertModel, mean_pooled_embeddings

__all__ = ["BertConfig", "BertModel", "mean_pooled_embeddings"]
