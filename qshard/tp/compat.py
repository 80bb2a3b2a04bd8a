"""Moved to qshard/_dtensor_cache_key.py (outside qshard.tp, so that `import qshard` can apply it
when torch.distributed.tensor is first imported without importing qshard.tp)."""

from .._dtensor_cache_key import patch_dtensor_cache_key

__all__ = ["patch_dtensor_cache_key"]
