"""``python -m envq web``: every queue of a PostgreSQL database in a browser.

The DSN comes from ``--dsn`` or ``$ENVQ_DSN`` (better: a DSN on a command line shows
in the process list), the action token from ``$ENVQ_WEB_TOKEN`` (none: read-only).
Neither is ever printed. The server is uvicorn, on 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys

__all__ = ["serve"]


def serve(dsn: str | None, host: str, port: int) -> int:
    """Serve the dashboard until interrupted; the exit code."""
    dsn = dsn or os.environ.get("ENVQ_DSN")
    if not dsn:
        sys.stderr.write("envq web: no database: give --dsn or set $ENVQ_DSN\n")
        return 2
    try:
        import uvicorn  # noqa: PLC0415 - the web extra

        import envq.web  # noqa: PLC0415
    except ImportError as exc:
        sys.stderr.write(
            f"envq web needs the web and postgres extras ({exc.name} is missing): "
            "pip install 'envq[web,postgres]'\n"
        )
        return 2
    token = os.environ.get("ENVQ_WEB_TOKEN") or None
    try:
        web = envq.web.app(dsn=dsn, token=token)
    except (TypeError, ValueError) as error:
        sys.stderr.write(f"envq web: {error}\n")
        return 2
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as error:
        sys.stderr.write(f"envq web: cannot listen on {host}:{port}: {error.strerror}\n")
        return 2
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    mode = "actions unlock with $ENVQ_WEB_TOKEN" if token else "read-only"
    print(f"envq web: http://{shown}:{bound}/ ({mode})", flush=True)
    server = uvicorn.Server(uvicorn.Config(web, log_level="warning", access_log=False))
    try:
        asyncio.run(server.serve(sockets=[sock]))
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0
