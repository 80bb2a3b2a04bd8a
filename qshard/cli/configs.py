"""The `--config` names of `qshard quantize` and `qshard bench`: configs.json, the one table of
them (each name's config as `to_dict()` gives it), which `qshard_cli` reads as a file so that
`qshard --help` needs no torch import."""

from __future__ import annotations

import importlib.resources
import json

from ..config import QuantConfig, config_from_dict
from ..errors import ConfigError

__all__ = ["CONFIG_NAMES", "config_named"]

_CONFIGS = json.loads(importlib.resources.files(__package__).joinpath("configs.json").read_text())
CONFIG_NAMES = list(_CONFIGS)


def config_named(name: str) -> QuantConfig:
    """The config a `--config` name stands for."""
    if name not in _CONFIGS:
        raise ConfigError(f"qshard: config {name!r} is not one of {CONFIG_NAMES}")
    return config_from_dict(_CONFIGS[name])
