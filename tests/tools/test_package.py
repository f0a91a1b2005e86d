"""The distribution: its metadata, its licence, what the sdist ships, ``--version``.

The wheel and the sdist are built once per session with ``python -m build`` (the
``build`` package is a dev dependency; the build backend comes from PyPI into an
isolated environment, as for any user building from source).
"""

from __future__ import annotations

import email.parser
import os
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from email.message import Message
from pathlib import Path

import pytest

import envq

#: The package as it is built and shipped, the same whatever CPython builds it.
pytestmark = pytest.mark.one_python

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel and the sdist of the working tree, built into a temporary folder."""
    out = tmp_path_factory.mktemp("dist")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def _wheel(dist: Path) -> Path:
    (wheel,) = dist.glob("envq-*.whl")
    return wheel


def _sdist(dist: Path) -> Path:
    (sdist,) = dist.glob("envq-*.tar.gz")
    return sdist


def _metadata(dist: Path) -> Message:
    with zipfile.ZipFile(_wheel(dist)) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        text = zf.read(name).decode()
    return email.parser.Parser().parsestr(text)


def _sdist_names(dist: Path) -> list[str]:
    with tarfile.open(_sdist(dist)) as tf:
        # Drop the top folder, envq-X.Y.Z/.
        return [m.name.partition("/")[2] for m in tf.getmembers() if m.isfile()]


def test_license_file_is_mit_and_in_both_distributions(dist: Path) -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License")
    assert "Permission is hereby granted, free of charge" in text
    meta = _metadata(dist)
    assert meta["License-Expression"] == "MIT"
    assert "LICENSE" in meta.get_all("License-File", [])
    with zipfile.ZipFile(_wheel(dist)) as zf:
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in zf.namelist())
    assert "LICENSE" in _sdist_names(dist)


def test_metadata_has_classifiers_authors_and_python_versions(dist: Path) -> None:
    meta = _metadata(dist)
    classifiers = set(meta.get_all("Classifier", []))
    for wanted in (
        "Typing :: Typed",
        "Framework :: AsyncIO",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
    ):
        assert wanted in classifiers, wanted
    assert meta["Author"] or meta["Author-email"]
    assert meta["Requires-Python"] == ">=3.11"
    assert meta["Version"] == envq.__version__


def test_wheel_ships_the_type_marker(dist: Path) -> None:
    with zipfile.ZipFile(_wheel(dist)) as zf:
        assert "envq/py.typed" in zf.namelist()


def test_sdist_ships_no_tests(dist: Path) -> None:
    # The suite needs the repository around it (docs/, specs/, examples/, scripts/,
    # drivers/): a partial copy in the sdist collected with errors, so none is shipped.
    names = _sdist_names(dist)
    assert not [n for n in names if n.startswith("tests/")]
    assert "pyproject.toml" in names
    assert "README.md" in names
    assert "envq/py.typed" in names
    assert "envq/__init__.py" in names


def test_pyproject_reads_the_version_from_the_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" in project.get("dynamic", [])


@pytest.mark.parametrize("argv", [["--version"], ["-V"]])
def test_version_option_prints_the_version(argv: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "envq", *argv],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"envq {envq.__version__}\n"


def _docstrings() -> list[tuple[str, int, str]]:
    """Every docstring in the envq package: (file, line, text)."""
    import ast  # noqa: PLC0415 - only this check parses the sources

    found: list[tuple[str, int, str]] = []
    for path in sorted((ROOT / "envq").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node, clean=False)
                if doc is not None:
                    line = node.body[0].lineno
                    found.append((str(path.relative_to(ROOT)), line, doc))
    return found


def test_docstrings_cite_no_section_of_an_unshipped_spec() -> None:
    # The behaviour spec is not part of the package: a docstring says what it means in
    # plain words (or names a docs page) instead of citing "contract §3".
    docs = _docstrings()
    assert len(docs) > 100
    cites = [f"{path}:{line}" for path, line, doc in docs if "§" in doc]
    assert cites == []


def test_docs_site_needs_no_network() -> None:
    # Offline (an intranet docs host), a CDN's Mermaid and Google's fonts do not load:
    # the state diagrams showed as raw text. Mermaid is vendored and web fonts are off.
    config = (ROOT / "mkdocs.yml").read_text()
    theme = config.partition("\ntheme:\n")[2].partition("\n\n")[0]
    assert re.search(r"^  font: false$", theme, re.MULTILINE), theme
    scripts = config.partition("\nextra_javascript:\n")[2].partition("\n\n")[0]
    assert re.findall(r"^  - (\S+)$", scripts, re.MULTILINE) == ["assets/mermaid/mermaid.min.js"]
    assert "://" not in scripts
    vendored = ROOT / "docs" / "assets" / "mermaid"
    script = (vendored / "mermaid.min.js").read_text(encoding="utf-8")
    # mkdocs-material looks for a global `mermaid` (and fetches one only without it).
    assert script.rstrip().endswith(
        'globalThis["mermaid"] = globalThis.__esbuild_esm_mermaid_nm["mermaid"].default;'
    )
    assert 'version:"11.' in script  # the major version mkdocs-material drives
    assert (vendored / "LICENSE").read_text().startswith("The MIT License")


def test_mypy_type_checks_a_user_of_an_editable_install(tmp_path: Path) -> None:
    # setuptools installed envq in editable mode through an import hook, which mypy
    # cannot follow: "import envq" in a user's file was "import-not-found" and every
    # envq name was Any. hatchling's editable install is a path in a .pth file.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "-e", str(ROOT)],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    user = tmp_path / "user"
    user.mkdir()
    (user / "app.py").write_text(
        "import envq\n\nqueue = envq.Queue('jobs')\nreveal_type(queue)\nname: int = queue.name\n"
    )
    mypy = [sys.executable, "-m", "mypy", "--strict", "--no-incremental"]
    proc = subprocess.run(
        [*mypy, "--python-executable", str(python), "app.py"],
        cwd=user,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert 'Revealed type is "envq._queue.Queue"' in proc.stdout, proc.stdout + proc.stderr
    # envq's types are checked: the one error is the user's own, a str put in an int.
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, proc.stdout
    assert "app.py:5: error: Incompatible types in assignment" in errors[0]


def test_api_page_docstrings_speak_of_no_contract() -> None:
    # What the API reference renders: every public name of envq, envq.testing and
    # envq.pytest_plugin, and their public members.
    import inspect  # noqa: PLC0415

    import envq.pytest_plugin  # noqa: PLC0415
    import envq.testing  # noqa: PLC0415

    jargon = re.compile(r"\bcontract\b|§", re.IGNORECASE)
    found: list[str] = []
    seen: set[int] = set()

    def visit(obj: object, name: str, depth: int) -> None:
        if id(obj) in seen or depth > 2:
            return
        seen.add(id(obj))
        found.extend(
            f"{name}: {line.strip()}"
            for line in (inspect.getdoc(obj) or "").splitlines()
            if jargon.search(line)
        )
        if inspect.isclass(obj) or inspect.ismodule(obj):
            for key, value in vars(obj).items():
                if not key.startswith("_") and not inspect.ismodule(value):
                    visit(value, f"{name}.{key}", depth + 1)

    for public in envq.__all__:
        visit(getattr(envq, public), f"envq.{public}", 0)
    visit(envq.testing, "envq.testing", 0)
    visit(envq.pytest_plugin, "envq.pytest_plugin", 0)
    assert len(seen) > 200
    assert found == []
