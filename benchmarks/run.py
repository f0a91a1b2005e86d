"""Run envq's benchmark suite and write ``benchmarks.md`` and its charts.

From the project root::

    python -m benchmarks                  # the full run (~15-25 min on 2 cores)
    python -m benchmarks --quick          # small sizes, 3 repetitions (~2 min)
    python -m benchmarks --smoke          # tiny sizes, 2 repetitions (the test's mode)
    python -m benchmarks --only oneoff,periodic --out /tmp/bench
    python -m benchmarks --postgres       # also the job queues on PostgreSQL (~8 min more)

Sections (``--only``): oneoff, latency, periodic, memory, scaling, uvloop, profile.
The PostgreSQL comparison (``benchmarks/postgres.py``) runs only with ``--postgres``;
without it, the report keeps the PostgreSQL section of the report it replaces.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # ``python benchmarks/run.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import (
    latency,
    memory,
    oneoff,
    periodic,
    postgres,
    profiling,
    report,
    scaling,
)
from benchmarks._core import (
    MODES,
    ONEOFF_FIELDS,
    POOLS,
    Case,
    Config,
    cpu_model,
    have,
    load_average,
    memory_total,
    missing,
    now_utc,
    run_async,
    run_cases,
    versions,
)

SECTIONS = ("oneoff", "latency", "periodic", "memory", "scaling", "uvloop", "profile")
#: ``--postgres``: the PostgreSQL comparison's sizes in each mode.
PG_SIZES: dict[str, dict[str, Any]] = {
    "full": {"procs": (1, 2, 4), "n": 5000, "latency_jobs": 200, "rate": 100.0, "backlog": 100_000},
    "quick": {"procs": (1, 2, 4), "n": 2000, "latency_jobs": 100, "rate": 100.0, "backlog": 10_000},
    "smoke": {"procs": (1,), "n": 50, "latency_jobs": 10, "rate": 100.0, "backlog": 0},
}
ROOT = Path(__file__).resolve().parent.parent


def build_cases(cfg: Config, only: set[str]) -> list[Case]:
    cases: list[Case] = []
    if "oneoff" in only:
        cases += oneoff.cases(cfg) + oneoff.structure_cases(cfg)
    if "latency" in only:
        cases += latency.cases(cfg)
    if "periodic" in only:
        cases += periodic.cases(cfg)
    if "scaling" in only:
        cases += scaling.cases(cfg)
    if "uvloop" in only:
        cases += oneoff.uvloop_cases(cfg) + periodic.uvloop_cases(cfg)
    return cases


def _log(msg: str) -> None:
    print(msg, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="envq against a bare-asyncio floor and its peers; writes "
        "benchmarks.md and its charts (benchmarks-*.png).",
    )
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small sizes, 3 reps (~2 min)")
    mode.add_argument("--smoke", action="store_true", help="tiny sizes, 2 reps (the test)")
    ap.add_argument(
        "--only",
        metavar="CASES",
        default=",".join(SECTIONS),
        help=f"comma-separated sections to run (default: all of {','.join(SECTIONS)})",
    )
    ap.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        default=ROOT / "docs",
        help="where to write benchmarks.md and its charts (default: docs/)",
    )
    ap.add_argument("--reps", type=int, default=None, help="override the repetitions")
    ap.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    ap.add_argument("--json", metavar="FILE", type=Path, help="also save the raw results")
    ap.add_argument(
        "--postgres",
        action="store_true",
        help="also run the job queues on PostgreSQL (benchmarks/postgres.py; needs "
        "PostgreSQL's server programs): its section of the report",
    )
    ap.add_argument(
        "--render",
        metavar="FILE",
        type=Path,
        help="run nothing: write the report from results saved with --json",
    )
    args = ap.parse_args(argv)
    if args.render is not None:
        res = report.load(args.render)
        args.out.mkdir(parents=True, exist_ok=True)
        write(res, args.out, plot=not args.no_plot)
        return 0

    only = {s.strip() for s in str(args.only).split(",") if s.strip()}
    unknown = only - set(SECTIONS)
    if unknown:
        ap.error(f"unknown section(s) {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    cfg = MODES["quick" if args.quick else "smoke" if args.smoke else "full"]
    if args.reps is not None:
        if args.reps < 1:
            ap.error("--reps must be >= 1")
        cfg = Config(**{**cfg.__dict__, "reps": args.reps})
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)

    started = now_utc()
    load_start = load_average()
    machine = (
        f"{platform.system()} {platform.release()} {platform.machine()}, {cpu_model()}, "
        f"{os.cpu_count()} CPUs, {memory_total()} RAM"
    )
    vers = versions()
    _log(
        f"envq benchmarks: Python {vers['python']}, {sys.executable}; mode {cfg.mode}, "
        f"{cfg.reps} reps, sections {','.join(sorted(only))}"
    )
    _log(f"machine  {machine}")
    _log("software " + ", ".join(f"{k} {v}" for k, v in vers.items()))
    _log(f"load average at start: {load_start}")
    t_all = time.perf_counter()

    notes: list[str] = []
    for peer, what in (
        ("aiojobs", "aiojobs"),
        ("apscheduler", "APScheduler"),
        ("uvloop", "uvloop"),
    ):
        why = missing(peer)
        if why is not None:
            notes.append(f"{what} {why}: its cases were not run (`pip install -e '.[bench]'`).")
            _log(f"{what} {why}: its cases are not run")

    cases = build_cases(cfg, only)
    # Envelope construction is slow and never timed: build the pools up front.
    biggest = max([cfg.n, *(cfg.sizes if "scaling" in only else ())])
    t0 = time.perf_counter()
    POOLS.plain(biggest)
    if "scaling" in only:
        POOLS.delayed(max(cfg.sizes))
    if "oneoff" in only:
        for kind in ONEOFF_FIELDS:
            POOLS.oneoff(kind, max(cfg.n, cfg.n_structure))
    # The pools live through the run: keep the collector from walking them every time.
    gc.freeze()
    _log(f"built the envelope pools in {time.perf_counter() - t0:.1f} s")

    # Warm-up (untimed): the first loop of the process pays for lazy imports and caches.
    warm = oneoff.SHAPES if "oneoff" in only else oneoff.SHAPES[:1]
    for _ in range(2):
        run_async(partial(oneoff.floor_run, POOLS.plain(1_000)))
        for shape in warm:
            shape.run(POOLS.oneoff(shape.kind, 1_000))

    run_cases(cases, cfg.reps, cfg.budget, _log)

    res = report.Results(
        cfg=cfg,
        cases={c.key: c for c in cases},
        started=started,
        machine=machine,
        versions=vers,
        load_start=load_start,
        notes=notes,
    )
    POOLS.drop()
    gc.unfreeze()
    gc.collect()
    if "memory" in only:
        _log("-- memory (tracemalloc)")
        res.memory, res.memory_lines = memory.measure(cfg)
        for row in res.memory:
            _log(f"   {row.label:<44} held {row.held:7.1f} B  item {row.item:7.1f} B")
    if "profile" in only and cfg.mode != "smoke":
        _log("-- profile (cProfile)")
        res.profiles = profiling.profiles(cfg)
    pg_section: str | None = None
    if args.postgres:
        _log("-- PostgreSQL job queues")
        pg = PG_SIZES[cfg.mode]
        t_pg = time.perf_counter()
        pg_result = asyncio.run(postgres.run_all(postgres.SYSTEMS, log=_log, **pg))
        pg_result["wall_s"] = round(time.perf_counter() - t_pg, 1)
        _log(postgres.table(pg_result))
        pg_section = postgres.section(pg_result, command="python -m benchmarks --postgres")
        if args.json is not None:
            pg_json = args.json.with_name(args.json.stem + ".postgres.json")
            pg_json.write_text(json.dumps(pg_result, indent=2) + "\n", encoding="utf-8")
    res.load_end = load_average()
    res.wall = time.perf_counter() - t_all

    if args.json is not None:
        report.save(res, args.json)
    write(res, out_dir, plot=not args.no_plot, postgres_section=pg_section)

    _log("")
    _log("targets:")
    for t in report.targets(res):
        verdict = "n/a " if t.ok is None else ("PASS" if t.ok else "MISS")
        _log(f"  {verdict}  {t.name}: {t.measured}  {t.detail}")
    rows = report.structure_rows(res)
    if rows:
        _log(f"structure, per {report.PER:,} envelopes (median; max when higher):")
        table = [list(report.STRUCTURE_HEAD), *rows]
        widths = [max(len(cells[i]) for cells in table) for i in range(len(table[0]))]
        for cells in table:
            line = "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))
            _log(f"  {line.rstrip()}")
    _log(f"load average at end: {res.load_end}")
    _log(f"total wall time {res.wall:.1f} s; wrote the report into {out_dir}")
    return 0


def write(
    res: report.Results, out_dir: Path, *, plot: bool, postgres_section: str | None = None
) -> None:
    """``benchmarks.md`` and (with matplotlib) its charts into ``out_dir``; the
    PostgreSQL section is ``postgres_section``, or else the one of the file replaced."""
    charts: list[str] = []
    if plot:
        if have("matplotlib"):
            charts = report.plot(res, out_dir)
        elif "matplotlib is not installed: no charts." not in res.notes:
            res.notes.append("matplotlib is not installed: no charts.")
    target = out_dir / "benchmarks.md"
    old = target.read_text(encoding="utf-8") if target.exists() else None
    text = postgres.splice(report.markdown(res, charts), postgres_section, old)
    target.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
