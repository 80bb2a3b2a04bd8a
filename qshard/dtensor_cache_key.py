"""A fix for torch's AOT-autograd cache key of a DTensor whose local tensor is a QTensor.

torch (2.11-2.13) hashes a DTensor for the AOT autograd cache by its spec alone (mesh,
placements, shape, stride, dtype): DTensors of two quantized layouts, or of one layout with
different attributes (FP8 with fp32 vs ue8m0 scales: same inner shapes, other numerics), get the
same key, so a compiled graph of one runs on the other: an assertion at best (seen: an int4 TP
block ran the FP8 block's code), wrong numbers at worst. The key is extended here with the local
QTensor's own stable hash (class, attributes, inner tensor metadata); other DTensors keep theirs.
"""

from __future__ import annotations

import hashlib

import torch

from .qtensor import QTensor

__all__ = ["patch_dtensor_cache_key"]


def patch_dtensor_cache_key() -> None:
    if not torch.distributed.is_available():
        return
    # Already imported by then: this runs once torch.distributed.tensor is (qshard/__init__.py).
    from torch.distributed.tensor import DTensor

    original = getattr(DTensor, "_stable_hash_for_caching", None)
    if original is None or getattr(original, "qshard_patched", False):
        return

    def stable_hash(self) -> str:
        key = original(self)
        local = self._local_tensor
        if isinstance(local, QTensor):
            key = hashlib.blake2b(
                (key + local._stable_hash_for_caching()).encode(), digest_size=16
            ).hexdigest()
        return key

    stable_hash.qshard_patched = True
    DTensor._stable_hash_for_caching = stable_hash
