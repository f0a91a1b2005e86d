"""A throwaway PgBouncer in front of the tests' throwaway server.

PgBouncer refuses to run as root, so when this process is root it runs as the
``postgres`` system user (as the server does, ``envq.postgres._server``). It listens only
on a Unix socket in a temporary directory of its own (the port number names the socket
file), trusts every client, and reaches the server on the server's socket.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Final

#: The port number only names the socket file.
PORT: Final = 6432


def find_pgbouncer() -> str | None:
    """The ``pgbouncer`` program (Debian puts it in ``/usr/sbin``), or None."""
    return shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/usr/bin")


class Bouncer:
    """A PgBouncer in ``mode`` (``transaction``, ``session``) in front of the server whose
    socket is in ``server_dir``, until :meth:`stop`.

    :param program: the ``pgbouncer`` program.
    :param server_dir: the server's socket directory.
    :param mode: PgBouncer's ``pool_mode``.
    :param pool_size: server connections per database and user.
    """

    def __init__(
        self, program: str, server_dir: Path, *, mode: str = "transaction", pool_size: int = 20
    ) -> None:
        self.program = program
        self.server_dir = server_dir
        self.mode = mode
        self.pool_size = pool_size
        self.directory: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log_file(self) -> Path:
        """PgBouncer's log."""
        assert self.directory is not None
        return self.directory / "pgbouncer.log"

    def dsn(self, dbname: str) -> str:
        """A connection URI for database ``dbname`` through PgBouncer."""
        assert self.directory is not None
        host = urllib.parse.quote(str(self.directory), safe="")
        return f"postgresql://postgres@/{urllib.parse.quote(dbname)}?host={host}&port={PORT}"

    def start(self) -> None:
        """Start PgBouncer; returns once its socket is there."""
        directory = Path(tempfile.mkdtemp(prefix="envq-pgbouncer-"))
        self.directory = directory
        (directory / "users.txt").write_text('"postgres" ""\n')
        (directory / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={self.server_dir} port=5432\n"
            "[pgbouncer]\n"
            "listen_addr =\n"
            f"listen_port = {PORT}\n"
            f"unix_socket_dir = {directory}\n"
            "auth_type = trust\n"
            f"auth_file = {directory / 'users.txt'}\n"
            f"pool_mode = {self.mode}\n"
            "max_client_conn = 500\n"
            f"default_pool_size = {self.pool_size}\n"
            f"logfile = {self.log_file}\n"
        )
        user: int | None = None
        group: int | None = None
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            user, group = entry.pw_uid, entry.pw_gid
            for path in (directory, *directory.iterdir()):
                os.chown(path, user, group)
        self.proc = subprocess.Popen(
            [self.program, str(directory / "pgbouncer.ini")],
            user=user,
            group=group,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        until = time.monotonic() + 60
        while not (directory / f".s.PGSQL.{PORT}").exists():
            if self.proc.poll() is not None or time.monotonic() > until:
                err = b"" if self.proc.stderr is None else self.proc.stderr.read()
                log = self.log_file.read_text() if self.log_file.exists() else ""
                self.stop()
                raise RuntimeError(f"pgbouncer did not start:\n{err.decode()}\n{log}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop PgBouncer at once and remove its directory. Safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
            if proc.stderr is not None:
                proc.stderr.close()
        directory, self.directory = self.directory, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
