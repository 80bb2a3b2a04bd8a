"""Tuned kernel configs, keyed on (kernel family, weight format, N, K, M bucket), shipped per GPU.

A tuned file (`kernels/tuned/<gpu>.json`, written by `bench/tune_w4a16.py`) holds, for the
shapes it was tuned on, the kernel and config that measured fastest where it beat the op's own
choice (its rule table) by more than the timing noise over the whole M bucket; every other
shape and M runs the rule table's choice. The file for a GPU is picked by what the GPU is, not
by its name: the shipped file of the same compute capability whose traits (SM count, shared
memory per SM, memory bandwidth: `gpu.GpuTraits`) are the nearest, so an H200 takes h200.json
and a Hopper GPU with no file of its own the closest one's, of which it takes only the kernel
choices (`_shipped`). A file of one's own is added with `load_tuned_configs(path)` or the
QSHARD_TUNED_CONFIGS environment variable (a path), and taken whole.

File format (JSON): {"version": 2, "gpu": "<device name>", "traits": {"capability": [9, 0],
"sms": ..., "smem_kib": ..., "bandwidth_gbs": ...}, "triton": "<version>",
"configs": {"<family>/<format>/<N>x<K>/m<bucket>": {"KERNEL": ..., ...}}}.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from .gpu import GpuTraits, traits

__all__ = [
    "config_key",
    "ignored",
    "load_tuned_configs",
    "m_bucket",
    "shipped_file",
    "tuned_config",
]

TUNED_DIR = Path(__file__).parent / "tuned"
TUNED_FORMAT_VERSION = 2
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
ENV_VAR = "QSHARD_TUNED_CONFIGS"

# Configs added by load_tuned_configs (and the environment variable), over the shipped ones.
_EXTRA: dict[str, dict[str, Any]] = {}
_IGNORED = [False]  # `ignored()`: the rule tables' own choices, for the tuner's baseline


def m_bucket(m: int) -> int:
    """The M a config is tuned for: the smallest bucket >= m (the largest for larger m)."""
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


def config_key(family: str, fmt: str, n: int, k: int, m: int) -> str:
    return f"{family}/{fmt}/{n}x{k}/m{m_bucket(m)}"


def shipped_file(gpu: GpuTraits, name: str = "") -> Path | None:
    """The shipped tuned file for a GPU of traits `gpu` called `name`: of the same compute
    capability, the nearest (`GpuTraits.distance`); of equally near files the one measured on
    a GPU of this name, then the first by file name; None where no file has its capability."""
    best, best_rank = None, None
    for path in sorted(TUNED_DIR.glob("*.json")):
        data = _load(path)
        distance = gpu.distance(_traits(path, data))
        if distance is None:
            continue
        rank = (distance, data.get("gpu") != name)
        if best_rank is None or rank < best_rank:
            best, best_rank = path, rank
    return best


def file_traits(path: Path) -> GpuTraits:
    """The traits of the GPU a tuned file was measured on."""
    return _traits(path, _load(path))


def _traits(path: Path, data: dict) -> GpuTraits:
    try:
        return GpuTraits.from_json(data["traits"])
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigError(
            f"tuned configs {str(path)!r}: 'traits' must hold the GPU's capability [major, "
            f"minor], sms, smem_kib and bandwidth_gbs ({type(error).__name__}: {error}); "
            f"re-run bench/tune_w4a16.py"
        ) from None


def _load(path: Path) -> dict:
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
    return data


def _read(path: Path, data: dict | None = None) -> dict[str, dict[str, Any]]:
    """The entries of a tuned file (`data`: its contents, where already loaded)."""
    configs = (data if data is not None else _load(path)).get("configs")
    if not isinstance(configs, dict) or not all(isinstance(v, dict) for v in configs.values()):
        raise ConfigError(f"tuned configs {str(path)!r}: 'configs' must map keys to objects")
    return configs


def load_tuned_configs(path: str | os.PathLike) -> None:
    """Use the configs in `path` (a file bench/tune_w4a16.py wrote) over the shipped ones."""
    _EXTRA.update(_read(Path(path)))


@contextlib.contextmanager
def ignored() -> Iterator[None]:
    """No tuned config inside: the op runs its rule tables' own choices (the tuner's
    baseline)."""
    before = _IGNORED[0]
    _IGNORED[0] = True
    try:
        yield
    finally:
        _IGNORED[0] = before


@functools.cache
def _shipped(index: int) -> dict[str, dict[str, Any]]:
    """The shipped entries for device `index`, then QSHARD_TUNED_CONFIGS's. From a file
    measured on a GPU of other traits (the nearest, not this one) only each entry's kernel
    choice is taken: its sizes (K splits, programs per SM, ring stages) were fitted to that
    GPU, so the kernel sizes itself for this one (w4a16/select.py)."""
    gpu = traits(index)
    path = shipped_file(gpu, torch.cuda.get_device_name(index))
    data = _load(path) if path else {"configs": {}}
    configs = _read(path, data)
    if path and _traits(path, data) != gpu:
        configs = {key: {"KERNEL": c["KERNEL"]} for key, c in configs.items() if "KERNEL" in c}
    extra = os.environ.get(ENV_VAR)
    if extra:
        configs = {**configs, **_read(Path(extra))}
    return configs


def tuned_config(family: str, fmt: str, n: int, k: int, m: int, device: torch.device):
    """The tuned config for this shape on `device`'s GPU, or None (the rule table's choice)."""
    if device.type != "cuda" or _IGNORED[0]:
        return None
    key = config_key(family, fmt, n, k, m)
    config = _EXTRA.get(key) or _shipped(device.index or 0).get(key)
    return dict(config) if config is not None else None
