"""Functions run on a model once `quantize_` or `qshard.load` has put quantized weights in it.
The integrations register here (qshard/__init__.py registers the transformers one, which makes
`save_pretrained` write qshard's format), so that the core never imports them."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["register_model_hook", "run_model_hooks"]

_MODEL_HOOKS: list[Callable[[nn.Module], None]] = []


def register_model_hook(hook: Callable[[nn.Module], None]) -> None:
    """Run `hook(model)` after every `quantize_` and `qshard.load` that quantized `model`."""
    if hook not in _MODEL_HOOKS:
        _MODEL_HOOKS.append(hook)


def run_model_hooks(model: nn.Module) -> None:
    for hook in list(_MODEL_HOOKS):
        hook(model)
