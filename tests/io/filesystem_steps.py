"""The filesystem operations of a save, each made a step that calls `tick()` first: the crash
tests (test_save_crash.py) kill the save or fail it at the step-th one. Imported by the test
process and by its forked saver child."""

from __future__ import annotations

import builtins
import os

# Every os call a save may make on the checkpoint directory (pathlib calls these too).
OPERATIONS = (
    "mkdir",
    "rmdir",
    "replace",
    "rename",
    "link",
    "symlink",
    "unlink",
    "remove",
    "truncate",
    "ftruncate",
    "fsync",
)


def step_hooks(tick) -> list[tuple[object, str, object]]:
    """(module, name, replacement) for each os operation and for `open`: each operation, each
    open for writing and each write to such a file calls `tick()` before it runs."""

    def hooked(function):
        def call(*args, **kwargs):
            tick()
            return function(*args, **kwargs)

        return call

    class Writing:  # a file opened for writing: each write is a step
        def __init__(self, f):
            self.f = f

        def write(self, data):
            tick()
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    real_open = builtins.open

    def open_(file, mode="r", *args, **kwargs):
        if set(mode) & set("wax+"):
            tick()
            return Writing(real_open(file, mode, *args, **kwargs))
        return real_open(file, mode, *args, **kwargs)

    hooks = [(os, name, hooked(getattr(os, name))) for name in OPERATIONS]
    return [*hooks, (builtins, "open", open_)]
