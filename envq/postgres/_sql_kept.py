"""The SQL text of what envq's triggers keep beside the envelopes in PostgreSQL: the
counts of envelopes per queue and state (a capacity reads them), and the optional
journal of every move.

Kept apart from :mod:`envq.postgres._sql` (the functions and triggers that move the
envelopes) so that each reads in one sitting; :func:`envq.postgres.schema.render`
puts them together.
"""

from __future__ import annotations

from typing import Final

CAPACITY: Final = """\
-- ------------------------------------------------------------------------------------
-- The capacity: the queue's, not a process's. Whoever creates the queue's row sets it;
-- every sender checks its batch against the row's value.
-- ------------------------------------------------------------------------------------
ALTER TABLE envq.queues ADD COLUMN capacity integer NOT NULL DEFAULT 0
    CONSTRAINT queues_capacity CHECK (capacity >= 0);
COMMENT ON COLUMN envq.queues.capacity IS
    'The most live envelopes the queue holds (0: no limit), set when the row is created.';

-- ------------------------------------------------------------------------------------
-- The counts: how many envelopes of each queue are in each state, kept with every
-- move (statement triggers: one update per state a statement changes, not per row),
-- so that a send's capacity check and a queue's statistics cost the same at 100 and
-- at 1,000,000 envelopes. Each session adds to a slot of its own (its backend's pid
-- modulo 64): the ends of many nodes do not queue up on one row.
-- ------------------------------------------------------------------------------------
CREATE TABLE envq.counts (
    queue text NOT NULL,
    state envq.envelope_state NOT NULL,
    slot smallint NOT NULL,
    n bigint NOT NULL,
    PRIMARY KEY (queue, state, slot)
);
COMMENT ON TABLE envq.counts IS
    'Envelopes per queue and state: the sum of n over the slots (kept by the triggers).';

CREATE FUNCTION envq.count_moves() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    mine smallint := pg_backend_pid() % 64;
BEGIN
    -- In (queue, state) order: two statements add to the same rows in the same order.
    IF TG_OP = 'INSERT' THEN
        INSERT INTO envq.counts AS c (queue, state, slot, n)
        SELECT m.queue, m.state, mine, count(*) FROM new_rows AS m
         GROUP BY m.queue, m.state ORDER BY m.queue, m.state
        ON CONFLICT (queue, state, slot) DO UPDATE SET n = c.n + excluded.n;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO envq.counts AS c (queue, state, slot, n)
        SELECT m.queue, m.state, mine, -count(*) FROM old_rows AS m
         GROUP BY m.queue, m.state ORDER BY m.queue, m.state
        ON CONFLICT (queue, state, slot) DO UPDATE SET n = c.n + excluded.n;
    ELSE
        INSERT INTO envq.counts AS c (queue, state, slot, n)
        SELECT d.queue, d.state, mine, sum(d.n) FROM (
                   SELECT m.queue, m.state, 1 AS n FROM new_rows AS m
                   UNION ALL
                   SELECT m.queue, m.state, -1 AS n FROM old_rows AS m) AS d
         GROUP BY d.queue, d.state HAVING sum(d.n) <> 0 ORDER BY d.queue, d.state
        ON CONFLICT (queue, state, slot) DO UPDATE SET n = c.n + excluded.n;
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION envq.count_moves() IS
    'Keeps envq.counts: what a statement added to and took from each (queue, state).';
CREATE TRIGGER envelopes_count_inserts AFTER INSERT ON envq.envelopes
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION envq.count_moves();
CREATE TRIGGER envelopes_count_updates AFTER UPDATE ON envq.envelopes
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION envq.count_moves();
CREATE TRIGGER envelopes_count_deletes AFTER DELETE ON envq.envelopes
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION envq.count_moves();

CREATE FUNCTION envq.count_truncate() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM envq.counts;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION envq.count_truncate() IS
    'Empties envq.counts when envq.envelopes is truncated.';
CREATE TRIGGER envelopes_count_truncate AFTER TRUNCATE ON envq.envelopes
    FOR EACH STATEMENT EXECUTE FUNCTION envq.count_truncate();
"""


JOURNAL: Final = """\
-- ------------------------------------------------------------------------------------
-- The journal: an optional record of every move of a queue, for checking a deployment
-- against the tables (the conformance driver turns it on for its queue). Off by
-- default: the triggers read the flag with the queue row they read anyway, so a
-- queue whose journal is off pays nothing more.
-- ------------------------------------------------------------------------------------
ALTER TABLE envq.queues ADD COLUMN journal boolean NOT NULL DEFAULT false;
COMMENT ON COLUMN envq.queues.journal IS
    'Whether the moves of this queue and its envelopes are appended to envq.journal.';

CREATE TABLE envq.journal (
    n bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue text NOT NULL,
    -- The envelope row that moved; NULL: a move of the queue itself.
    seq bigint,
    -- States by name (an envelope state, or a queue state when seq is NULL); from_state
    -- is NULL for the send that created the row.
    from_state text,
    to_state text NOT NULL,
    -- The envelope event (attempt_<outcome> for the end of an attempt) or queue call.
    event text NOT NULL,
    decision envq.decision_kind,
    cause envq.cancel_cause,
    -- The queue's state an envelope move was checked against (NULL for a move of the
    -- queue): a move made while a lifecycle call was under way, not yet committed,
    -- saw the state before it, though its row may be written after the call's.
    queue_state text,
    at timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The node whose attempt the move began or ended (its lease_owner); NULL for the
    -- other moves (sends, due moves, an operator's).
    node text
);
CREATE INDEX journal_queue ON envq.journal (queue, n);
-- An envelope's moves, newest first, without walking its queue's whole journal.
CREATE INDEX journal_seq ON envq.journal (queue, seq, n);
COMMENT ON TABLE envq.journal IS
    'Every move of the queues whose journal is on, in the order they were made.';

CREATE FUNCTION envq.journal_move(moved envq.envelopes, source envq.envelope_state,
                                  seen envq.queue_state, held_by text)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF moved.state = source THEN
        RETURN;
    END IF;
    INSERT INTO envq.journal (queue, seq, from_state, to_state, event, decision, cause,
                              queue_state, at, node)
    VALUES (moved.queue, moved.seq, source::text, moved.state::text, moved.event::text,
            moved.decision, moved.cause, seen::text, moved.updated_at, held_by);
END
$$;
COMMENT ON FUNCTION envq.journal_move IS
    'Appends one envelope move to the journal (called by the trigger when it is on).';

-- A send is journalled after its statement, from the rows it inserted: a row that
-- ON CONFLICT DO NOTHING skipped (a dedup) is not among them, and a row whose id was
-- live in a transaction still ending is inserted only after that end committed (a
-- BEFORE trigger, which runs first, could only guess at either).
CREATE FUNCTION envq.journal_sends() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO envq.journal (queue, seq, from_state, to_state, event, queue_state, at)
    SELECT s.queue, s.seq, NULL, s.state::text, '{send}', q.state::text, s.updated_at
      FROM new_rows AS s JOIN envq.queues AS q ON q.name = s.queue
     WHERE q.journal
     ORDER BY s.seq;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION envq.journal_sends() IS
    'Appends the sends of a statement to the journal of the queues whose journal is on.';
CREATE TRIGGER envelopes_journal_sends AFTER INSERT ON envq.envelopes
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION envq.journal_sends();
"""
