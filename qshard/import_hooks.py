"""Run a function once a module is imported, without importing it now.

`import qshard` must not import `torch.distributed.tensor` (a third of a second, mostly sympy),
yet DTensor needs qshard's cache-key fix (qshard/dtensor_cache_key.py) before any DTensor of a
QTensor is compiled. `after_import("torch.distributed.tensor", fix)` runs `fix` at once if the
module is imported already, else right after whoever imports it first has executed it.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings
from collections.abc import Callable

__all__ = ["after_import"]


def after_import(name: str, callback: Callable[[], None]) -> None:
    if name in sys.modules:
        callback()
        return
    sys.meta_path.insert(0, _Finder(name, callback))


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it asks the finders after it for `name`'s spec and wraps that
    spec's loader so that `callback` runs (once) after the module has executed, and then
    removes itself."""

    def __init__(self, name: str, callback: Callable[[], None]):
        self.name, self.callback = name, callback
        self.searching = self.done = False

    def find_spec(self, fullname, path, target=None):
        # Not removed here: a mere probe (importlib.util.find_spec) must not use it up.
        if fullname != self.name or self.searching or self.done:
            return None
        self.searching = True  # the finders asked below may ask the meta path again
        try:
            for finder in sys.meta_path:
                find = None if finder is self else getattr(finder, "find_spec", None)
                spec = None if find is None else find(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self.searching = False
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_callback(module):
            exec_module(module)
            if self.done:
                return
            self.done = True
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            try:
                self.callback()
            except Exception as e:  # never break the user's import of the module
                warnings.warn(f"qshard: after importing {self.name}: {e!r}", stacklevel=2)

        # On this spec's own loader instance (a SourceFileLoader is made per file), so that
        # the module keeps its real __loader__.
        loader.exec_module = exec_then_callback
        return spec
