"""qshard's modules import in layers, lowest first, every import pointing down (docs/design.md,
"Layers"): no import circle of any size, no import of a higher layer, and an import inside a
function only where it is deferred on purpose (an optional dependency, or start-up time: DTensor,
Triton, transformers, the command line's commands), said by a comment on its line or the line
above. Read from the source with `ast`, so it holds for imports that a test run never executes."""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "qshard"

# Lowest first. A module belongs to the layer of its longest matching prefix.
LAYERS = [
    (
        "ground",
        [
            "qshard.errors",
            "qshard.config",
            "qshard.strict_json",
            "qshard.import_hooks",
            "qshard.shards",
            "qshard.version",
            "qshard.hooks",
        ],
    ),
    ("kernels", ["qshard.kernels"]),
    ("qtensor", ["qshard.qtensor"]),
    ("layouts", ["qshard.layouts"]),
    ("targets", ["qshard.targets"]),
    ("tp", ["qshard.tp", "qshard.dtensor_cache_key"]),
    ("io", ["qshard.io"]),
    ("formats", ["qshard.formats"]),
    ("api", ["qshard.api", "qshard.calibration", "qshard.metrics"]),
    ("integrations", ["qshard.integrations"]),
    ("models", ["qshard.models"]),
    ("commands", ["qshard.cli"]),
    ("package", ["qshard"]),
    # The command's torch-free entry point (it runs qshard.cli on use) and `python -m qshard`.
    ("entry", ["qshard_cli", "qshard.__main__"]),
]


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    in_function: bool
    commented: bool


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in [*PACKAGE.rglob("*.py"), PACKAGE.parent / "qshard_cli.py"]}


def layer_of(module: str) -> int:
    matches = [
        (len(prefix), i)
        for i, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} is in no layer: add it to LAYERS"
    return max(matches)[1]


def _targets(module: str, node: ast.ImportFrom | ast.Import, is_package: bool) -> list[str]:
    """The qshard modules an import statement imports (a name that is a submodule counts as it)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names if a.name.split(".")[0] in ("qshard", "qshard_cli")]
        return [_known(n) for n in names]
    if node.level:
        base = module.split(".")[: len(module.split(".")) - node.level + is_package]
        where = ".".join(base + ([node.module] if node.module else []))
    elif (node.module or "").split(".")[0] in ("qshard", "qshard_cli"):
        where = node.module
    else:
        return []
    return [
        f"{where}.{a.name}" if f"{where}.{a.name}" in MODULES else _known(where) for a in node.names
    ]


def _known(name: str) -> str:
    while name not in MODULES:
        name = name.rsplit(".", 1)[0]
    return name


def imports() -> list[Import]:
    found = []
    for module, path in MODULES.items():
        lines = path.read_text().splitlines()
        _visit(ast.parse("\n".join(lines)), module, path, lines, False, False, found)
    return found


def _visit(node, module, path, lines, in_function, type_checking, found) -> None:
    for child in ast.iter_child_nodes(node):
        function = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
        checking = type_checking or (
            isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
        )
        if isinstance(child, ast.Import | ast.ImportFrom) and not checking:
            line = child.lineno
            commented = "#" in lines[line - 1] or lines[line - 2].strip().startswith("#")
            targets = _targets(module, child, path.name == "__init__.py")
            if function and not targets:  # another package's module, deferred
                targets = [ast.unparse(child)]
            for target in targets:
                if target != module:
                    found.append(Import(module, target, line, function, commented))
        _visit(child, module, path, lines, function, checking, found)


IMPORTS = imports()


def test_every_module_is_in_a_layer():
    for module in MODULES:
        layer_of(module)


def test_no_import_points_up_a_layer():
    upward = [
        f"{i.source}:{i.line} ({LAYERS[layer_of(i.source)][0]}) imports {i.target} "
        f"({LAYERS[layer_of(i.target)][0]})"
        for i in IMPORTS
        if i.target in MODULES and layer_of(i.target) > layer_of(i.source)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_circle():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in IMPORTS:
        if i.target in MODULES:
            graph[i.source].add(i.target)
    circles = [c for c in _strongly_connected(graph) if len(c) > 1]
    assert not circles, circles


def test_an_import_inside_a_function_says_why():
    silent = [
        f"{i.source}:{i.line}: {i.target} inside a function, with no comment saying why"
        for i in IMPORTS
        if i.in_function and not i.commented
    ]
    assert not silent, "\n".join(silent)


def private_imports() -> list[str]:
    """`from <a qshard module> import _name` in another qshard module: what a module shares it
    names without the underscore (docs/design.md, "Layers")."""
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            targets = _targets(module, node, path.name == "__init__.py")
            if not targets or all(t == module for t in targets):
                continue
            private = [
                a.name for a in node.names if a.name.startswith("_") and not a.name.endswith("__")
            ]  # (a dunder is public)
            found += [f"{module}:{node.lineno} imports {n} from {targets[0]}" for n in private]
    return found


def test_no_private_name_is_imported_across_modules():
    assert not private_imports(), "\n".join(private_imports())


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(component)
    return components


@pytest.mark.parametrize(
    "graph, circles",
    [
        ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ],
)
def test_the_circle_finder_finds_circles(graph, circles):
    found = [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]
    assert found == circles
