"""``envq conform``'s reports: a run's result per invariant and per table row, as
text or Markdown (with a port's classification of its divergences), the check of an
expectation file (``--expect``), and the counterexamples saved as scripts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

from envq._machine import ENVELOPE_MOVES, LIFECYCLE, OUTCOMES
from envq.conform.runner import KINDS, Classification, Finding, Result, load_classification
from envq.model.invariants import INVARIANTS

__all__ = ["check_expected", "load_expected", "report", "save_scripts"]


#: Which feature a table row needs (a row a port cannot reach is "not applicable").
def _needs(row: str) -> str | None:
    rules = (
        # first: an EXPIRED row needs leases whatever its row group
        ("EXPIRED", "leases"),
        ("PERIODIC", "periodic"),
        ("STOP_TYPE", "stop_type"),
        ("NO_RETRY", "no_retry"),
        (",STOP]", "stop_envelope"),
        ("TIMEOUT", "deadline"),
        ("CANCELLED", "stop_cancel"),
        ("BUFFERED", "buffer"),
        ("LIFECYCLE[INIT,", "buffer"),
        ("PARKED", "restart"),
        ("LIFECYCLE[STOPPED,START]", "restart"),
    )
    for needle, feature in rules:
        if needle in row:
            return feature
    return None


def _rows() -> list[str]:
    rows = [f"LIFECYCLE[{s.name},{c.name}]" for (s, c) in LIFECYCLE]
    rows += [f"OUTCOMES[{k.name},{o.name}]" for (k, o) in OUTCOMES]
    rows += [f"ENVELOPE_MOVES[{s.name},{e.name}]" for (s, e) in ENVELOPE_MOVES]
    return rows


def report(
    result: Result,
    out: TextIO,
    *,
    markdown: bool = False,
    classification: Classification | None = None,
) -> None:
    """Write the result: per invariant and per table row, then each finding with its
    counterexample (and, given a ``classification``, what kind of divergence each is)."""
    notes = classification.notes if classification is not None else {}
    driver = result.driver
    features = set(driver.get("features", []))
    rate = result.steps / result.seconds if result.seconds else 0.0
    verdict = "ERROR" if result.error else "PASS" if result.passed else "FAIL"
    head = (
        f"{driver.get('driver', '?')} {driver.get('version', '')} on the "
        f"{driver.get('clock', '?')} clock: {verdict}; {result.steps} steps in "
        f"{result.seconds:.1f} s ({rate:.0f} steps/s)"
    )
    violated: dict[str, list[Finding]] = {}
    for finding in result.findings:
        violated.setdefault(finding.check, []).append(finding)
        if finding.row:
            violated.setdefault(finding.row, []).append(finding)

    def status(name: str, checked: int, feature: str | None = None) -> str:
        found = violated.get(name, [])
        if any(not f.declared for f in found):
            return "violated"
        if found:
            return "declared divergence"
        if feature is not None and feature not in features:
            return "not applicable"
        return "checked" if checked else "not reached"

    if markdown:
        if classification is not None:
            _md_preamble(result, classification, out)
        out.write(f"**{head}**\n\n")
        if result.error:
            out.write(f"Driver error:\n\n```text\n{result.error}\n```\n\n")
        out.write("| invariant | checks | status |\n|---|---|---|\n")
        for inv in INVARIANTS:
            n = result.coverage.checks.get(inv.id, 0)
            out.write(f"| {inv.id} — {inv.title} | {n} | {status(inv.id, n)} |\n")
        out.write("\n| table row | uses | status |\n|---|---|---|\n")
        for row in _rows():
            n = result.coverage.rows.get(row, 0)
            out.write(f"| `{row}` | {n} | {status(row, n, _needs(row))} |\n")
        if classification is not None:
            out.write("\n## Counterexamples\n")
        for i, finding in enumerate(result.findings, 1):
            kind = "declared divergence" if finding.declared else "violation"
            title = f"{finding.key}" + (f" ({finding.divergence})" if finding.divergence else "")
            out.write(f"\n### {i}. {kind}: {title}\n\n{finding.message}\n")
            note = notes.get(finding.key)
            if note is not None:
                out.write(f"\n**{KINDS[note.kind].capitalize()}.** {note.summary}")
                out.write(f" See {note.see}.\n" if note.see else "\n")
            elif classification is not None:
                out.write("\n**Unclassified.**\n")
            if finding.flaky:
                out.write(
                    "\nThe generated run failed so once; replayed, it need not (the port's"
                    " timing varies).\n"
                )
            if finding.script:
                out.write("\n```jsonl\n")
                for command in finding.script:
                    out.write(json.dumps(command) + "\n")
                out.write("```\n")
        return
    out.write(head + "\n")
    declared = [
        f"{what} within {float(driver[name]):g} model s"
        for name, what in (("cancel_latency", "cancels"), ("due_latency", "due moves"))
        if driver.get(name)
    ]
    if declared:
        out.write(f"the port's declared bounds: {', '.join(declared)}\n")
    if result.error:
        out.write(f"driver error: {result.error}\n")
        if result.error_script:
            out.write(f"  after {len(result.error_script)} commands of a generated run\n")
    out.write("\ninvariants:\n")
    for inv in INVARIANTS:
        n = result.coverage.checks.get(inv.id, 0)
        out.write(f"  {inv.id:3} {status(inv.id, n):20} {n:7} checks  {inv.title}\n")
    out.write("\ntable rows:\n")
    for row in _rows():
        n = result.coverage.rows.get(row, 0)
        out.write(f"  {status(row, n, _needs(row)):20} {n:7}  {row}\n")
    for i, finding in enumerate(result.findings, 1):
        kind = "declared divergence" if finding.declared else "VIOLATION"
        out.write(f"\n{i}. {kind} {finding.key}: {finding.message}\n")
        note = notes.get(finding.key)
        if note is not None:
            out.write(f"   {KINDS[note.kind]}: {note.summary}\n")
        if finding.script:
            out.write(f"   counterexample: {len(finding.script)} commands\n")


def _md_preamble(result: Result, classification: Classification, out: TextIO) -> None:
    """Title, introduction, the command, and one line per finding with its kind."""
    if classification.title:
        out.write(f"# {classification.title}\n\n")
    if classification.intro:
        out.write(classification.intro.strip() + "\n\n")
    if classification.command:
        out.write(f"```bash\n{classification.command.strip()}\n```\n\n")
    out.write("## Findings\n\n| # | finding | kind | how the port differs | see |\n")
    out.write("|---|---|---|---|---|\n")
    for i, finding in enumerate(result.findings, 1):
        note = classification.notes.get(finding.key)
        kind = KINDS[note.kind] if note is not None else "**unclassified**"
        summary = note.summary if note is not None else finding.message
        see = note.see if note is not None else ""
        out.write(f"| {i} | `{finding.key}` | {kind} | {summary} | {see} |\n")
    missing = sorted(set(classification.notes) - {f.key for f in result.findings})
    if missing:
        out.write(
            "\nClassified, not found by this run (timing-dependent on the real clock): "
            + ", ".join(f"`{key}`" for key in missing)
            + "\n"
        )
    out.write("\n## Coverage\n\n")


def load_expected(path: Path) -> tuple[set[str], set[str]]:
    """The finding keys an expectation file requires, and those it allows (see
    :func:`check_expected`)."""
    if path.suffix == ".json":
        classification = load_classification(path)
        return classification.required, set(classification.notes)
    keys = {
        line.strip()
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    }
    return keys, keys


def check_expected(result: Result, path: Path) -> str | None:
    """Compare the findings with an expectation file; ``None`` if they agree, else why
    not. A JSON file is a :class:`Classification` (every classified finding must be
    found, except those marked ``sometimes``, and nothing else); any other file lists
    the expected keys, one per line (``#`` starts a comment)."""
    found = {f.key for f in result.findings}
    required, allowed = load_expected(path)
    new, gone = sorted(found - allowed), sorted(required - found)
    if not new and not gone:
        return None
    return f"findings differ from {path}:\n  new: {new}\n  gone: {gone}"


def save_scripts(result: Result, directory: Path) -> list[Path]:
    """Write each finding's counterexample as a JSON-lines script, and the commands
    that led to a driver's failure as ``driver-error.jsonl``; their paths."""
    paths = []
    for i, finding in enumerate(result.findings, 1):
        if not finding.script:
            continue
        directory.mkdir(parents=True, exist_ok=True)
        name = finding.key.replace(" ", "_").replace("[", "-").replace("]", "").replace(",", "-")
        path = directory / f"{i:02}-{name}.jsonl"
        path.write_text("".join(json.dumps(c) + "\n" for c in finding.script))
        paths.append(path)
    if result.error_script:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "driver-error.jsonl"
        path.write_text("".join(json.dumps(c) + "\n" for c in result.error_script))
        paths.append(path)
    return paths
