"""Tuned kernel configs, keyed on (kernel family, weight format, N, K, M bucket), shipped per GPU.

A tuned file (`kernels/tuned/<gpu>.json`, written by `bench/tune_w4a16.py`) holds, for the
shapes it was tuned on, the config that measured fastest when it beat the built-in default by
more than the timing noise; every other shape and M runs the built-in default, which needs no
tuning. The file for a GPU is picked by its name (`torch.cuda.get_device_name`, lower case,
spaces as underscores: "NVIDIA H100 80GB HBM3" -> "nvidia_h100_80gb_hbm3" contains "h100"),
the longest matching tag first, as gemlite picks its configs. A file of one's own is added with
`load_tuned_configs(path)` or the QSHARD_TUNED_CONFIGS environment variable (a path).

File format (JSON): {"version": 1, "gpu": "<device name>", "triton": "<version>",
"configs": {"<family>/<format>/<N>x<K>/m<bucket>": {"BLOCK_N": ..., ...}}}.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError

__all__ = ["config_key", "gpu_tag", "load_tuned_configs", "m_bucket", "tuned_config"]

TUNED_DIR = Path(__file__).parent / "tuned"
TUNED_FORMAT_VERSION = 1
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
ENV_VAR = "QSHARD_TUNED_CONFIGS"

# Configs added by load_tuned_configs (and the environment variable), over the shipped ones.
_EXTRA: dict[str, dict[str, Any]] = {}


def m_bucket(m: int) -> int:
    """The M a config is tuned for: the smallest bucket >= m (the largest for larger m)."""
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


def config_key(family: str, fmt: str, n: int, k: int, m: int) -> str:
    return f"{family}/{fmt}/{n}x{k}/m{m_bucket(m)}"


def gpu_tag(name: str) -> str | None:
    """The shipped tuned file for a GPU called `name`, by tag, or None."""
    normalized = name.lower().replace(" ", "_")
    tags = sorted((p.stem for p in TUNED_DIR.glob("*.json")), key=len, reverse=True)
    return next((tag for tag in tags if tag in normalized), None)


def _read(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"tuned configs {str(path)!r} cannot be read: {error}") from None
    if not isinstance(data, dict) or data.get("version") != TUNED_FORMAT_VERSION:
        version = data.get("version") if isinstance(data, dict) else None
        raise ConfigError(
            f"tuned configs {str(path)!r}: version {version!r}, this qshard reads version "
            f"{TUNED_FORMAT_VERSION}; re-run bench/tune_w4a16.py"
        )
    configs = data.get("configs")
    if not isinstance(configs, dict) or not all(isinstance(v, dict) for v in configs.values()):
        raise ConfigError(f"tuned configs {str(path)!r}: 'configs' must map keys to objects")
    return configs


def load_tuned_configs(path: str | os.PathLike) -> None:
    """Use the configs in `path` (a file bench/tune_w4a16.py wrote) over the shipped ones."""
    _EXTRA.update(_read(Path(path)))


@functools.cache
def _shipped(device_name: str) -> dict[str, dict[str, Any]]:
    tag = gpu_tag(device_name)
    configs = _read(TUNED_DIR / f"{tag}.json") if tag else {}
    extra = os.environ.get(ENV_VAR)
    if extra:
        configs = {**configs, **_read(Path(extra))}
    return configs


def tuned_config(family: str, fmt: str, n: int, k: int, m: int, device: torch.device):
    """The tuned config for this shape on `device`'s GPU, or None (use the default)."""
    if device.type != "cuda":
        return None
    key = config_key(family, fmt, n, k, m)
    config = _EXTRA.get(key) or _shipped(_device_name(device.index)).get(key)
    return dict(config) if config is not None else None


@functools.cache
def _device_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)
