"""The rulebook: only the interpreter writes a state, and only one it looked up.

Walks the source of every runtime module of ``envq`` (the models in ``envq.model`` are
the machines themselves, the conformance oracle in ``envq.conform`` interprets the same
tables on its own side) and finds every assignment to an envelope's or the queue's
state. Each must sit in one of the interpreter's entry routines, and the value written
must not be a state spelled out in code: it comes from a lookup in ``envq._machine``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import envq

ROOT = Path(envq.__file__).resolve().parent
#: The interpreter's routines that may write a state: (file, function).
WRITERS = frozenset(
    {
        ("_envelope.py", "__init__"),  # a record's initial state, INITIAL
        ("_stats.py", "__init__"),  # the initial lifecycle state, INITIAL_QUEUE
        ("_stats.py", "enter"),  # every lifecycle move (called by the lifecycle only)
        ("_admission.py", "admit"),  # the initial envelope state, INITIAL
        ("_moves.py", "move"),
        ("_moves.py", "enter"),
        ("_crew.py", "serve"),  # the dispatch row, resolved once per queue
    }
)
STATE_ATTRS = frozenset({"state", "_state"})
STATE_ENUMS = frozenset({"EnvState", "QueueState"})


def runtime_modules() -> list[Path]:
    return sorted(
        p
        for p in ROOT.rglob("*.py")
        if p.relative_to(ROOT).parts[0] not in ("model", "conform", "demo")
    )


def _spelled_states(tree: ast.Module) -> set[str]:
    """Module-level names bound to a state member (``_READY = EnvState.READY``)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and _is_member(node.value, set()):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _is_member(value: ast.expr | None, aliases: set[str]) -> bool:
    if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name):
        return value.value.id in STATE_ENUMS
    return isinstance(value, ast.Name) and value.id in aliases


def state_writes(path: Path) -> list[tuple[str, int, bool]]:
    """(enclosing function, line, whether the value is a state spelled in code) for each
    assignment to a ``.state``/``._state`` attribute in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = _spelled_states(tree)
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            func = node.name
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets, value = [node.target], node.value
        for target in targets:
            elements = target.elts if isinstance(target, ast.Tuple) else [target]
            values = (
                value.elts
                if isinstance(value, ast.Tuple) and isinstance(target, ast.Tuple)
                else [value] * len(elements)
            )
            for element, written in zip(elements, values, strict=True):
                if isinstance(element, ast.Attribute) and element.attr in STATE_ATTRS:
                    found.append((func, node.lineno, _is_member(written, aliases)))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, "<module>")
    return found


def status_entries(path: Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of each call of a status's ``enter`` in ``path``
    (``<something>.status.enter(...)`` or ``status.enter(...)``)."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            func = node.name
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "enter"
            and "status" in ast.unparse(node.func.value)
        ):
            found.append((func, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, "<module>")
    return found


def _line_of(name: str, text: str) -> int:
    lines = (ROOT / name).read_text().splitlines()
    (line,) = [n for n, source in enumerate(lines, 1) if text in source]
    return line


class TestOnlyTheInterpreterWritesStates:
    """No module besides the interpreter writes an envelope or queue state."""

    def test_every_state_write_is_in_an_entry_routine(self) -> None:
        """Each assignment to a state sits in one of the interpreter's entry routines."""
        outside = [
            f"{path.relative_to(ROOT)}:{line} in {func}()"
            for path in runtime_modules()
            for func, line, _spelled in state_writes(path)
            if (path.relative_to(ROOT).as_posix(), func) not in WRITERS
        ]
        assert outside == []

    def test_no_state_is_written_without_a_lookup(self) -> None:
        """No assignment writes a state spelled in code (a member or an alias of one)."""
        spelled = [
            f"{path.relative_to(ROOT)}:{line} in {func}()"
            for path in runtime_modules()
            for func, line, is_spelled in state_writes(path)
            if is_spelled
        ]
        assert spelled == []

    def test_only_the_lifecycle_moves_the_queue(self) -> None:
        """The queue's state is entered (``Status.enter``) only where the lifecycle
        performs a row: in ``Lifecycle.set_state``, with the row's target."""
        callers = [
            f"{path.relative_to(ROOT)}:{line} in {func}()"
            for path in runtime_modules()
            for func, line in status_entries(path)
        ]
        assert callers == [
            f"_lifecycle.py:{_line_of('_lifecycle.py', 'status.enter(')} in set_state()"
        ]

    def test_the_walk_finds_the_writes(self) -> None:
        """The walk sees the interpreter's writes (so an empty result means something)."""
        writes = {func for func, _line, _s in state_writes(ROOT / "_moves.py")}
        assert {"enter", "move"} <= writes

    @pytest.mark.parametrize(
        ("source", "spelled"),
        [
            ("rec.state = EnvState.PARKED", True),
            ("_P = EnvState.PARKED\ndef f(rec):\n    rec.state = _P", True),
            ("def f(self, row):\n    self._state = row.target", False),
            ("def f(rec, to):\n    a, rec.state = 1, QueueState.INIT", True),
        ],
    )
    def test_the_walk_can_fail(self, tmp_path: Path, source: str, spelled: bool) -> None:
        """A state written from a constant is caught; one from a lookup is not."""
        path = tmp_path / "m.py"
        path.write_text(source + "\n")
        assert [s for _f, _l, s in state_writes(path)] == [spelled]


def import_graph() -> dict[str, set[str]]:
    """envq's modules and the envq modules each imports (``TYPE_CHECKING`` ones too)."""
    mods: dict[str, Path] = {}
    for path in ROOT.rglob("*.py"):
        parts = ("envq", *path.relative_to(ROOT).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[name] |= {t for t in targets if t in mods and t != "envq"}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import loops of ``graph`` (its strongly connected parts of two or more)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part: list[str] = []
            while True:
                top = stack.pop()
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest chain of modules each importing the next, in a graph without loops."""
    best: dict[str, list[str]] = {}

    def chain(node: str) -> list[str]:
        if node not in best:
            tails = [chain(nxt) for nxt in sorted(graph[node] - {node})]
            best[node] = [node, *max(tails, key=len, default=[])]
        return best[node]

    return max((chain(node) for node in sorted(graph)), key=len, default=[])


#: The names of methods that wire a part after it is made.
WIRING = frozenset({"attach", "bind"})

#: The longest chain of envq modules importing one another today (every import
#: counted, type-only ones too; a package's re-exports not): a ceiling that only
#: comes down as the layout is flattened.
CHAIN_CEILING = 15


class TestLayout:
    """The package's structure: no import loop, no module or class too large to read,
    import chains no longer than they are."""

    def test_no_module_is_over_800_lines(self) -> None:
        """Every module of envq reads in one sitting: at most 800 lines."""
        long = [
            f"{path.relative_to(ROOT)} ({n})"
            for path in sorted(ROOT.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > 800
        ]
        assert long == []

    def test_the_import_chains_grow_no_longer(self) -> None:
        """The longest chain of envq modules importing one another is at most
        :data:`CHAIN_CEILING` modules."""
        graph = import_graph()
        packages = {m for m in graph if any(o.startswith(f"{m}.") for o in graph)}
        modules = {m: deps - packages for m, deps in graph.items() if m not in packages}
        chain = longest_chain(modules)
        assert len(chain) <= CHAIN_CEILING, " -> ".join(chain)

    def test_no_part_is_wired_after_it_is_made(self) -> None:
        """Parts are made in dependency order, each given what it needs: no method of
        envq attaches a part or binds a loop once the part exists."""
        wiring = [
            f"{path.relative_to(ROOT)}:{node.lineno} {node.name}()"
            for path in sorted(ROOT.rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.FunctionDef) and node.name in WIRING
        ]
        assert wiring == []

    def test_a_chain_is_measured(self) -> None:
        """The chain finder can fail: it finds the longest of two chains."""
        graph = {"a": {"b", "d"}, "b": {"c"}, "c": set(), "d": set(), "e": {"a"}}
        assert longest_chain(graph) == ["e", "a", "b", "c"]

    def test_no_import_loop(self) -> None:
        """No envq module imports itself back, not even for type checking."""
        assert cycles(import_graph()) == []

    def test_a_loop_is_found(self) -> None:
        """The loop finder can fail: a two-module loop is reported."""
        graph = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
        assert cycles(graph) == [["a", "b"]]

    def test_the_queue_module_stays_small(self) -> None:
        """``_queue.py`` is at most 800 lines and no class in envq over 600."""
        assert len((ROOT / "_queue.py").read_text().splitlines()) <= 800
        large = [
            f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1})"
            for path in ROOT.rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef)
            and node.end_lineno is not None
            and node.end_lineno - node.lineno + 1 > 600
        ]
        assert large == []

    def test_neither_store_depends_on_the_other_s_driver(self) -> None:
        """The PostgreSQL store imports nothing of the in-process queue's conformance
        driver (their shared argument checks live in ``envq.conform.driving``), and
        the in-process engine nothing of envq.postgres."""
        graph = import_graph()
        pg = {m for m in graph if m.startswith("envq.postgres")}
        assert pg, "the walk found no envq.postgres module"
        assert sorted(m for m in pg if "envq.driver" in graph[m]) == []
        engine = {m for m in graph if m.startswith("envq._") and not m.startswith("envq.__")}
        assert sorted(m for m in engine if graph[m] & pg) == []
