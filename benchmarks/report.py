"""Writing the results: ``benchmarks.md`` (tables, targets, machine) and
its charts, one per question (matplotlib, Agg backend)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._core import DEADLINE, INTERVAL, WORKERS, Case, Config, median, paired
from benchmarks.memory import MemRow
from benchmarks.oneoff import SHAPES

#: Targets from the issues.
TARGET_RATIO = 0.6  # plain envq one-off throughput, send(*envs), >= 0.6 x the floor
STRETCH_RATIO = 0.7
#: One-off throughput of each envq shape (``oneoff.SHAPES``), × floor.
TARGET_SHAPES = {
    "envq": TARGET_RATIO,
    "envq1": 0.5,  # send(env) once per envelope
    "envq_deadline": 0.4,
    "envq_hooks": 0.25,  # before + after hooks + a queue stamp
}
#: While ``n_structure`` deadline envelopes run (``structure`` cases): collections of
#: generation 2 per 100k envelopes, TimerHandles created and Timeouts entered per envelope.
TARGET_GEN2 = 0.0
TARGET_TIMERS = 0.01
TARGET_TIMEOUTS = 0.0
PER = 100_000  # structure counts are reported per this many envelopes
TARGET_SEND_US = 1.0  # send(env), one at a time
TARGET_BYTES = 300.0  # the queue's own memory per queued (READY) envelope
TARGET_P99 = 1.2  # periodic aligned p99 lateness <= 1.2 x raw call_at (issue 12)
TARGET_CPU = 1.5  # periodic aligned CPU <= 1.5 x raw call_at
TARGET_FLAT = 0.15  # throughput within +-15 % from the smallest to the largest size


@dataclass
class Results:
    cfg: Config
    cases: dict[str, Case]
    memory: list[MemRow] = field(default_factory=list)
    memory_lines: list[tuple[str, float]] = field(default_factory=list)
    profiles: list[str] = field(default_factory=list)
    started: str = ""
    machine: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    load_start: str = ""
    load_end: str = ""
    wall: float = 0.0
    notes: list[str] = field(default_factory=list)

    def get(self, key: str) -> Case | None:
        case = self.cases.get(key)
        return case if case is not None and case.ran else None


def save(res: Results, path: Path) -> None:
    """The raw results as JSON (``--json``), to re-render later with ``--render``."""
    data = {
        "cfg": asdict(res.cfg),
        "cases": [
            {
                "section": c.section,
                "key": c.key,
                "label": c.label,
                "note": c.note,
                "reps": c.reps,
                "metrics": c.metrics,
                "wall": c.wall,
                "skipped": c.skipped,
                "error": c.error,
            }
            for c in res.cases.values()
        ],
        "memory": [asdict(m) for m in res.memory],
        "memory_lines": res.memory_lines,
        **{
            k: getattr(res, k)
            for k in ("profiles", "started", "machine", "versions", "load_start", "load_end")
        },
        "wall": res.wall,
        "notes": res.notes,
    }
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")


def load(path: Path) -> Results:
    data = json.loads(path.read_text(encoding="utf-8"))
    cfg = data.pop("cfg")
    cfg["sizes"] = tuple(cfg["sizes"])
    cases: dict[str, Case] = {}
    for c in data.pop("cases"):
        case = Case(c["section"], c["key"], c["label"], dict, note=c["note"])
        case.reps, case.metrics, case.wall = c["reps"], c["metrics"], c["wall"]
        case.skipped, case.error = c["skipped"], c["error"]
        cases[case.key] = case
    memory = [MemRow(**m) for m in data.pop("memory")]
    lines = [(str(w), float(b)) for w, b in data.pop("memory_lines")]
    return Results(cfg=Config(**cfg), cases=cases, memory=memory, memory_lines=lines, **data)


# --------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------


def _fmt(v: float, spec: str) -> str:
    return "–" if math.isnan(v) else format(v, spec)


def _med_rng(xs: Sequence[float], spec: str) -> tuple[str, str]:
    if not xs:
        return "–", ""
    if len(xs) == 1:
        return _fmt(xs[0], spec), "(1 rep)"
    return _fmt(median(xs), spec), f"{_fmt(min(xs), spec)}–{_fmt(max(xs), spec)}"


def _cell(xs: Sequence[float], spec: str) -> str:
    med, rng = _med_rng(xs, spec)
    return med if not rng else f"{med} <sub>{rng}</sub>"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> list[str]:
    if not align:
        align = "l" + "r" * (len(head) - 1)
        if head[-1] in ("note", "detail"):
            align = align[:-1] + "l"
    marks = {"l": "---", "r": "---:", "c": ":---:"}
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join(marks[a] for a in align) + " |"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**PASS**" if ok else "**MISS**")


def _absent(case: Case | None, key: str, res: Results) -> str:
    raw = res.cases.get(key)
    if raw is None:
        return "not run (peer not installed)"
    if raw.error:
        return f"failed: {raw.error}"
    return raw.skipped or "not run"


# --------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    measured: str
    ok: bool | None
    detail: str = ""


def _us_per_item(c: Case) -> float:
    return median([1e6 / r for r in c.values("rate")])


def _shape_targets(res: Results) -> list[Target]:
    out: list[Target] = []
    floor = res.get("floor")
    for key, target in TARGET_SHAPES.items():
        raw = res.cases.get(key)
        name = f"one-off {raw.label if raw else key} ≥ {target:g}× floor"
        case = res.get(key)
        ratios = paired(floor, case, "seconds") if floor and case else []
        if not (floor and case and ratios):
            out.append(Target(name, "–", None, _absent(case, key, res) if raw else "not run"))
            continue
        r = median(ratios)
        detail = (
            f"{_us_per_item(case):.2f} µs/item vs floor {_us_per_item(floor):.2f}; "
            f"paired {min(ratios):.2f}–{max(ratios):.2f}"
        )
        if key == "envq":
            detail += "; stretch 0.7× " + ("met" if r >= STRETCH_RATIO else "missed")
        out.append(Target(name, f"{r:.2f}× floor", r >= target, detail))
    return out


def _per(case: Case, metric: str, per: float = PER) -> list[float]:
    """A structure count per ``per`` envelopes, for every repetition."""
    return [v * per / n for v, n in zip(case.values(metric), case.values("n"), strict=True)]


#: (metric, short name, what, target, per): the structure targets (deadline shape).
STRUCTURE_TARGETS = (
    ("gen2", "gen-2", f"generation-2 collections per {PER // 1000}k envelopes", TARGET_GEN2, PER),
    ("timers", "timers", "TimerHandles created per envelope", TARGET_TIMERS, 1),
    ("timeouts", "timeouts", "asyncio Timeouts entered per envelope", TARGET_TIMEOUTS, 1),
)


def _structure_targets(res: Results) -> list[Target]:
    out: list[Target] = []
    key = "struct_envq_deadline"
    case = res.get(key)
    for metric, _short, what, target, per in STRUCTURE_TARGETS:
        bound = f"{target:g}" if target == 0 else f"≤ {target:g}"
        name = f"deadline={DEADLINE:g}: {bound} {what}"
        if case is None:
            detail = _absent(None, key, res) if key in res.cases else "not run"
            out.append(Target(name, "–", None, detail))
            continue
        xs = _per(case, metric, per)
        n = median(case.values("n"))
        out.append(
            Target(
                name,
                f"{max(xs):g} (worst of {len(xs)} reps)",
                max(xs) <= target,
                f"counted over {n:,.0f} envelopes per repetition; median {median(xs):g}",
            )
        )
    return out


def targets(res: Results) -> list[Target]:
    out = _shape_targets(res) + _structure_targets(res)

    sends = [(n, res.get(f"sc_send_{n}")) for n in res.cfg.sizes]
    meds = [(n, median(c.values("us"))) for n, c in sends if c is not None]
    if meds:
        worst_n, worst = max(meds, key=lambda t: t[1])
        out.append(
            Target(
                f"send ≤ {TARGET_SEND_US:g} µs per envelope",
                f"{worst:.3f} µs (worst size, N={worst_n:,})",
                worst <= TARGET_SEND_US,
                ", ".join(f"{n:,}: {v:.3f}" for n, v in meds),
            )
        )
    ready = next((m for m in res.memory if m.key == "envq_ready"), None)
    if ready is not None:
        out.append(
            Target(
                f"≤ {TARGET_BYTES:.0f} B per queued envelope",
                f"{ready.held:.0f} B",
                ready.held <= TARGET_BYTES,
                f"queue's own memory, READY; the envelope itself is {ready.item:.0f} B",
            )
        )
    raw, env = res.get("raw_aligned"), res.get("envq_aligned")
    if raw and env:
        r99 = median(paired(env, raw, "p99"))
        rcpu = median(paired(env, raw, "cpu"))
        out.append(
            Target(
                f"periodic aligned p99 lateness ≤ {TARGET_P99}× raw call_at",
                f"{r99:.2f}× raw",
                r99 <= TARGET_P99,
                f"{median(env.values('p99')):.1f} ms vs {median(raw.values('p99')):.1f} ms",
            )
        )
        out.append(
            Target(
                f"periodic aligned CPU ≤ {TARGET_CPU}× raw call_at",
                f"{rcpu:.2f}× raw",
                rcpu <= TARGET_CPU,
                f"{median(env.values('cpu')):.3f} vs {median(raw.values('cpu')):.3f} CPU s/s",
            )
        )
    rates = [(n, res.get(f"sc_envq_{n}")) for n in res.cfg.sizes]
    ran = [(n, median(c.values("rate"))) for n, c in rates if c is not None]
    if len(ran) >= 2:
        ref = ran[0][1]
        devs = [(n, r / ref - 1) for n, r in ran]
        worst_dev = max(abs(d) for _, d in devs)
        missing = [n for n, c in rates if c is None]
        detail = ", ".join(f"{n:,}: {d:+.0%}" for n, d in devs)
        if missing:
            detail += "; not measured: " + ", ".join(f"{n:,}" for n in missing)
        out.append(
            Target(
                f"throughput within ±{TARGET_FLAT:.0%} from {ran[0][0]:,} to "
                f"{res.cfg.sizes[-1]:,} queued",
                f"worst {worst_dev:+.0%} vs N={ran[0][0]:,}",
                worst_dev <= TARGET_FLAT and not missing,
                detail,
            )
        )
    return out


# --------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------


def markdown(res: Results, charts: Sequence[str] = ()) -> str:
    """The report; ``charts``: the files of :data:`CHARTS` that were drawn."""
    cfg = res.cfg
    v = res.versions
    lines = [
        "# envq benchmarks",
        "",
        f"Generated by `python -m benchmarks{'' if cfg.mode == 'full' else ' --' + cfg.mode}` "
        f"on {res.started}: mode **{cfg.mode}**, {cfg.reps} repetitions of every case, "
        f"interleaved; total wall time {res.wall / 60:.1f} min. Every number is the "
        "**median** over the repetitions with the min–max range in small print; ratios "
        "are paired per repetition (a case against the baseline of the same repetition) "
        "and then summarised. The method is described at the end and in "
        "`benchmarks/README.md`.",
        "",
        f"- **Machine:** {res.machine}",
        f"- **Software:** Python {v.get('python', '?')}; envq {v.get('envq', '?')}; "
        f"aiojobs {v.get('aiojobs', '?')}; APScheduler {v.get('APScheduler', '?')}; "
        f"uvloop {v.get('uvloop', '?')}; matplotlib {v.get('matplotlib', '?')}",
        f"- **Load average** (1/5/15 min): {res.load_start} at start, {res.load_end} at end. "
        "On a shared machine other work skews absolute numbers; the paired ratios and the "
        "min–max ranges show how much.",
        "",
    ]
    lines += _glance(res, charts)
    lines += ["## Targets", ""]
    rows = [[t.name, t.measured, _verdict(t.ok), t.detail] for t in targets(res)]
    lines += _table(["target", "measured (median)", "verdict", "detail"], rows, "lrcl")
    lines += [""]
    lines += _oneoff(res) + _latency(res) + _periodic(res) + _memory(res)
    lines += _scaling(res) + _uvloop(res) + _profiles(res) + _method(res)
    if res.notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in res.notes] + [""]
    return "\n".join(lines).rstrip() + "\n"


def _ratio(case: Case | None, base: Case | None, metric: str) -> float | None:
    if case is None or base is None:
        return None
    ratios = paired(case, base, metric)
    return median(ratios) if ratios else None


def _med(case: Case | None, metric: str) -> float | None:
    return median(case.values(metric)) if case is not None and case.values(metric) else None


def summary(res: Results) -> list[tuple[str, str]]:
    """One sentence per question of :data:`CHARTS`, from the measured medians:
    (chart file, sentence)."""
    out: list[tuple[str, str]] = []
    floor = res.get("floor")
    envq = res.get("envq")
    rate, ratio = _med(envq, "rate"), _ratio(floor, envq, "seconds")
    if rate is not None and ratio is not None:
        peers = [
            (c.label, r)
            for key in ("aiojobs", "apscheduler", "taskgroup", "threads")
            if (c := res.get(key)) is not None and (r := _ratio(floor, c, "seconds")) is not None
        ]
        best = max(peers, key=lambda t: t[1], default=None)
        text = (
            f"envq runs {rate:,.0f} no-op one-off envelopes per second, "
            f"{ratio:.2f}× the bare `asyncio.Queue` floor (goal {TARGET_RATIO:g}×)"
        )
        if best is not None:
            text += f"; the fastest peer measured, {best[0]}, runs at {best[1]:.2f}×"
        out.append(("benchmarks-throughput.png", text + "."))
    lat, lat_floor = res.get("lat_envq"), res.get("lat_floor")
    p50, p99, f50 = _med(lat, "p50"), _med(lat, "p99"), _med(lat_floor, "p50")
    if p50 is not None and p99 is not None:
        text = (
            f"An idle queue starts a sent envelope's work in {p50:.0f} µs (p50; p99 {p99:.0f} µs)"
        )
        if f50 is not None:
            text += f"; the floor takes {f50:.0f} µs"
        out.append(("benchmarks-latency.png", text + "."))
    raw, per = res.get("raw_aligned"), res.get("envq_aligned")
    r99, rcpu = _ratio(per, raw, "p99"), _ratio(per, raw, "cpu")
    if r99 is not None and rcpu is not None:
        out.append(
            (
                "benchmarks-periodic.png",
                f"Periodic FIXED_RATE envelopes run {_med(per, 'p99'):.1f} ms late at p99, "
                f"{r99:.2f}× a raw `loop.call_at` schedule (goal ≤ {TARGET_P99:g}×), for "
                f"{rcpu:.2f}× its CPU (goal ≤ {TARGET_CPU:g}×).",
            )
        )
    ready = next((m for m in res.memory if m.key == "envq_ready"), None)
    if ready is not None:
        out.append(
            (
                "benchmarks-memory.png",
                f"A queued envelope costs the queue {ready.held:.0f} B (goal ≤ "
                f"{TARGET_BYTES:.0f} B), beside the {ready.item:.0f} B of the envelope itself.",
            )
        )
    xs, ys = _series(res, "envq", "rate")
    sends = _series(res, "send", "us")[1]
    if len(xs) >= 2 and sends:
        dev = max(abs(y / ys[0] - 1) for y in ys)
        out.append(
            (
                "benchmarks-scaling.png",
                f"From {xs[0]:,} to {xs[-1]:,} queued envelopes, throughput moves by at "
                f"most {dev:.0%} (goal ±{TARGET_FLAT:.0%}) and a send costs "
                f"{min(sends):.2f}–{max(sends):.2f} µs (goal ≤ {TARGET_SEND_US:g} µs).",
            )
        )
    return out


def _glance(res: Results, charts: Sequence[str]) -> list[str]:
    """The report's opening: per question, one sentence and its chart; then how many
    targets are met and where the PostgreSQL store's figures are."""
    said = dict(summary(res))
    lines = ["## At a glance", ""]
    for name, question in CHARTS:
        if name not in said and name not in charts:
            continue
        lines += [f"**{question}** {said.get(name, 'Not measured in this run.')}", ""]
        if name in charts:
            lines += [f"![{question}]({name})", ""]
    measured = [t for t in targets(res) if t.ok is not None]
    met = sum(1 for t in measured if t.ok)
    lines += [
        f"**Targets:** {met} of {len(measured)} met (the table below; red bars are envq, "
        "grey the floor, blue the peers, whiskers the min–max over the repetitions). "
        "envq.postgres against pgqueuer, procrastinate and a minimal durable queue: "
        "[PostgreSQL](#postgresql).",
        "",
    ]
    return lines


def _case_rows(
    res: Results, keys: Sequence[str], cols: Sequence[Callable[[Case], str]]
) -> list[list[str]]:
    rows: list[list[str]] = []
    for key in keys:
        raw = res.cases.get(key)
        if raw is None:
            continue
        case = res.get(key)
        if case is None:
            rows.append([raw.label] + ["–"] * (len(cols) - 1) + [_absent(None, key, res)])
            continue
        note = case.note + (f"; {case.skipped}" if case.skipped else "")
        rows.append([case.label] + [col(case) for col in cols[:-1]] + [note])
    return rows


def _oneoff(res: Results) -> list[str]:
    cfg = res.cfg
    floor = res.get("floor")
    keys = [
        "floor",
        *(shape.key for shape in SHAPES),
        "aiojobs",
        "apscheduler",
        "taskgroup",
        "threads",
    ]

    def ratio(c: Case) -> str:
        return _cell(paired(floor, c, "seconds"), ".2f") if floor else "–"

    def per_item(c: Case) -> str:
        return _fmt(_us_per_item(c), ".2f")

    rows = _case_rows(
        res, keys, [lambda c: _cell(c.values("rate"), ",.0f"), per_item, ratio, lambda c: ""]
    )
    out = [
        "## 1. One-off throughput",
        "",
        f"N = {cfg.n:,} one-off no-op work items (`async def noop(env): pass`), at most "
        f"{WORKERS} at a time; timed from the first submission until the last item has "
        "run. envq: `q.start(); q.send(...); await q.stop()` (DRAIN), in four shapes: "
        "no deadline and no hooks, sent as one batch or one `send(env)` per envelope; "
        f"`deadline={DEADLINE:g}`; before + after hooks and a queue stamp. Every case runs "
        "in each repetition with the floor; × floor is paired per repetition. Higher is "
        "better.",
        "",
    ]
    out += _table(["case", "items/s", "µs/item", "× floor", "note"], rows)
    return [*out, "", *_structure(res)]


def structure_rows(res: Results) -> list[list[str]]:
    """The structure cases: counts per 100k envelopes (median, max) and the verdicts
    against the deadline targets (which the issue asks of every path)."""
    rows: list[list[str]] = []
    for shape in SHAPES:
        key = f"struct_{shape.key}"
        raw = res.cases.get(key)
        if raw is None:
            continue
        case = res.get(key)
        if case is None:
            rows.append([shape.label, "–", "–", "–", "–", "–", "–", _absent(None, key, res)])
            continue

        def cell(metric: str, c: Case = case) -> str:
            xs = _per(c, metric)
            return f"{median(xs):,.0f}" + (f" (max {max(xs):,.0f})" if max(xs) > median(xs) else "")

        verdicts = [
            f"{short} {'PASS' if max(_per(case, metric, per)) <= target else 'MISS'}"
            for metric, short, _what, target, per in STRUCTURE_TARGETS
        ]
        rows.append(
            [
                shape.label,
                f"{median(case.values('n')):,.0f}",
                cell("gen0"),
                cell("gen1"),
                cell("gen2"),
                cell("timers"),
                cell("timeouts"),
                ", ".join(verdicts),
            ]
        )
    return rows


STRUCTURE_HEAD = (
    "case",
    "N per run",
    "gen-0 GCs",
    "gen-1 GCs",
    "gen-2 GCs",
    "TimerHandles",
    "Timeouts",
    "vs targets",
)


def _structure(res: Results) -> list[str]:
    rows = structure_rows(res)
    if not rows:
        return []
    return [
        f"### Structure: collections, timers and timeouts per {PER:,} envelopes",
        "",
        "For each shape, two more runs of *N per run* envelopes, each run as its timed "
        "case above (but not paired with the floor): the first counts the garbage "
        "collections of each generation (`gc.get_stats()` before and after), the "
        "second the `asyncio.TimerHandle`s created and the `asyncio.Timeout`s entered "
        "(`asyncio.timeout`/`timeout_at`), by wrapping `TimerHandle.__init__` and "
        "`Timeout.__aenter__` for that run only (see `benchmarks/README.md`). "
        f"Counts are per {PER:,} envelopes, median over the repetitions (max when "
        f"higher). Targets (for `deadline={DEADLINE:g}`, and on any path): "
        f"{TARGET_GEN2:g} generation-2 collections, ≤ {TARGET_TIMERS:g} TimerHandles "
        f"and {TARGET_TIMEOUTS:g} Timeouts per envelope. The envelope pools are "
        "`gc.freeze()`-d, as for the timed cases.",
        "",
        *_table(STRUCTURE_HEAD, rows, "lrrrrrrl"),
        "",
    ]


def _latency(res: Results) -> list[str]:
    keys = ["lat_floor", "lat_envq", "lat_aiojobs", "lat_task"]
    floor = res.get("lat_floor")

    def vs(c: Case) -> str:
        return _cell(paired(c, floor, "p50"), ".2f") if floor else "–"

    rows = _case_rows(
        res,
        keys,
        [
            lambda c: _cell(c.values("p50"), ".1f"),
            lambda c: _cell(c.values("p99"), ".1f"),
            vs,
            lambda c: "",
        ],
    )
    return [
        "## 2. Idle latency: send → start of the work",
        "",
        f"{res.cfg.latency_samples:,} items per repetition, one at a time into an idle system "
        f"({WORKERS} workers parked); `perf_counter()` before the submit and as the work's "
        "first statement. Lower is better.",
        "",
        *_table(["case", "p50 µs", "p99 µs", "p50 × floor", "note"], rows),
        "",
    ]


def _periodic(res: Results) -> list[str]:
    cfg = res.cfg
    keys = [
        "raw_aligned",
        "envq_aligned",
        "aps_aligned",
        "envq_delay_aligned",
        "raw_staggered",
        "envq_staggered",
        "aps_staggered",
    ]

    def vs(metric: str) -> Callable[[Case], str]:
        def f(c: Case) -> str:
            base = res.get("raw_aligned" if "aligned" in c.key else "raw_staggered")
            return _cell(paired(c, base, metric), ".2f") if base else "–"

        return f

    def runs(c: Case) -> str:
        r = median(c.values("runs"))
        missed = max(c.values("missed"), default=0.0)
        late = sum(c.values("late_setup"))
        s = f"{r:,.0f}"
        if missed > 0:
            s += f"; up to {missed:,.0f} missed in a rep"
        if late:
            s += f"; set-up overran the lead {late:.0f}×"
        if max(c.values("max"), default=0.0) > 0.9e3 * INTERVAL:
            s += "; lateness near 1 interval (read modulo the interval: may be more)"
        return s

    rows = _case_rows(
        res,
        keys,
        [
            lambda c: _cell(c.values("p50"), ".2f"),
            lambda c: _cell(c.values("p99"), ".2f"),
            lambda c: _cell(c.values("max"), ".1f"),
            lambda c: _cell(c.values("cpu"), ".3f"),
            vs("p99"),
            vs("cpu"),
            runs,
            lambda c: "",
        ],
    )
    return [
        "## 3. Periodic precision",
        "",
        f"{cfg.periodic:,} periodic items at a {1.0:g} s interval, observed for "
        f"{cfg.window:g} s: *aligned* (all due at the same instant) or *staggered* (spread "
        "evenly over the second). Lateness = actual start − scheduled slot on the item's "
        "grid, in ms; CPU = process CPU seconds per wall second over the window. Ratios "
        "are against raw `loop.call_at` with the same layout.",
        "",
        *_table(
            [
                "case",
                "p50 ms",
                "p99 ms",
                "max ms",
                "CPU s/s",
                "p99 × raw",
                "CPU × raw",
                "runs",
                "note",
            ],
            rows,
        ),
        "",
    ]


def _memory(res: Results) -> list[str]:
    if not res.memory:
        return []
    rows = [
        [
            m.label,
            f"{m.held:.0f}" if m.key != "envelope" else "–",
            f"{m.item:.0f}" if m.item else "–",
            f"{m.held + m.item:.0f}",
            f"{m.count:,}",
            m.note,
        ]
        for m in res.memory
    ]
    out = [
        "## 4. Memory per queued item",
        "",
        "`tracemalloc` after `gc.collect()`: memory held per queued (not yet running) item. "
        "*held* is what the queue or scheduler keeps; *item* is the object the user made "
        "(the envelope, the coroutine); *total* is both. Lower is better.",
        "",
        *_table(["what", "held B/item", "item B", "total B", "items", "note"], rows),
        "",
    ]
    if res.memory_lines:
        out += ["Where the READY sends' memory went (top allocation sites, B/item):", ""]
        out += [f"- `{where}`: {b:.1f}" for where, b in res.memory_lines if b >= 0.5]
        out += [""]
    return out


def _scaling(res: Results) -> list[str]:
    cfg = res.cfg
    first = res.get(f"sc_envq_{cfg.sizes[0]}")
    ref = median(first.values("rate")) if first else math.nan
    tp_rows, send_rows, timer_rows = [], [], []
    notes: list[str] = []
    for n in cfg.sizes:
        fl, en = res.get(f"sc_floor_{n}"), res.get(f"sc_envq_{n}")
        se, ti, rt = (
            res.get(f"sc_send_{n}"),
            res.get(f"sc_timers_{n}"),
            res.get(f"sc_rawtimers_{n}"),
        )
        for key in ("floor", "envq", "send", "timers", "rawtimers"):
            raw = res.cases.get(f"sc_{key}_{n}")
            if raw is not None and (raw.skipped or raw.error):
                notes.append(f"{raw.label}: {raw.error or raw.skipped}")
        tp_rows.append(
            [
                f"{n:,}",
                _cell(fl.values("rate"), ",.0f") if fl else "–",
                _cell(en.values("rate"), ",.0f") if en else "–",
                _cell(paired(fl, en, "seconds"), ".2f") if fl and en else "–",
                _fmt(median(en.values("rate")) / ref, ".2f") if en else "–",
            ]
        )
        send_rows.append([f"{n:,}", _cell(se.values("us"), ".3f") if se else "–"])
        timer_rows.append(
            [
                f"{n:,}",
                _cell(ti.values("send_us"), ".2f") if ti else "–",
                _cell(rt.values("send_us"), ".2f") if rt else "–",
                _cell(ti.values("cancel_ms"), ",.1f") if ti else "–",
                _cell(ti.values("cancel_us"), ".2f") if ti else "–",
                _cell(rt.values("cancel_us"), ".2f") if rt else "–",
            ]
        )
    out = [
        "## 5. Scaling with the number of queued envelopes",
        "",
        "Throughput with N one-off no-ops queued up front (as section 1):",
        "",
        *_table(
            ["N", "floor items/s", "envq items/s", "envq × floor", f"envq vs N={cfg.sizes[0]:,}"],
            tp_rows,
        ),
        "",
        "Send cost: `send(env)` one at a time into a RUNNING queue whose only worker is "
        "busy, so every envelope stays READY:",
        "",
        *_table(["N", "µs per send"], send_rows),
        "",
        "Timer heap: N envelopes sent with delays spread over [100, 200) s (each an "
        "entry in the queue's own timer heap, under one loop timer), then "
        "`await q.terminate()` parks them all and hands them back; raw = `loop.call_at` "
        "and `handle.cancel()` for the same delays:",
        "",
        *_table(
            [
                "N",
                "envq send µs",
                "raw call_at µs",
                "envq terminate ms",
                "envq terminate µs/env",
                "raw cancel µs/handle",
            ],
            timer_rows,
        ),
        "",
    ]
    if notes:
        out += ["Skipped:", ""] + [f"- {n}" for n in notes] + [""]
    return out


def _uvloop(res: Results) -> list[str]:
    pairs = [
        ("floor throughput, items/s", "floor", "uv_floor", "rate", ",.0f"),
        ("envq plain throughput, items/s", "envq", "uv_envq", "rate", ",.0f"),
        ("raw call_at aligned, p99 ms", "raw_aligned", "uv_raw_aligned", "p99", ".2f"),
        ("envq FIXED_RATE aligned, p99 ms", "envq_aligned", "uv_envq_aligned", "p99", ".2f"),
        ("raw call_at aligned, CPU s/s", "raw_aligned", "uv_raw_aligned", "cpu", ".3f"),
        ("envq FIXED_RATE aligned, CPU s/s", "envq_aligned", "uv_envq_aligned", "cpu", ".3f"),
    ]
    if not any(res.get(uv) for _, _, uv, _, _ in pairs):
        return ["## 6. uvloop", "", "Not run (uvloop not installed).", ""]
    rows = []
    for label, a_key, u_key, metric, spec in pairs:
        a, u = res.get(a_key), res.get(u_key)
        rows.append(
            [
                label,
                _cell(a.values(metric), spec) if a else "–",
                _cell(u.values(metric), spec) if u else "–",
                _cell(paired(u, a, metric), ".2f") if a and u else "–",
            ]
        )
    uf, ue = res.get("uv_floor"), res.get("uv_envq")
    extra = []
    if uf and ue:
        extra = [
            "",
            f"On uvloop, envq plain throughput is "
            f"{median(paired(uf, ue, 'seconds')):.2f}× the uvloop floor.",
        ]
    return [
        "## 6. uvloop on/off",
        "",
        "The same cases on `uvloop.new_event_loop()` (asyncio columns: sections 1 and 3 of "
        "the same run). uvloop's clock has millisecond resolution, so its lateness "
        "figures are quantised to 1 ms.",
        "",
        *_table(["case", "asyncio", "uvloop", "uvloop ÷ asyncio"], rows),
        *extra,
        "",
    ]


def _profiles(res: Results) -> list[str]:
    if not res.profiles:
        return []
    out = [
        "## Profile",
        "",
        "`cProfile`, one extra run each after the timed sections (profiling inflates every "
        "call: read proportions, not absolute times). `tottime` = own time.",
        "",
    ]
    for text in res.profiles:
        title, _, body = text.partition("\n\n")
        out += [f"**{title}**", "", "```text", body, "```", ""]
    return out


def _method(res: Results) -> list[str]:
    return [
        "## Method",
        "",
        "- One process; every case repetition gets a fresh event loop "
        "(`asyncio.Runner`) and `gc.collect()` right before its timed region, which is "
        "timed with `time.perf_counter()`.",
        "- Interleaved: each repetition runs every section, and every case of a section "
        "once in an order rotated by one per repetition, so drift and background load "
        "hit all cases alike.",
        "- Envelopes are built once and reused (an envelope that has ended can be sent "
        "again); construction is never timed.",
        f"- A case whose repetition takes more than {res.cfg.budget:.0f} s is not repeated, "
        "and a scaling size that its smaller neighbour predicts to take longer is skipped; "
        "both say so in the tables.",
        "- The benchmark reports; it never fails on a missed target. Tests never time anything.",
        "",
    ]


# --------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------


def _empty(a: Any) -> None:
    a.text(0.5, 0.5, "not run", ha="center", va="center", transform=a.transAxes)
    a.set_xticks([])
    a.set_yticks([])


def _against_n(a: Any, has_data: bool, ylabel: str, legend_size: int) -> None:
    """Finish a panel plotted against N queued (log scale), or mark it not run."""
    if not has_data:
        _empty(a)
    else:
        a.set_xscale("log")
    a.set_ylim(bottom=0)
    a.set_xlabel("N queued", fontsize=9)
    a.set_ylabel(ylabel, fontsize=9)
    a.legend(fontsize=legend_size)
    a.grid(alpha=0.3)


#: The charts at the top of the report, one per question: (file name, question).
CHARTS = (
    ("benchmarks-throughput.png", "How fast does envq run one-off work?"),
    ("benchmarks-latency.png", "How long from send to the start of the work, when idle?"),
    ("benchmarks-periodic.png", "How punctual and how cheap are periodic envelopes?"),
    ("benchmarks-memory.png", "How much memory does a queued envelope cost?"),
    ("benchmarks-scaling.png", "Does it slow down as the backlog grows?"),
)

_ENVQ, _FLOOR, _PEER = "#d62728", "#7f7f7f", "#1f77b4"


def _bars(
    res: Results,
    a: Any,
    keys: Sequence[str],
    metric: str,
    title: str,
    xlabel: str,
    log: bool = False,
) -> None:
    """Horizontal bars of ``metric``'s median per case, min–max as error bars; envq red,
    the floor grey, the peers blue."""
    labels, meds, lo, hi, colors = [], [], [], [], []
    for key in keys:
        case = res.get(key)
        if case is None or not case.values(metric):
            continue
        xs = case.values(metric)
        m = median(xs)
        labels.append(case.label)
        meds.append(m)
        lo.append(m - min(xs))
        hi.append(max(xs) - m)
        floorish = "floor" in key or "raw" in key
        colors.append(_ENVQ if "envq" in key else (_FLOOR if floorish else _PEER))
    a.set_title(title, fontsize=11)
    if not labels:
        _empty(a)
        return
    y = list(range(len(labels)))
    a.barh(y, meds, xerr=[lo, hi], color=colors, capsize=3)
    a.set_yticks(y, labels, fontsize=9)
    a.invert_yaxis()
    a.set_xlabel(xlabel, fontsize=9)
    if log and min(meds) > 0:
        a.set_xscale("log")
    elif max(meds) >= 10_000:
        a.xaxis.set_major_formatter(lambda v, _pos: f"{v / 1000:,.0f}k")
    a.grid(axis="x", alpha=0.3)


def _series(res: Results, kind: str, metric: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for n in res.cfg.sizes:
        case = res.get(f"sc_{kind}_{n}")
        if case is not None and case.values(metric):
            xs.append(n)
            ys.append(median(case.values(metric)))
    return xs, ys


def _draw_throughput(res: Results, fig: Any) -> None:
    peers = ["aiojobs", "apscheduler", "taskgroup", "threads"]
    keys = ["floor", *(shape.key for shape in SHAPES), *peers]
    _bars(res, fig.subplots(), keys, "rate", "One-off throughput", "items/s (higher is better)")


def _draw_latency(res: Results, fig: Any) -> None:
    left, right = fig.subplots(1, 2)
    keys = ["lat_floor", "lat_envq", "lat_aiojobs", "lat_task"]
    _bars(res, left, keys, "p50", "median (p50)", "µs (lower is better)")
    _bars(res, right, keys, "p99", "p99", "µs (lower is better)")


def _draw_periodic(res: Results, fig: Any) -> None:
    left, right = fig.subplots(1, 2)
    keys = [
        "raw_aligned",
        "envq_aligned",
        "aps_aligned",
        "envq_delay_aligned",
        "raw_staggered",
        "envq_staggered",
        "aps_staggered",
    ]
    _bars(res, left, keys, "p99", "lateness p99", "ms (log; lower is better)", log=True)
    _bars(res, right, keys, "cpu", "CPU", "CPU s per s (lower is better)")


def _draw_memory(res: Results, fig: Any) -> None:
    a = fig.subplots()
    mem = [m for m in res.memory if m.key != "envelope"]
    a.set_title("Memory per queued item", fontsize=11)
    if not mem:
        _empty(a)
        return
    y = list(range(len(mem)))
    a.barh(y, [m.held for m in mem], color=_ENVQ, label="held by the queue or scheduler")
    a.barh(y, [m.item for m in mem], left=[m.held for m in mem], color="#ff9896", label="the item")
    a.axvline(TARGET_BYTES, color="k", ls="--", lw=1, label=f"goal {TARGET_BYTES:.0f} B held")
    a.set_yticks(y, [m.label for m in mem], fontsize=9)
    a.invert_yaxis()
    a.set_xlabel("bytes per item (lower is better)", fontsize=9)
    a.legend(fontsize=8)


def _draw_scaling(res: Results, fig: Any) -> None:
    left, right = fig.subplots(1, 2)
    left.set_title("Throughput vs queued", fontsize=11)
    for kind, label, color in (("floor", "floor", _FLOOR), ("envq", "envq", _ENVQ)):
        xs, ys = _series(res, kind, "rate")
        left.plot(xs, ys, "o-", label=label, color=color)
    _against_n(left, bool(_series(res, "envq", "rate")[0]), "items/s", 8)
    for kind, metric, label, style in (
        ("send", "us", "envq send (READY)", "o-"),
        ("timers", "send_us", "envq send (DELAYED)", "s-"),
        ("rawtimers", "send_us", "raw call_at", "s--"),
        ("timers", "cancel_us", "envq terminate per env", "^-"),
        ("rawtimers", "cancel_us", "raw cancel per handle", "^--"),
    ):
        xs, ys = _series(res, kind, metric)
        right.plot(xs, ys, style, label=label)
    right.axhline(TARGET_SEND_US, color="k", ls=":", lw=1, label="send goal 1 µs")
    right.set_title("Cost per envelope vs queued", fontsize=11)
    has_data = bool(_series(res, "send", "us")[0] or _series(res, "timers", "send_us")[0])
    _against_n(right, has_data, "µs", 8)
    left.yaxis.set_major_formatter(lambda v, _pos: f"{v / 1000:,.0f}k")
    for a in (left, right):
        a.set_xticks(res.cfg.sizes, [f"{n:,}" for n in res.cfg.sizes], minor=False)
        a.xaxis.set_minor_formatter(lambda _v, _pos: "")


_DRAW: dict[str, Callable[[Results, Any], None]] = {
    "benchmarks-throughput.png": _draw_throughput,
    "benchmarks-latency.png": _draw_latency,
    "benchmarks-periodic.png": _draw_periodic,
    "benchmarks-memory.png": _draw_memory,
    "benchmarks-scaling.png": _draw_scaling,
}


def plot(res: Results, out_dir: Path) -> list[str]:
    """Draw :data:`CHARTS` into ``out_dir`` (matplotlib, Agg); the files written."""
    import matplotlib  # noqa: PLC0415 - the optional extra, on demand

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - the optional extra, on demand

    written = []
    for name, question in CHARTS:
        wide = name not in {"benchmarks-throughput.png", "benchmarks-memory.png"}
        fig = plt.figure(figsize=(11 if wide else 8, 4.2), layout="constrained")
        fig.suptitle(question, fontsize=12, fontweight="bold")
        _DRAW[name](res, fig)
        fig.savefig(out_dir / name, dpi=80)
        plt.close(fig)
        written.append(name)
    return written
