"""A throwaway PostgreSQL server in a temporary directory, for tests and demos.

``initdb`` and ``pg_ctl`` refuse to run as root, so when this process is root the
directory is handed to the ``postgres`` system user and both programs run under
``runuser``. The server listens only on a Unix socket inside the directory (no TCP
port, so parallel servers never collide) and is removed, data and all, by
:meth:`ThrowawayServer.stop`.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Final

__all__ = ["ServerUnavailable", "ThrowawayServer", "find_bindir"]

#: The port number only names the socket file; nothing listens on TCP.
_PORT: Final = 5432
#: Settings for a server whose data may be lost: no waiting on the disk.
_FAST: Final = ("fsync=off", "synchronous_commit=off", "full_page_writes=off")


class ServerUnavailable(RuntimeError):
    """PostgreSQL's server programs are missing, or cannot be run here."""


def find_bindir() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl``, or None when there is none.

    Looked for in ``$ENVQ_PG_BINDIR``, then ``$PATH``, then Debian's
    ``/usr/lib/postgresql/<version>/bin`` (the newest version wins).
    """
    configured = os.environ.get("ENVQ_PG_BINDIR")
    if configured:
        path = Path(configured)
        return path if (path / "pg_ctl").exists() and (path / "initdb").exists() else None
    on_path = shutil.which("pg_ctl")
    if on_path is not None:
        real = Path(on_path).resolve().parent
        if (real / "initdb").exists():
            return real
    found = sorted(
        (Path(p) for p in glob.glob("/usr/lib/postgresql/*/bin/pg_ctl")),
        key=lambda p: _version_key(p.parent.parent.name),
    )
    for pg_ctl in reversed(found):
        if (pg_ctl.parent / "initdb").exists():
            return pg_ctl.parent
    return None


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(part) for part in name.split(".") if part.isdigit())


class ThrowawayServer:
    """A PostgreSQL server of its own, in a temporary directory, until :meth:`stop`.

    :param bindir: where ``initdb`` and ``pg_ctl`` are; found by :func:`find_bindir`
        when None.
    :param fast: turn off waiting on the disk (``fsync`` and friends): for tests,
        whose data is thrown away anyway. Benchmarks pass False.
    """

    def __init__(self, bindir: Path | None = None, *, fast: bool = True) -> None:
        found = bindir if bindir is not None else find_bindir()
        if found is None:
            raise ServerUnavailable(
                "PostgreSQL's server programs (initdb, pg_ctl) were not found; install "
                "Debian's 'postgresql' package or set ENVQ_PG_BINDIR"
            )
        self.bindir: Path = found
        self.fast = fast
        self._as: tuple[str, ...] = ()
        self._owner: tuple[int, int] | None = None
        if os.geteuid() == 0:
            if shutil.which("runuser") is None:
                raise ServerUnavailable("running as root needs 'runuser' to start PostgreSQL")
            try:
                entry = pwd.getpwnam("postgres")
            except KeyError:
                raise ServerUnavailable(
                    "running as root needs a 'postgres' system user to start PostgreSQL"
                ) from None
            self._as = ("runuser", "-u", "postgres", "--")
            self._owner = (entry.pw_uid, entry.pw_gid)
        self.directory: Path | None = None

    @property
    def socket_dir(self) -> Path:
        """The directory of the server's Unix socket (the ``host`` to connect to)."""
        if self.directory is None:
            raise RuntimeError("the server is not started")
        return self.directory

    @property
    def log_file(self) -> Path:
        """The server's log."""
        return self.socket_dir / "server.log"

    def dsn(self, dbname: str = "postgres") -> str:
        """A connection URI for database ``dbname`` as the superuser ``postgres`` (both
        asyncpg and libpq read it)."""
        host = urllib.parse.quote(str(self.socket_dir), safe="")
        return f"postgresql://postgres@/{urllib.parse.quote(dbname)}?host={host}&port={_PORT}"

    def start(self) -> None:
        """Make the data directory and start the server; returns once it accepts
        connections. Raises :class:`ServerUnavailable` with the server's log when it
        does not start."""
        directory = Path(tempfile.mkdtemp(prefix="envq-pg-"))
        self.directory = directory
        if self._owner is not None:
            os.chown(directory, *self._owner)
        data = directory / "data"
        try:
            self._run(
                "initdb",
                "-D",
                str(data),
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            )
            options = [
                f"-c unix_socket_directories='{directory}'",
                "-c listen_addresses=''",
                f"-p {_PORT}",
            ]
            if self.fast:
                options += [f"-c {setting}" for setting in _FAST]
            self._run(
                "pg_ctl",
                "-D",
                str(data),
                "-l",
                str(self.log_file),
                "-w",
                "-t",
                "60",
                "-o",
                " ".join(options),
                "start",
            )
        except ServerUnavailable:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the server (at once: its data is about to go) and remove its directory.
        Safe to call twice."""
        directory, self.directory = self.directory, None
        if directory is None:
            return
        data = directory / "data"
        if (data / "postmaster.pid").exists():
            stop = ("-D", str(data), "-m", "immediate", "-w", "stop")
            subprocess.run(
                [*self._as, str(self.bindir / "pg_ctl"), *stop],
                capture_output=True,
                check=False,
            )
        shutil.rmtree(directory, ignore_errors=True)

    def _run(self, program: str, *args: str) -> None:
        command: Sequence[str] = [*self._as, str(self.bindir / program), *args]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            log = ""
            if self.directory is not None and self.log_file.exists():
                log = self.log_file.read_text(errors="replace")[-2000:]
            raise ServerUnavailable(
                f"{program} failed ({done.returncode}): {done.stderr.strip()}\n{log}".strip()
            )

    def __enter__(self) -> ThrowawayServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
