"""qshard's version, written into every checkpoint it saves (kept equal to pyproject.toml's)."""

__version__ = "0.1.0"
