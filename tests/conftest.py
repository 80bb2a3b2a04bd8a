import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU the Triton kernels run under the Triton interpreter (set before they are first
# imported: @triton.jit reads it at decoration). Layouts never pick it by themselves
# (backend="auto" stays on the reference path on the CPU); tests force backend="triton".
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
