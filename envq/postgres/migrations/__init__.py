"""Upgrades of envq's schema in PostgreSQL, one version at a time, keeping every row.

Theory of operation
-------------------
A fresh database gets the whole schema of this release at once
(:func:`envq.postgres.schema.render`). A database made by an earlier release is brought
up to date by the migrations of this folder: ``NNNN.sql`` takes a schema of version
``NNNN - 1`` to version ``NNNN``. A released migration is frozen text, never edited; a
test applies every one of them to the first schema envq can migrate from
(:data:`FIRST`, kept as a fixture of the tests), filled with envelopes in every state,
and checks that the result is the schema a fresh install makes, object by object, and
that every envelope then ends as it would have.

Each version's row of ``envq.schema_version`` says which older releases can still run
on it (``compatible_from``): a node refuses a database whose schema it is too old or
too new for, and says what to do (:func:`check`). Everything happens in one
transaction, under an advisory lock that :meth:`envq.postgres.PgQueue.install` and the
``migrate`` command take, so that processes upgrading at once apply each migration
once and a failed upgrade leaves the database as it was.
"""

from __future__ import annotations

import importlib.resources
from typing import TYPE_CHECKING, Any, Final

from envq.postgres.schema import SCHEMA_VERSION, render

if TYPE_CHECKING:
    import asyncpg

__all__ = ["FIRST", "LOCK", "Version", "check", "install", "installed", "migration", "steps"]

#: The oldest schema version a migration starts from (envq's first schema that kept its
#: version in ``envq.schema_version`` with a release that shipped it).
FIRST: Final = 3
#: The advisory lock every install and upgrade takes (one at a time, per database).
LOCK: Final = "SELECT pg_advisory_xact_lock(hashtext('envq.install'))"

_Conn = Any  # an asyncpg connection, pooled or not


class Version:
    """The schema a database holds: its ``version`` and the oldest version whose envq
    still runs on it (``compatible_from``)."""

    __slots__ = ("compatible_from", "version")

    def __init__(self, version: int, compatible_from: int) -> None:
        self.version = version
        self.compatible_from = compatible_from

    def __repr__(self) -> str:
        return f"Version({self.version}, compatible_from={self.compatible_from})"


def migration(version: int) -> str:
    """The SQL that takes a schema of ``version - 1`` to ``version``."""
    if not FIRST < version <= SCHEMA_VERSION:
        raise ValueError(
            f"no migration to version {version}: this envq migrates from {FIRST} to "
            f"{SCHEMA_VERSION}"
        )
    folder = importlib.resources.files(__name__)
    return folder.joinpath(f"{version:04d}.sql").read_text(encoding="utf-8")


def steps(version: int) -> list[int]:
    """The migrations that take a schema of ``version`` to this envq's, in order."""
    if version < FIRST:
        raise RuntimeError(
            f"envq's schema in the database is version {version}, older than any this "
            f"envq can migrate from ({FIRST}): upgrade through an earlier release first"
        )
    return list(range(version + 1, SCHEMA_VERSION + 1))


async def installed(conn: _Conn) -> Version | None:
    """The schema version the database holds, or None when it holds no envq schema."""
    if await conn.fetchval("SELECT to_regclass('envq.schema_version')") is None:
        return None
    has_compat = await conn.fetchval(
        "SELECT EXISTS (SELECT FROM information_schema.columns WHERE table_schema = 'envq'"
        " AND table_name = 'schema_version' AND column_name = 'compatible_from')"
    )
    if not has_compat:  # before version 4: each version ran with its own envq only
        version = await conn.fetchval("SELECT max(version) FROM envq.schema_version")
        return Version(version, version)
    row = await conn.fetchrow(
        "SELECT version, compatible_from FROM envq.schema_version ORDER BY version DESC LIMIT 1"
    )
    return Version(row["version"], row["compatible_from"])


def check(found: Version | None, where: str) -> None:
    """Refuse a database this envq cannot run on, saying what to do.

    :raises RuntimeError: no envq schema; a schema older than this envq's (migrate
        it); a newer one this envq is too old for (upgrade envq).
    """
    if found is None:
        raise RuntimeError(
            f"{where}: the database has no envq schema: call install() (or run "
            "`python -m envq.postgres install`, or the node command with --install) first"
        )
    if found.version < SCHEMA_VERSION:
        raise RuntimeError(
            f"{where}: envq's schema in the database is version {found.version}, this envq "
            f"needs {SCHEMA_VERSION}: upgrade it with `python -m envq.postgres migrate` (or "
            "PgQueue.install()); docs/postgres.md (Upgrades) says which nodes may keep "
            "running meanwhile"
        )
    if found.compatible_from > SCHEMA_VERSION:
        raise RuntimeError(
            f"{where}: envq's schema in the database is version {found.version}, which "
            f"needs an envq made for schema {found.compatible_from} or later; this envq is "
            f"made for {SCHEMA_VERSION}: upgrade envq in this process"
        )


async def install(conn: asyncpg.Connection) -> tuple[int | None, int]:
    """Create envq's schema, or bring it up to this envq's version, in one transaction
    under :data:`LOCK`; ``(the version found, the version now)`` (None: there was
    none). A database at a newer version this envq can run on is left as it is.

    :raises RuntimeError: a schema named ``envq`` that is not envq's, or one this envq
        cannot migrate or run on (:func:`check`).
    """
    async with conn.transaction():
        await conn.execute(LOCK)
        found = await installed(conn)
        if found is None:
            if await conn.fetchval(
                "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = 'envq')"
            ):
                raise RuntimeError(
                    "the database has a schema 'envq' without envq's tables: drop it (or "
                    "rename it) and install again"
                )
            await conn.execute(render())
            return None, SCHEMA_VERSION
        for version in steps(found.version):
            await conn.execute(migration(version))
        now = await installed(conn)
        check(now, "install()")
        assert now is not None
        return found.version, now.version
