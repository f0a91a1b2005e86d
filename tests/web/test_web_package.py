"""The dashboard is an extra: ``import envq`` imports none of its packages, and the
wheel's package data (templates, stylesheet, script) is where the app reads it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_envq_imports_no_web_package() -> None:
    code = (
        "import sys, envq, envq.postgres\n"
        "loaded = [m for m in ('starlette', 'jinja2', 'uvicorn', 'envq.web') if m in sys.modules]\n"
        "print(loaded)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"


def test_the_app_reads_its_files_from_the_package() -> None:
    web = ROOT / "envq" / "web"
    templates = {p.name for p in (web / "templates").glob("*.html")}
    assert {"base.html", "overview.html", "queue.html", "envelopes.html"} <= templates
    assert {"envelope.html", "schedules.html", "problem.html"} <= templates
    for asset in ("envq.css", "envq.js"):
        text = (web / "static" / asset).read_text(encoding="utf-8")
        assert "http://" not in text
        assert "https://" not in text
        assert len(text) < 20_000
