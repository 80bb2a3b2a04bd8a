"""JSON from files qshard did not write itself: every parse failure is a `CheckpointError`.

`json.loads` raises `RecursionError` on deeply nested input (`"[" * 100000`) and `ValueError` on
an integer of more than 4300 digits (Python's int-string limit), besides `JSONDecodeError`; a
safetensors header, qshard's metadata, an index, `config.json` or `hf_quant_config.json` may hold
any of them (issue 21). Every reader parses through `parse_json` or `read_json_file`.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from .errors import CheckpointError

__all__ = ["parse_json", "read_json_file"]


def parse_json(text: str | bytes, where: str) -> Any:
    """The JSON value in `text`, or CheckpointError naming `where`."""
    try:
        return json.loads(text)
    except RecursionError:
        raise CheckpointError(
            f"{where}: the JSON is nested too deeply to parse; the file is "
            f"damaged or not what it claims to be"
        ) from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, huge integers
        raise CheckpointError(f"{where}: is not JSON ({e})") from None


def read_json_file(path: str | os.PathLike, expect: type = dict) -> Any:
    """The JSON value of the file at `path`, which must be an `expect` (an object by default),
    or CheckpointError naming the file."""
    path = pathlib.Path(path)
    try:
        text = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    value = parse_json(text, str(path))
    if not isinstance(value, expect):
        raise CheckpointError(
            f"{path}: a JSON {type(value).__name__}, expected a JSON "
            f"{'object' if expect is dict else expect.__name__}"
        )
    return value
