"""The state machines drawn as SVG, from the tables of :mod:`envq._machine`.

The edges are the tables' (the same source as ``specs/``): the envelope machine's are
``ENVELOPE_MOVES`` (the rows of ``QUEUE_MOVES`` and ``OUTCOMES``), the lifecycle's are
the rows of ``LIFECYCLE`` that change the state. The positions are a small layered
layout computed here: a state's column is its distance from the initial state, states
that lead nowhere else (the terminal ones) share the last column, and each column is
ordered by the mean row of the states leading into it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from enum import Enum
from typing import Final

import attrs

from envq._machine import (
    ENVELOPE_MOVES,
    INITIAL,
    INITIAL_QUEUE,
    LIFECYCLE,
    TERMINAL_STATES,
    EnvEvent,
    EnvState,
    Outcome,
    QueueState,
)

__all__ = ["Diagram", "DiagramEdge", "DiagramNode", "envelope_diagram", "lifecycle_diagram"]

_NODE_W: Final = 116.0
_NODE_H: Final = 44.0
_COL: Final = 215.0
_ROW: Final = 86.0
_PAD: Final = 24.0


@attrs.frozen
class DiagramNode:
    """A state, placed."""

    name: str
    x: float
    y: float
    width: float = _NODE_W
    height: float = _NODE_H
    #: Terminal (an envelope) or the initial state: drawn apart.
    terminal: bool = False
    initial: bool = False


@attrs.frozen
class DiagramEdge:
    """The events leading from one state to another, as one curve."""

    source: str
    target: str
    #: The events (queue-side) and outcomes (attempt ends) on this edge.
    events: tuple[str, ...]
    #: The tables its rows are in: ``QUEUE_MOVES``, ``OUTCOMES`` or ``LIFECYCLE``.
    table: str
    #: The SVG path.
    path: str
    #: Where its label goes.
    label_x: float
    label_y: float


@attrs.frozen
class Diagram:
    """A machine, placed: its size, states and edges."""

    width: float
    height: float
    nodes: tuple[DiagramNode, ...]
    edges: tuple[DiagramEdge, ...]


def _layers(
    states: Sequence[str], initial: str, edges: Mapping[tuple[str, str], object]
) -> dict[str, int]:
    """Each state's column: its distance from ``initial``; sinks (no edge to another
    state) in a last column of their own."""
    out: dict[str, set[str]] = {s: set() for s in states}
    for a, b in edges:
        out[a].add(b)
    sinks = {s for s in states if not out[s] and s != initial}
    depth = {initial: 0}
    frontier = [initial]
    while frontier:
        nxt: list[str] = []
        for s in frontier:
            for t in sorted(out[s], key=states.index):
                if t not in depth and t not in sinks:
                    depth[t] = depth[s] + 1
                    nxt.append(t)
        frontier = nxt
    last = max(depth.values(), default=0) + 1
    for s in states:
        depth.setdefault(s, last)
    return depth


def _place(
    states: Sequence[str], initial: str, edges: Mapping[tuple[str, str], object]
) -> dict[str, tuple[float, float]]:
    layer = _layers(states, initial, edges)
    columns: dict[int, list[str]] = {}
    for s in states:
        columns.setdefault(layer[s], []).append(s)
    rows: dict[str, float] = {}
    for col in sorted(columns):
        members = columns[col]

        def barycenter(s: str, members: list[str] = members) -> tuple[float, int]:
            preds = [rows[a] for a, b in edges if b == s and a in rows]
            mean = sum(preds) / len(preds) if preds else float(members.index(s))
            return mean, states.index(s)

        for i, s in enumerate(sorted(members, key=barycenter)):
            rows[s] = float(i)
    tallest = max(len(m) for m in columns.values())
    placed: dict[str, tuple[float, float]] = {}
    for col, members in columns.items():
        offset = (tallest - len(members)) / 2
        for s in members:
            placed[s] = (
                _PAD + col * _COL + _NODE_W / 2,
                _PAD + (rows[s] + offset) * _ROW + _NODE_H / 2,
            )
    return placed


def _border(cx: float, cy: float, dx: float, dy: float) -> tuple[float, float]:
    """Where the ray from a node's centre in direction (dx, dy) leaves its box."""
    scale = min(
        (_NODE_W / 2) / abs(dx) if dx else math.inf,
        (_NODE_H / 2) / abs(dy) if dy else math.inf,
    )
    return cx + dx * scale, cy + dy * scale


def _curve(a: tuple[float, float], b: tuple[float, float], bend: float) -> tuple[str, float, float]:
    """A quadratic curve from box ``a`` to box ``b``, bent sideways by ``bend``."""
    (ax, ay), (bx, by) = a, b
    length = math.hypot(bx - ax, by - ay) or 1.0
    nx, ny = -(by - ay) / length, (bx - ax) / length
    mx, my = (ax + bx) / 2 + nx * bend, (ay + by) / 2 + ny * bend
    sx, sy = _border(ax, ay, mx - ax, my - ay)
    ex, ey = _border(bx, by, mx - bx, my - by)
    # The curve passes halfway between the chord's middle and the control point.
    lx, ly = (sx + ex) / 4 + mx / 2, (sy + ey) / 4 + my / 2
    return f"M{sx:.1f},{sy:.1f} Q{mx:.1f},{my:.1f} {ex:.1f},{ey:.1f}", lx, ly


def _draw(
    states: Sequence[str],
    initial: str,
    terminal: Iterable[str],
    edges: Mapping[tuple[str, str], tuple[tuple[str, ...], str]],
) -> Diagram:
    placed = _place(states, initial, edges)
    ends = set(terminal)
    nodes = tuple(
        DiagramNode(
            s,
            placed[s][0] - _NODE_W / 2,
            placed[s][1] - _NODE_H / 2,
            terminal=s in ends,
            initial=s == initial,
        )
        for s in states
    )
    drawn: list[DiagramEdge] = []
    for (a, b), (events, table) in edges.items():
        (ax, ay), (bx, by) = placed[a], placed[b]
        span = abs(bx - ax) / _COL
        bend = 0.0
        if (b, a) in edges:
            bend = 22.0
        elif span != 1 or ax > bx:
            bend = 18.0 + 14.0 * max(span, abs(by - ay) / _ROW)
        path, lx, ly = _curve(placed[a], placed[b], bend)
        drawn.append(DiagramEdge(a, b, events, table, path, lx, ly))
    width = 2 * _PAD + max(n.x + n.width for n in nodes)
    height = 2 * _PAD + max(n.y + n.height for n in nodes)
    return Diagram(width, height, nodes, tuple(drawn))


def _name(event: Enum) -> str:
    return event.name


@functools.cache
def envelope_diagram() -> Diagram:
    """The envelope machine: ``ENVELOPE_MOVES``, one edge per (from, to)."""
    edges: dict[tuple[str, str], tuple[list[str], set[str]]] = {}
    for (state, event), targets in ENVELOPE_MOVES.items():
        table = "OUTCOMES" if isinstance(event, Outcome) else "QUEUE_MOVES"
        assert isinstance(event, EnvEvent | Outcome)
        for to in sorted(targets, key=list(EnvState).index):
            if to is state:
                continue
            names, tables = edges.setdefault((state.name, to.name), ([], set()))
            names.append(_name(event))
            tables.add(table)
    return _draw(
        [s.name for s in EnvState],
        INITIAL.name,
        [s.name for s in TERMINAL_STATES],
        {k: (tuple(v[0]), " + ".join(sorted(v[1]))) for k, v in edges.items()},
    )


@functools.cache
def lifecycle_diagram() -> Diagram:
    """The queue lifecycle: the rows of ``LIFECYCLE`` that change the state."""
    edges: dict[tuple[str, str], list[str]] = {}
    for (state, call), row in LIFECYCLE.items():
        if row.target is None or row.target is state:
            continue
        edges.setdefault((state.name, row.target.name), []).append(_name(call))
    return _draw(
        [s.name for s in QueueState],
        INITIAL_QUEUE.name,
        [QueueState.TERMINATED.name],
        {k: (tuple(v), "LIFECYCLE") for k, v in edges.items()},
    )
