"""compressed-tensors checkpoints (llm-compressor's format, which vLLM and SGLang serve): the
checkpoint's quantization schemes and the format's notes (`schemes.py`), reading them into
qshard's layouts (`reading.py`) and writing them (`writing.py`)."""

from .reading import load
from .schemes import NAME, detect, schemes
from .writing import export

__all__ = ["NAME", "detect", "export", "load", "schemes"]
