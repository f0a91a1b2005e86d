"""Bad input to ``envq.postgres`` refused at the call with a clear, bounded message that
names the parameter, never shows a password, and admits nothing.

- a DSN whose password holds characters a URI reserves (``#``, ``/``, ``?``, ``@``):
  the driver's parser cuts the password there and quotes a piece of it;
- a payload or id that would not come back as it was sent (a mapping key that is not a
  str), or that the database cannot hold (too big for its column or its index);
- values whose ``repr`` is huge or fails (an int of thousands of digits, 8 MB of
  non-JSON);
- a queue name a notification cannot carry, a node name ``pg_stat_activity`` would cut.
"""

from __future__ import annotations

import itertools
import logging
import uuid

import pg_jobs
import pytest

import envq
from envq._checks import SHOW_LIMIT
from envq._errors import BadEnvelopeType
from envq.postgres import PgQueue, StoreUnavailable
from envq.postgres._codec import MAX_ID_BYTES, MAX_PAYLOAD_BYTES
from envq.postgres._edges import MAX_NODE_NAME, MAX_QUEUE_NAME_BYTES, redact

asyncpg = pytest.importorskip("asyncpg")

pytestmark = pytest.mark.real_clock

_names = itertools.count()

#: The longest message a refusal may carry (it names the value, cut short).
_BOUNDED = 4 * SHOW_LIMIT + 400


def _name() -> str:
    return f"bad{next(_names)}-{uuid.uuid4().hex[:6]}"


# -- the DSN's password --------------------------------------------------------------

_PASSWORDS = [
    "Sup3rPart#rest",  # the parser cuts at '#' and quotes 'Sup3rPart' as the port
    "Sup3rPart/rest",
    "Sup3rPart?rest=1",
    "Sup3r@Part@rest",
    "Sup3rPart:9999",
    "s3cr%23t",
]


@pytest.mark.parametrize("password", _PASSWORDS)
async def test_no_part_of_a_password_reaches_the_error(
    password: str, caplog: pytest.LogCaptureFixture
) -> None:
    dsn = f"postgresql://appuser:{password}@db.example.invalid:5432/app"
    q = PgQueue(dsn, _name(), workers=0)
    with caplog.at_level(logging.DEBUG), pytest.raises(StoreUnavailable) as caught:
        await q.connect()
    shown = [str(caught.value), repr(caught.value), caplog.text]
    pieces = [p for p in ("Sup3r", "Part", "rest", "s3cr", "9999") if p in password]
    for text in shown:
        for piece in pieces:
            assert piece not in text, (piece, text)
    assert caught.value.__cause__ is None  # nothing chained that could show it
    assert q._pool is None


def test_redact_covers_every_shape_of_a_password() -> None:
    """The DSN, the password, its percent-decoded form and its pieces between reserved
    characters are replaced; key=value DSNs too (quoted or not)."""
    dsn = "postgresql://u:ab%23cd#ef@h/d"
    text = f"{dsn} ab%23cd#ef ab#cd ab cd#ef"
    assert "ab" not in redact(dsn, text)
    assert "cd" not in redact(dsn, text)
    assert "ef" not in redact(dsn, text)
    assert redact("host=h password=hunter22 user=u", "bad hunter22") == "bad ***"
    assert redact("host=h password='hun ter' user=u", "x hun ter y") == "x *** y"
    assert redact("postgresql://u@h/d", "nothing secret") == "nothing secret"


def test_a_malformed_dsn_says_how_to_escape_the_password() -> None:
    """The refusal of a DSN the parser cannot read says what to do."""
    from envq.postgres._edges import unavailable  # noqa: PLC0415

    dsn = "postgresql://u:pw1#w2@h:5432/d"
    error = unavailable("q", dsn, ValueError("invalid port 'pw1'"))
    assert "percent-encoded" in str(error)
    assert "pw1" not in str(error)


# -- what a payload or an id can be ------------------------------------------------------


async def _refused(pg_dsn: str, field: str, value: object, match: str) -> str:
    """Send a good envelope with one whose ``field`` is ``value``: refused naming the
    field, nothing admitted; the message."""
    q = PgQueue(pg_dsn, _name(), workers=0)
    await q.install()
    async with q:
        good = envq.Envelope(invoke=pg_jobs.noop, id="good")
        bad = envq.Envelope(invoke=pg_jobs.noop, **{field: value})  # type: ignore[arg-type]
        with pytest.raises(BadEnvelopeType, match=match) as caught:
            await q.send(good, bad)
        assert await q.counts() == {}, "a refused batch admitted something"
    message = str(caught.value)
    assert f"{field}=" in message
    assert len(message) <= _BOUNDED, len(message)
    return message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("payload", {1: "a", "1": "b"}),
        ("payload", {"outer": {2: "x"}}),
        ("payload", [{(1, 2): "tuple key"}]),
        ("payload", {None: 1}),
    ],
)
async def test_a_key_that_is_not_a_str_is_refused(pg_dsn: str, field: str, value: object) -> None:
    """JSON's keys are strings: ``{1: 'a', '1': 'b'}`` would come back as ``{'1':
    'b'}``. Refused, naming the field and the key."""
    message = await _refused(pg_dsn, field, value, "is not a str")
    assert "key" in message


async def test_an_int_of_thousands_of_digits_is_refused_with_a_short_message(
    pg_dsn: str,
) -> None:
    """Its repr raises ValueError past 4,300 digits: the message names it by its size."""
    message = await _refused(pg_dsn, "payload", {"n": 10**5000}, "cannot cross")
    assert "an int of 16610 bits" in message


async def test_a_big_payload_that_is_not_json_is_refused_without_echoing_it(
    pg_dsn: str,
) -> None:
    blob = {"data": "x" * (8 * 1024 * 1024), "bad": object()}
    message = await _refused(pg_dsn, "payload", blob, "not JSON")
    assert "x" * 1000 not in message


async def test_a_payload_over_the_limit_is_refused_naming_it(pg_dsn: str) -> None:
    """More JSON than a PostgreSQL queue holds for a payload: refused before the
    database is asked (which would fail the statement, or worse, the whole batch)."""
    big = "é" * (MAX_PAYLOAD_BYTES // 6 + 1)  # \\u00e9: six bytes of JSON each
    message = await _refused(pg_dsn, "payload", big, "bytes")
    assert str(MAX_PAYLOAD_BYTES) in message


async def test_an_id_over_the_limit_is_refused_naming_it(pg_dsn: str) -> None:
    """The id is the dedup key, in a unique index whose entries PostgreSQL bounds."""
    message = await _refused(pg_dsn, "id", "k" * MAX_ID_BYTES, "bytes")
    assert str(MAX_ID_BYTES) in message


async def test_an_id_at_the_limit_is_admitted_and_deduplicated(pg_dsn: str) -> None:
    ident = "k" * (MAX_ID_BYTES - 2)  # its JSON: the quotes make MAX_ID_BYTES
    q = PgQueue(pg_dsn, _name(), workers=0)
    await q.install()
    async with q:
        assert await q.send(envq.Envelope(invoke=pg_jobs.noop, id=ident)) == 1
        assert await q.send(envq.Envelope(invoke=pg_jobs.noop, id=ident)) == 0
        assert await q.counts() == {"buffered": 1}


# -- names -------------------------------------------------------------------------------


def test_a_queue_name_a_notification_cannot_carry_is_refused() -> None:
    with pytest.raises(ValueError, match="name") as caught:
        PgQueue("postgresql://u@/d", "q" * 8000)
    assert str(MAX_QUEUE_NAME_BYTES) in str(caught.value)
    assert len(str(caught.value)) <= _BOUNDED
    # Bytes count, not characters: 128 two-byte characters are 256 bytes.
    with pytest.raises(ValueError, match="bytes"):
        PgQueue("postgresql://u@/d", "é" * 128)
    assert PgQueue("postgresql://u@/d", "q" * MAX_QUEUE_NAME_BYTES).name


@pytest.mark.parametrize("node", ["n" * (MAX_NODE_NAME + 1), "nœud", "tab\there"])
def test_a_node_name_pg_stat_activity_would_not_show_whole_is_refused(node: str) -> None:
    with pytest.raises(ValueError, match="node"):
        PgQueue("postgresql://u@/d", "q", node=node)


async def test_a_node_is_found_in_pg_stat_activity_by_its_whole_name(pg_dsn: str) -> None:
    node = "n" * MAX_NODE_NAME
    q = PgQueue(pg_dsn, _name(), workers=0, node=node)
    await q.install()
    async with q:
        found = await q._db().fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", f"envq:{node}"
        )
    assert found >= 1


def test_the_default_node_name_fits_whatever_the_host_is_called(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from envq.postgres import _node  # noqa: PLC0415

    monkeypatch.setattr(_node.socket, "gethostname", lambda: "h" * 63)
    q = PgQueue("postgresql://u@/d", "q")
    assert len(q.node) <= MAX_NODE_NAME
    assert q.node.startswith("hhh")


def test_each_hook_is_stored_in_its_own_column() -> None:
    """An envelope's four hooks are encoded each under its own column, in the order
    :data:`envq.postgres._codec.HOOKS` names them (the encoder spells the order out)."""
    from envq.postgres._codec import HOOKS, callable_name, encode  # noqa: PLC0415

    env = envq.Envelope(
        invoke=pg_jobs.noop,
        before=pg_jobs.plain,
        after=pg_jobs.note_attempt,
        on_success=pg_jobs.slow,
        on_failure=pg_jobs.retry_then_drop,
    )
    encoded = encode(env, "test")
    stored = dict(zip((attr for attr, _column in HOOKS), encoded.hooks, strict=True))
    expected = {attr: callable_name(getattr(env, attr), attr, "test") for attr, _ in HOOKS}
    assert stored == expected
    assert len(set(stored.values())) == 4
