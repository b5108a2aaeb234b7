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
    ("report", {"report", "live"}),  # views of runs: sources, rank merging, charts, compare, the HTML page, live
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


@pytest.mark.parametrize("view,readers", [("report", ("report", "live", "cli")), ("live", ("live", "cli"))])
def test_only_the_commands_import_the_views(view, readers):
    """The report (``report/``, also what the live view builds on) and the live view
    (``live/``) are read by the commands (``cli/``) alone: the runtime and what lies
    under it never build one."""
    found = sorted(
        f"{_file(a)} -> {_file(b)}"
        for a, targets in GRAPH.items()
        for b in targets
        if b.split(".")[1:2] == [view] and (a.split(".") + [""])[1] not in readers
    )
    assert not found, f"imports of {view}/ from outside the commands:\n" + "\n".join(found)


# -- ownership: the recorder's shared objects are written by their owners only ------------
# Another part asks the owner through a method named for what happens
# (``phases.open_container(at)``, ``step.backward_ran(...)``). Owners: the class's module,
# and for the open step's marks and phases the ``PhaseStack`` that records them.
OWNERS: dict[tuple[str, str], set[str]] = {
    ("record/phase_stack.py", "PhaseStack"): {"record/phase_stack.py"},
    ("record/timeline.py", "StepTimeline"): {"record/timeline.py", "record/phase_stack.py"},
    ("record/timeline.py", "BetweenSteps"): {"record/timeline.py"},
}
# Written outside the owners on purpose: (module, field) and why.
ALLOWED = {
    ("record/repeats.py", "marks"): "the repeat mode appends a repeated piece's marks in place: a method call "
    "at each of a step's boundaries costs more than the mode saves (benchmarks/opcodes.py)",
}
# Calls that change the container they are called on.
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "update", "add", "discard"}


def _fields(path: str, cls: str) -> set[str]:
    """``cls``'s attributes: its ``__slots__`` and what its methods assign on ``self``."""
    tree = ast.parse((PACKAGE / path).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    out: set[str] = set()
    for item in ast.walk(node):
        if isinstance(item, ast.Assign) and any(getattr(t, "id", None) == "__slots__" for t in item.targets):
            out |= {e.value for e in ast.walk(item.value) if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        for target, _ in _targets(item):
            if isinstance(target, ast.Attribute) and getattr(target.value, "id", None) == "self":
                out.add(target.attr)
    return out


def _targets(node: ast.AST) -> list[tuple[ast.expr, bool]]:
    """What ``node`` assigns to, tuples unpacked: (target, whether an item of it is
    assigned), a subscript down to its container."""
    if isinstance(node, ast.Assign):
        raw = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.Delete)):
        raw = list(node.targets) if isinstance(node, ast.Delete) else [node.target]
    else:
        return []
    out = []
    while raw:
        t = raw.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            raw += t.elts
        elif isinstance(t, ast.Starred):
            raw.append(t.value)
        else:
            item = isinstance(t, ast.Subscript)
            while isinstance(t, ast.Subscript):
                t = t.value
            out.append((t, item or isinstance(node, ast.AugAssign)))
    return out


def _foreign(expr: ast.expr, fields: set[str]) -> str | None:
    """``expr`` as text when it is ``<something other than self>.<a field>``."""
    if isinstance(expr, ast.Attribute) and expr.attr in fields:
        if not (isinstance(expr.value, ast.Name) and expr.value.id in ("self", "cls")):
            return ast.unparse(expr)
    return None


def _own_nodes(function: ast.AST):
    """The nodes of ``function``'s body, not those of functions defined inside it."""
    todo = list(ast.iter_child_nodes(function))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo += ast.iter_child_nodes(node)


def _mutated(node: ast.AST) -> ast.expr | None:
    """What a mutating method call (``x.append(...)``) is called on."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
        return node.func.value
    return None


def _writes(text: str, fields: set[str]) -> list[tuple[int, str]]:
    """(line, what) of each write to one of ``fields`` on another object: assignments
    (plain, augmented, annotated, ``del``, of an item), mutating calls
    (``x.marks.append(...)``), and those through a local name bound to such a field
    in the same function (``marks = step.marks; marks.append(...)``)."""
    tree = ast.parse(text)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        for target, _ in _targets(node):
            what = _foreign(target, fields)
            if what is not None:
                found.append((node.lineno, what))
        what = _foreign(_mutated(node), fields) if _mutated(node) is not None else None
        if what is not None:
            found.append((node.lineno, f"{what}.{node.func.attr}()"))
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        aliases: set[str] = set()
        for node in _own_nodes(function):  # local names bound to a field of another object
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    pairs = (
                        zip(t.elts, node.value.elts)
                        if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple)
                        else [(t, node.value)]
                    )
                    aliases |= {a.id for a, v in pairs if isinstance(a, ast.Name) and _foreign(v, fields)}
        if not aliases:
            continue
        for node in _own_nodes(function):
            for target, item in _targets(node):
                if item and isinstance(target, ast.Name) and target.id in aliases:
                    found.append((node.lineno, target.id))
            owner = _mutated(node)
            if isinstance(owner, ast.Name) and owner.id in aliases:
                found.append((node.lineno, f"{owner.id}.{node.func.attr}()"))
    return sorted(set(found))


def _reaches(path: str, text: str) -> bool:
    """Whether a module can hold the recorder's objects: the recorder, the wiring and
    the entry points, and any other module that names one of the classes (the
    pipeline's intake). The layers above hand each other finished records."""
    top = path.split("/")[0]
    return top in ("record", "runtime", "integrations") or "/" not in path or any(c in text for _, c in OWNERS)


def _foreign_writes() -> list[str]:
    fields = {key: _fields(*key) for key in OWNERS}
    out = []
    for name, path in MODULES.items():
        rel = str(path.relative_to(PACKAGE))
        text = path.read_text()
        if not _reaches(rel, text):
            continue
        owned = set().union(*(fields[key] for key, owners in OWNERS.items() if rel in owners))
        # (a name two classes share is left to the module owning one of them)
        forbidden = set().union(*(fields[key] for key, owners in OWNERS.items() if rel not in owners)) - owned
        forbidden -= {field for module, field in ALLOWED if module == rel}
        out += [f"otel_training/{rel}:{line}: {what}" for line, what in _writes(text, forbidden)]
    return out


def test_the_recorders_objects_are_written_by_their_owners():
    writes = _foreign_writes()
    assert not writes, (
        "fields of PhaseStack, StepTimeline or BetweenSteps written outside their owners "
        "(give the owner a method for it):\n" + "\n".join(writes)
    )


def test_the_owned_fields_are_read_from_the_classes():
    assert {"step", "stack", "batch", "closures", "after_step"} <= _fields("record/phase_stack.py", "PhaseStack")
    assert {"marks", "saw_backward", "batch_size", "layout_id"} <= _fields("record/timeline.py", "StepTimeline")


@pytest.mark.parametrize(
    "planted",
    [
        "def f(t):\n    t.phases.step.saw_backward = True\n",
        "def f(phases):\n    phases.closures += 1\n",
        "def f(step):\n    step.batch_size, step.token_count = 1, 2\n",
        "def f(step):\n    del step.marks[1:]\n",
        "def f(step):\n    step.marks[0] = 5\n",
        "def f(self):\n    self._phases.step.marks.append(0)\n",
        "def f(phases):\n    stack = phases.stack\n    stack.append(None)\n",
        "def f(step):\n    marks, n = step.marks, 0\n    marks += [n]\n",
    ],
)
def test_a_write_outside_the_owners_is_found(planted):
    """The check itself: each planted write is reported at its line."""
    fields = _fields("record/phase_stack.py", "PhaseStack") | _fields("record/timeline.py", "StepTimeline")
    found = _writes(planted, fields)
    assert found and found[0][0] == len(planted.splitlines()), found


@pytest.mark.parametrize(
    "allowed",
    [
        "def f(self):\n    self.marks = []\n",  # a class's own field of that name
        "def f(step):\n    marks = step.marks\n    return len(marks)\n",  # a read
        "def f(step):\n    marks = step.marks\n    marks = []\n",  # the name rebound
        "def f(step):\n    return step.phases.count(None)\n",
    ],
)
def test_reads_and_own_fields_are_no_write(allowed):
    fields = _fields("record/timeline.py", "StepTimeline")
    assert _writes(allowed, fields) == []
