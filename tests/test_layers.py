"""The package's layers only point down: every import under ``otel_training/`` (at any
depth, inside functions and ``TYPE_CHECKING`` blocks included) goes to the same layer
or a lower one, no two modules import each other in a circle, no module is over
400 lines, and the package root holds at most 12 modules.

Read from the source with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "otel_training"
MAX_LINES = 400
MAX_ROOT_MODULES = 12

# Bottom to top. A module's layer is that of its package under otel_training/ (or, at
# the root, its own name); it may import from its own layer and the layers below.
LAYERS: list[tuple[str, set[str]]] = [
    ("foundation", {"version", "package", "semconv", "environment_variables", "config", "files", "handles"}),
    ("devices", {"timing", "hardware"}),
    ("record", {"record"}),  # the training thread
    ("aggregate", {"aggregate"}),  # the pipeline thread
    ("diagnosis", {"diagnosis"}),  # findings and run text, from the aggregates
    ("report", {"report"}),  # views of runs: sources, rank merging, charts, compare, the HTML page
    ("export", {"export"}),  # OpenTelemetry instruments, spans, files
    ("runtime", {"runtime", "integrations"}),  # the wiring; framework integrations
    ("entry points", {"instrumentor", "preflight", "distro"}),  # what opentelemetry-instrument loads
    ("api", {"api", "cli"}),  # the manual API and the commands
    ("package", {"__init__"}),  # otel_training/__init__.py
]
LAYER = {top: rank for rank, (_, tops) in enumerate(LAYERS) for top in tops}


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(name: str) -> str | None:
    """The module of ``name`` (itself, or the closest enclosing one that exists)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str) -> set[str]:
    """The package's modules that ``name`` imports."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    package = name if _is_package(name) else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            targets = [node.args[0].value]
        for target in targets:
            if target == "otel_training" or target.startswith("otel_training."):
                module = _resolve(target)
                if module is not None and module != name:
                    found.add(module)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _file(name: str) -> str:
    return str(MODULES[name].relative_to(PACKAGE.parent))


def _layer(name: str) -> int:
    parts = name.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    assert top in LAYER, f"{_file(name)}: in no layer of tests/test_layers.py's LAYERS"
    return LAYER[top]


def test_every_module_has_a_layer():
    for name in MODULES:
        _layer(name)


def test_imports_point_down():
    upward = [
        f"{_file(a)} ({LAYERS[_layer(a)][0]}) -> {_file(b)} ({LAYERS[_layer(b)][0]})"
        for a, targets in sorted(GRAPH.items())
        for b in sorted(targets)
        if _layer(b) > _layer(a)
    ]
    assert not upward, "imports that run back up:\n" + "\n".join(upward)


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    lines = []
    for component in _cycles():
        members = set(component)
        lines.append("circle: " + ", ".join(_file(m) for m in component))
        lines += [f"  {_file(a)} -> {_file(b)}" for a in component for b in sorted(GRAPH[a] & members)]
    assert not lines, "\n".join(lines)


def test_no_module_over_400_lines():
    long = {_file(n): len(p.read_text().splitlines()) for n, p in MODULES.items()}
    over = {f: n for f, n in sorted(long.items()) if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"


def test_at_most_12_modules_at_the_package_root():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at the package root: {root}"


@pytest.mark.parametrize(
    "source, module, expected",
    [
        ("from otel_training.runtime import processes", "otel_training.distro", "otel_training.runtime.processes"),
        ("from otel_training.config import Config", "otel_training.api", "otel_training.config"),
        ("from . import spans", "otel_training.export.metrics", "otel_training.export.spans"),
        ("from ..record import flops", "otel_training.export.metrics", "otel_training.record.flops"),
        ("import otel_training.instrumentor", "otel_training.preflight", "otel_training.instrumentor"),
    ],
)
def test_the_import_reader_resolves(monkeypatch, source, module, expected):
    """The reader itself: absolute, relative and submodule forms, inside a function too."""
    text = "def f():\n    " + source + "\n"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: text if self == MODULES[module] else "")
    assert _imports(module) == {expected}


def test_only_the_commands_import_the_report():
    """The report (``report/``) is read by the commands (``cli/``) alone: the runtime and
    what lies under it never build one."""
    readers = sorted(
        f"{_file(a)} -> {_file(b)}"
        for a, targets in GRAPH.items()
        for b in targets
        if b.split(".")[1:2] == ["report"] and a.split(".")[1:2] not in (["report"], ["cli"])
    )
    assert not readers, "imports of the report from outside the commands:\n" + "\n".join(readers)

