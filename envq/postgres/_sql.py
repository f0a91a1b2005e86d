"""The SQL text of envq's functions and triggers in PostgreSQL, before
:func:`envq.postgres.schema.render` fills its placeholders from the tables.

Each ``{name}`` in a text below is a state, an event or a list of states that
``render`` takes from :mod:`envq._machine` (``{refused}``, ``{live}``, ``{running}``,
...): no state of the tables is written here. The texts are kept apart from the
compiler of the tables (:mod:`envq.postgres.schema`) so that each reads in one
sitting.
"""

from __future__ import annotations

from typing import Final

ENVELOPE_CHECK: Final = """\
CREATE FUNCTION envq.envelopes_check() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    source envq.envelope_state;
    row_kind envq.envelope_kind;
    queue_now envq.queue_state;
    mode_now envq.stop_mode;
    allowed envq.envelope_state;
    rejected text;
    journal_on boolean;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        IF NEW.queue IS DISTINCT FROM OLD.queue THEN
            RAISE EXCEPTION USING ERRCODE = '{refused}',
                MESSAGE = format('envq: envelope %s cannot move from queue %L to queue %L',
                                 OLD.seq, OLD.queue, NEW.queue);
        END IF;
        -- A running envelope's row group is relabelled (its type banned, an operator's
        -- cancel); an operator's retry gives it its own group back.
        IF NEW.kind IS DISTINCT FROM OLD.kind
           AND NOT (OLD.state = '{running}' AND NEW.kind IN ({relabels}))
           AND NOT (NEW.event IS NOT DISTINCT FROM '{retry}' AND NEW.kind IN ({own_kinds}))
        THEN
            RAISE EXCEPTION USING ERRCODE = '{refused}',
                MESSAGE = format('envq: envelope %s cannot change kind from %s to %s '
                                 '(only a running one is relabelled, to %s; a retry gives '
                                 'it its own back)', OLD.seq, OLD.kind, NEW.kind,
                                 '{relabels_text}');
        END IF;
        IF NEW.event IS NULL THEN
            IF NEW.state IS DISTINCT FROM OLD.state THEN
                RAISE EXCEPTION USING ERRCODE = '{refused}',
                    MESSAGE = format('envq: envelope %s of queue %L: %s -> %s names no event '
                                     '(set the column event in the same statement)',
                                     OLD.seq, OLD.queue, OLD.state, NEW.state);
            END IF;
            NEW.decision := NULL; NEW.cause := NULL; NEW.wait := NULL; NEW.limited := NULL;
            RETURN NEW;
        END IF;
        source := OLD.state;
        row_kind := OLD.kind;
    ELSE
        source := NULL;
        row_kind := NEW.kind;
    END IF;
    IF TG_OP = 'INSERT' THEN
        -- The queue's row is held (as a foreign key would) until the transaction ends:
        -- a queue is deleted only without envelopes (envq.queues_keep), and this row
        -- is not yet visible to the delete's check.
        SELECT q.state, q.stop_mode, q.journal INTO queue_now, mode_now, journal_on
          FROM envq.queues AS q WHERE q.name = NEW.queue FOR KEY SHARE;
    ELSE
        SELECT q.state, q.stop_mode, q.journal INTO queue_now, mode_now, journal_on
          FROM envq.queues AS q WHERE q.name = NEW.queue;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = '{refused}',
            MESSAGE = format('envq: there is no queue named %L', NEW.queue);
    END IF;
    IF TG_OP = 'INSERT' THEN
        rejected := envq.queue_refusal(queue_now, 'send');
        IF rejected IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = '{rejected}',
                MESSAGE = format('envq: queue %L is %s: send is rejected (%s)',
                                 NEW.queue, queue_now, rejected);
        END IF;
    END IF;
    allowed := envq.envelope_target(source, NEW.event, row_kind, queue_now,
                                    coalesce(NEW.wait, false), NEW.decision, NEW.cause,
                                    mode_now, coalesce(NEW.limited, false));
    IF allowed IS NULL OR allowed IS DISTINCT FROM NEW.state THEN
        RAISE EXCEPTION USING ERRCODE = '{refused}',
            MESSAGE = format('envq: envelope %s of queue %L: %s --%s--> %s is not in the '
                             'tables (%s)', coalesce(OLD.seq, NEW.seq), NEW.queue,
                             coalesce(source::text, 'new'), NEW.event,
                             coalesce(NEW.state::text, 'NULL'),
                             CASE WHEN allowed IS NULL
                                  THEN 'the event does not move it here'
                                  ELSE format('they lead to %s', allowed) END),
            DETAIL = format('kind=%s queue=%s wait=%s decision=%s cause=%s mode=%s limited=%s',
                            row_kind, queue_now, coalesce(NEW.wait, false),
                            coalesce(NEW.decision::text, 'none'), coalesce(NEW.cause::text, 'none'),
                            coalesce(mode_now::text, 'none'), coalesce(NEW.limited, false));
    END IF;
    -- The time of the move itself: a start measures the wait left from it, and the
    -- journal gives it as the move's. A statement that based a due time on an instant
    -- of its own gives that instant (one reading of the clock for both columns: the
    -- move is never later than the due time it set); other moves are stamped now.
    IF NEW.updated_at IS NULL OR (TG_OP = 'INSERT' AND NEW.updated_at = now())
       OR (TG_OP = 'UPDATE' AND NEW.updated_at = OLD.updated_at) THEN
        NEW.updated_at := clock_timestamp();
    END IF;
    -- A send is journalled once its row is in the table (envq.journal_sends).
    IF journal_on AND TG_OP = 'UPDATE' THEN
        -- The node whose attempt moved: the claimer, or the holder of the lease ended.
        PERFORM envq.journal_move(NEW, source, queue_now,
                                  coalesce(NEW.lease_owner, OLD.lease_owner));
    END IF;
    NEW.event := NULL; NEW.decision := NULL; NEW.cause := NULL;
    NEW.wait := NULL; NEW.limited := NULL;
    RETURN NEW;
END
$$;
COMMENT ON FUNCTION envq.envelopes_check() IS
    'Refuses any envelope row whose change of state the tables of envq._machine do not allow.';
CREATE TRIGGER envelopes_check BEFORE INSERT OR UPDATE ON envq.envelopes
    FOR EACH ROW EXECUTE FUNCTION envq.envelopes_check();
"""


ENVELOPE_DELETE: Final = """\
CREATE FUNCTION envq.envelopes_discard() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    journal_on boolean;
BEGIN
    -- A handed-back row leaves with its envelope (terminate()); an ended one is
    -- discarded (the tables' discard); a live one never leaves.
    IF OLD.state = '{handed_back}' THEN
        RETURN OLD;
    END IF;
    IF OLD.state NOT IN ({discardable}) THEN
        RAISE EXCEPTION USING ERRCODE = '{refused}',
            MESSAGE = format('envq: envelope %s of queue %L is %s: only an ended envelope '
                             'can be discarded (cancel it first)', OLD.seq, OLD.queue,
                             OLD.state);
    END IF;
    SELECT q.journal INTO journal_on FROM envq.queues AS q WHERE q.name = OLD.queue;
    IF journal_on THEN
        INSERT INTO envq.journal (queue, seq, from_state, to_state, event)
        VALUES (OLD.queue, OLD.seq, OLD.state::text, 'new', 'discard');
    END IF;
    RETURN OLD;
END
$$;
COMMENT ON FUNCTION envq.envelopes_discard() IS
    'Refuses deleting an envelope row the tables do not discard (a live one).';
CREATE TRIGGER envelopes_discard BEFORE DELETE ON envq.envelopes
    FOR EACH ROW EXECUTE FUNCTION envq.envelopes_discard();
"""


QUEUE_KEEP: Final = """\
CREATE FUNCTION envq.queues_keep() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT FROM envq.envelopes AS e WHERE e.queue = OLD.name) THEN
        RAISE EXCEPTION USING ERRCODE = 'foreign_key_violation',
            MESSAGE = format('envq: queue %L still holds envelopes: discard them first',
                             OLD.name);
    END IF;
    RETURN OLD;
END
$$;
COMMENT ON FUNCTION envq.queues_keep() IS
    'Refuses deleting a queue that still holds envelope rows (what a foreign key of '
    'envq.envelopes.queue would refuse: envelopes_check checks a new row''s queue and '
    'holds its row, once per row instead of a second lookup).';
CREATE TRIGGER queues_keep BEFORE DELETE ON envq.queues
    FOR EACH ROW EXECUTE FUNCTION envq.queues_keep();
"""


QUEUE_CHECK: Final = """\
CREATE FUNCTION envq.queues_check() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    allowed envq.queue_state;
    rejected text;
BEGIN
    IF TG_OP = 'INSERT' THEN
        IF NEW.state IS DISTINCT FROM '{initial}' OR NEW.call IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = '{refused}',
                MESSAGE = format('envq: queue %L must be created in state {initial}, not %s',
                                 NEW.name, NEW.state);
        END IF;
        RETURN NEW;
    END IF;
    IF NEW.name IS DISTINCT FROM OLD.name THEN
        RAISE EXCEPTION USING ERRCODE = '{refused}',
            MESSAGE = format('envq: queue %L cannot be renamed', OLD.name);
    END IF;
    IF NEW.call IS NULL THEN
        IF NEW.state IS DISTINCT FROM OLD.state THEN
            RAISE EXCEPTION USING ERRCODE = '{refused}',
                MESSAGE = format('envq: queue %L: %s -> %s names no call '
                                 '(set the column call in the same statement)',
                                 OLD.name, OLD.state, NEW.state);
        END IF;
        RETURN NEW;
    END IF;
    rejected := envq.queue_refusal(OLD.state, NEW.call);
    IF rejected IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = '{rejected}',
            MESSAGE = format('envq: queue %L is %s: %s is rejected (%s)',
                             OLD.name, OLD.state, NEW.call, rejected);
    END IF;
    allowed := envq.queue_target(OLD.state, NEW.call);
    IF allowed IS NULL OR allowed IS DISTINCT FROM NEW.state THEN
        RAISE EXCEPTION USING ERRCODE = '{refused}',
            MESSAGE = format('envq: queue %L: %s --%s--> %s is not in the tables (%s)',
                             OLD.name, OLD.state, NEW.call, coalesce(NEW.state::text, 'NULL'),
                             CASE WHEN allowed IS NULL THEN 'the call cannot happen in this state'
                                  ELSE format('they lead to %s', allowed) END);
    END IF;
    IF NEW.journal AND NEW.state IS DISTINCT FROM OLD.state THEN
        INSERT INTO envq.journal (queue, from_state, to_state, event)
        VALUES (NEW.name, OLD.state::text, NEW.state::text, NEW.call::text);
    END IF;
    NEW.call := NULL;
    NEW.updated_at := now();
    RETURN NEW;
END
$$;
COMMENT ON FUNCTION envq.queues_check() IS
    'Refuses any queue row whose lifecycle move the tables of envq._machine do not allow.';
CREATE TRIGGER queues_check BEFORE INSERT OR UPDATE ON envq.queues
    FOR EACH ROW EXECUTE FUNCTION envq.queues_check();
"""


LEASES: Final = """\
CREATE FUNCTION envq.claim(queue_name text, owner text, how_many integer, lease interval)
RETURNS SETOF envq.envelopes
LANGUAGE plpgsql AS $$
BEGIN
    IF how_many IS NULL OR how_many < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('envq.claim: how_many must be at least 1, not %s',
                             coalesce(how_many::text, 'NULL'));
    END IF;
    IF lease IS NULL OR lease < interval '0' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('envq.claim: lease must not be negative, not %s',
                             coalesce(lease::text, 'NULL'));
    END IF;
    IF owner IS NULL OR owner = '' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('envq.claim: owner must be a non-empty name, not %L', owner);
    END IF;
    -- A claim does not wait for the WAL flush: one a crash forgets has no committed
    -- end (an end's commit flushes the claim before it), so its envelope is READY
    -- again and runs again, as at-least-once allows; the forgotten attempt's end is
    -- refused by the fence. Ends, sends and lifecycle calls are durable.
    PERFORM set_config('synchronous_commit', 'off', true);
    RETURN QUERY
{claim_update}
END
$$;
COMMENT ON FUNCTION envq.claim IS
    'Starts attempts: up to how_many READY envelopes of a dispatching queue, the longest '
    'ready first, skipping rows other claims hold, each RUNNING under a new lease.';

CREATE FUNCTION envq.story(history jsonb, attempt integer, outcome envq.envelope_event,
                           started timestamptz, node text, error jsonb)
RETURNS jsonb
LANGUAGE sql AS $$
    -- The attempt appended (its error without the traceback: last_error keeps that),
    -- the oldest dropped past {story_limit}.
    SELECT CASE WHEN jsonb_array_length(h) > {story_limit} THEN h - 0 ELSE h END
      FROM (SELECT coalesce(history, '[]'::jsonb) || jsonb_build_array(jsonb_build_object(
                'attempt', attempt, 'outcome', outcome,
                'started', extract(epoch FROM started)::float8,
                'ended', extract(epoch FROM clock_timestamp())::float8,
                'node', node, 'error', error - 'traceback')) AS h) AS s
$$;
COMMENT ON FUNCTION envq.story IS
    'An envelope''s story with one more failed attempt (the latest {story_limit} kept).';

CREATE FUNCTION envq.renew(queue text, owner text, lease interval, tokens uuid[])
RETURNS TABLE (token uuid, kind envq.envelope_kind)
LANGUAGE sql AS $$
    -- Rows are locked in seq order, as the ends lock theirs: a renewal and an end of
    -- the same attempts on two sessions cannot deadlock.
    WITH mine AS MATERIALIZED (
        SELECT m.seq FROM envq.envelopes AS m
         WHERE m.queue = renew.queue AND m.lease_owner = owner AND m.state = 'running'
           AND m.lease_token = ANY(tokens)
         ORDER BY m.seq
           FOR UPDATE)
    UPDATE envq.envelopes AS e
       SET lease_expires_at = greatest(e.lease_expires_at, clock_timestamp() + lease)
      FROM mine
     WHERE e.seq = mine.seq AND e.lease_expires_at > clock_timestamp()
    RETURNING e.lease_token, e.kind
$$;
COMMENT ON FUNCTION envq.renew IS
    'Extends the leases of the attempts a node knows it holds (their tokens, under its '
    'owner name) by lease, never shortening one; returns the tokens renewed with their '
    'row groups (cancelled: an operator asked the attempt to stop). An expired lease is '
    'not renewed: it is lost. A lease the node does not know of (a claim whose reply it '
    'lost) is not renewed either: adopt() takes it, or it expires.';

CREATE FUNCTION envq.adopt(queue_name text, owner text, known uuid[], lease interval)
RETURNS SETOF envq.envelopes
LANGUAGE sql AS $$
    UPDATE envq.envelopes AS e
       SET lease_expires_at = greatest(e.lease_expires_at, clock_timestamp() + lease)
     WHERE e.queue = queue_name AND e.lease_owner = owner AND e.state = 'running'
       AND NOT (e.lease_token = ANY(known)) AND e.lease_expires_at > clock_timestamp()
    RETURNING e.*
$$;
COMMENT ON FUNCTION envq.adopt IS
    'The attempts an owner holds but does not know of (known: the tokens it knows), '
    'their leases renewed: a node whose claim''s reply was lost takes its attempts back.';

CREATE FUNCTION envq.hold(seq bigint, token uuid, span interval)
RETURNS envq.envelope_kind
LANGUAGE sql AS $$
    UPDATE envq.envelopes AS e
       SET lease_expires_at = greatest(e.lease_expires_at, clock_timestamp() + span)
     WHERE e.seq = hold.seq AND e.lease_token = token AND e.state = 'running'
       AND e.lease_expires_at > clock_timestamp()
    RETURNING e.kind
$$;
COMMENT ON FUNCTION envq.hold IS
    'Before a decision (on_failure): the attempt''s lease, while it still holds, '
    'extended to cover span (the hook''s budget); the row''s kind (blacklisted: no '
    'hook), or NULL when the lease no longer holds (the reaper decides instead).';

CREATE FUNCTION envq.finish(seq bigint, token uuid, outcome envq.envelope_event,
                            decision envq.decision_kind DEFAULT NULL,
                            cause envq.cancel_cause DEFAULT NULL,
                            limited boolean DEFAULT false,
                            due_at timestamptz DEFAULT NULL,
                            failures integer DEFAULT NULL,
                            error jsonb DEFAULT NULL)
RETURNS envq.envelope_state
LANGUAGE plpgsql AS $$
DECLARE
    ended envq.envelope_state;
BEGIN
    -- The queue's lock first (see finish_many).
    PERFORM pg_advisory_xact_lock_shared({queue_lock}, hashtext(l.queue))
       FROM envq.envelopes AS l WHERE l.seq = finish.seq;
    UPDATE envq.envelopes AS e
       SET state = envq.envelope_target('running', outcome, e.kind, q.state, false,
                                        finish.decision, finish.cause, q.stop_mode,
                                        coalesce(finish.limited, false)),
           event = outcome, decision = finish.decision, cause = finish.cause,
           limited = coalesce(finish.limited, false), due_at = finish.due_at,
           failures = coalesce(finish.failures, e.failures), ended_token = e.lease_token,
           last_error = coalesce(finish.error, e.last_error),
           history = CASE WHEN finish.error IS NULL THEN e.history
                          ELSE envq.story(e.history, e.attempt, outcome, e.updated_at,
                                          e.lease_owner, finish.error) END,
           lease_token = NULL, lease_owner = NULL, lease_expires_at = NULL
      FROM envq.queues AS q
     WHERE e.seq = finish.seq AND q.name = e.queue AND e.state = 'running'
       AND e.lease_token = finish.token AND e.lease_expires_at > clock_timestamp()
    RETURNING e.state INTO ended;
    RETURN ended;
END
$$;
COMMENT ON FUNCTION envq.finish IS
    'Ends an attempt with its outcome, moving the envelope where the tables lead, only '
    'while the attempt''s token holds; NULL when it does not (nothing changed).';

CREATE FUNCTION envq.finish_many(seqs bigint[], tokens uuid[],
                                 outcomes envq.envelope_event[],
                                 decisions envq.decision_kind[],
                                 causes envq.cancel_cause[], delays double precision[],
                                 failures integer[], errors jsonb[])
RETURNS TABLE (seq bigint, state envq.envelope_state)
LANGUAGE sql AS $$
{lock_queues_of_seqs};
{finish_update}
$$;
COMMENT ON FUNCTION envq.finish_many IS
    'finish for many attempts in one statement (one commit): the rows it returns are '
    'the attempts whose token held; the others changed nothing.';

CREATE FUNCTION envq.finish_and_claim(end_seqs bigint[], end_tokens uuid[],
                                      end_outcomes envq.envelope_event[],
                                      end_decisions envq.decision_kind[],
                                      end_causes envq.cancel_cause[],
                                      end_delays double precision[],
                                      end_failures integer[], end_errors jsonb[],
                                      queue_name text, owner text, how_many integer,
                                      lease interval)
RETURNS SETOF envq.envelopes
LANGUAGE plpgsql AS $$
BEGIN
    -- The ends (as finish_many; every returned row is not RUNNING), then in the same
    -- transaction, durable, the claim of up to how_many (RUNNING, owned by owner): a
    -- node that ends attempts starts the next ones in one round trip.
    -- The queue's lock first (see finish_many).
    PERFORM pg_advisory_xact_lock_shared({queue_lock}, hashtext(s.queue))
       FROM (SELECT queue_name AS queue
             UNION SELECT l.queue FROM envq.envelopes AS l WHERE l.seq = ANY(end_seqs)) AS s
      ORDER BY s.queue;
    RETURN QUERY
{finish_update_rows};
    IF how_many > 0 THEN
        RETURN QUERY
{claim_update}
    END IF;
END
$$;
COMMENT ON FUNCTION envq.finish_and_claim IS
    'finish_many, then claim up to how_many more, in one transaction: the ended rows '
    '(not running) and the claimed ones (running).';

CREATE FUNCTION envq.expire(seq bigint, token uuid,
                            decision envq.decision_kind DEFAULT NULL,
                            due_at timestamptz DEFAULT NULL,
                            failures integer DEFAULT NULL,
                            error jsonb DEFAULT NULL,
                            at timestamptz DEFAULT NULL)
RETURNS envq.envelope_state
LANGUAGE plpgsql AS $$
DECLARE
    ended envq.envelope_state;
BEGIN
    -- The queue's lock first (see finish_many).
    PERFORM pg_advisory_xact_lock_shared({queue_lock}, hashtext(l.queue))
       FROM envq.envelopes AS l WHERE l.seq = expire.seq;
    UPDATE envq.envelopes AS e
       SET state = envq.envelope_target('running', '{expired}', e.kind, q.state, false,
                                        expire.decision, NULL, q.stop_mode, false),
           event = '{expired}', decision = expire.decision, due_at = expire.due_at,
           updated_at = coalesce(expire.at, e.updated_at),
           failures = coalesce(expire.failures, e.failures), ended_token = NULL,
           last_error = coalesce(expire.error, e.last_error),
           history = CASE WHEN expire.error IS NULL THEN e.history
                          ELSE envq.story(e.history, e.attempt, '{expired}', e.updated_at,
                                          e.lease_owner, expire.error) END,
           lease_token = NULL, lease_owner = NULL, lease_expires_at = NULL
      FROM envq.queues AS q
     WHERE e.seq = expire.seq AND q.name = e.queue AND e.state = 'running'
       AND e.lease_token = expire.token AND e.lease_expires_at <= clock_timestamp()
    RETURNING e.state INTO ended;
    RETURN ended;
END
$$;
COMMENT ON FUNCTION envq.expire IS
    'Ends an attempt whose lease expired (the reaper''s move), where the tables lead, '
    'only while that lease is still the attempt''s; NULL when it is not. at: the '
    'instant due_at was measured from, the move''s time (NULL: now).';

CREATE FUNCTION envq.due(queue_name text) RETURNS integer
LANGUAGE sql AS $$
    WITH moved AS (
        UPDATE envq.envelopes AS e SET state = '{ready}', event = '{due}'
         WHERE e.seq IN (SELECT d.seq FROM envq.envelopes AS d
                          WHERE d.queue = queue_name AND d.state = 'delayed'
                            AND d.due_at <= clock_timestamp()
                            FOR UPDATE SKIP LOCKED)
        RETURNING 1)
    SELECT count(*)::integer FROM moved
$$;
COMMENT ON FUNCTION envq.due IS
    'Moves the DELAYED envelopes of a queue whose time has come to READY.';

CREATE FUNCTION envq.broadcast(queue_name text, what envq.envelope_event)
RETURNS integer
LANGUAGE sql AS $$
    -- A start arms a buffered or parked envelope with the wait it had left when it
    -- was sent or parked (its last move), not the time that passed meanwhile.
    WITH now_ AS (SELECT clock_timestamp() AS t),
    armed AS (
        SELECT e.seq,
               CASE WHEN what = '{start}' AND e.state IN ({armed})
                         AND e.due_at IS NOT NULL
                    THEN n.t + greatest(e.due_at - e.updated_at, interval '0')
                    ELSE e.due_at END AS due,
               what = '{start}' AND e.state IN ({armed}) AND e.due_at IS NOT NULL AS arms,
               n.t
          FROM envq.envelopes AS e, now_ AS n
         WHERE e.queue = queue_name AND e.state IN ({live})
    ),
    moved AS (
        UPDATE envq.envelopes AS e
           SET state = envq.envelope_target(e.state, what, e.kind, q.state,
                                            coalesce(a.due > a.t, false),
                                            NULL, NULL, q.stop_mode, false),
               event = what, wait = coalesce(a.due > a.t, false),
               -- An envelope the start arms moves at the instant its due time counts
               -- from, unless a move this statement waited for came later (then the
               -- trigger stamps it: an envelope's moves never go back in time). The
               -- others keep their due time as the row has it now, and are stamped.
               due_at = CASE WHEN a.arms THEN a.due ELSE e.due_at END,
               updated_at = CASE WHEN a.arms THEN greatest(a.t, e.updated_at)
                                 ELSE e.updated_at END
          FROM envq.queues AS q, armed AS a
         WHERE q.name = queue_name AND e.queue = queue_name AND e.seq = a.seq
           AND e.state IN ({live})
           AND envq.envelope_target(e.state, what, e.kind, q.state,
                                    coalesce(a.due > a.t, false),
                                    NULL, NULL, q.stop_mode, false) IS NOT NULL
        RETURNING 1)
    SELECT count(*)::integer FROM moved
$$;
COMMENT ON FUNCTION envq.broadcast IS
    'A queue-side event (start, stop, terminate) applied to every live envelope of a '
    'queue it moves, each where the tables lead (RUNNING ones are left to their attempts).';
"""


# The rows are picked once, in a materialized CTE: as a subquery of the UPDATE's FROM,
# a plan made for a table believed empty (a nested loop with the subquery inside)
# scanned it again for each row updated, and each scan, skipping the rows the
# statement had just updated, picked the next ones: a claim of one took them all.
CLAIM_UPDATE: Final = """\
    WITH picked AS MATERIALIZED (
        SELECT c.seq FROM envq.envelopes AS c
         WHERE c.queue = queue_name AND c.state = '{ready}'
           AND EXISTS (SELECT FROM envq.queues AS q
                        WHERE q.name = queue_name AND q.state IN ({dispatching}))
         ORDER BY c.updated_at, c.seq
         LIMIT how_many
           FOR UPDATE OF c SKIP LOCKED)
    UPDATE envq.envelopes AS e
       SET state = '{running}', event = '{dispatch}', attempt = e.attempt + 1,
           lease_token = gen_random_uuid(), lease_owner = owner,
           lease_expires_at = clock_timestamp() + lease
      FROM picked
     WHERE e.seq = picked.seq
    RETURNING e.*;"""


#: The class of the advisory lock of a queue (its key: ``hashtext`` of its name): held
#: shared by every end while it computes its targets, exclusive by every lifecycle call
#: and ban while it moves the queue and its envelopes ('envq' in ASCII).
QUEUE_LOCK: Final = 1701737841

#: Taken by a lifecycle call or a ban, first in its transaction ($1: the queue).
LOCK_QUEUE: Final = f"SELECT pg_advisory_xact_lock({QUEUE_LOCK}, hashtext($1))"

#: Taken by an end the database functions do not lock for (the reaper, before it
#: reads its move's instant): the same lock, shared.
SHARE_QUEUE: Final = f"SELECT pg_advisory_xact_lock_shared({QUEUE_LOCK}, hashtext($1))"

# The queue's lock, held by an end before its UPDATE (finish_many's first statement).
LOCK_QUEUES_OF_SEQS: Final = """\
    -- An end computes its target from the queue's lifecycle state, so it holds the
    -- queue's lock (shared) from a statement before its UPDATE; a lifecycle call or a
    -- ban holds it exclusive, first, while it moves the queue and its envelopes. The
    -- call waits for the ends in progress and moves what they left (a stop parks a
    -- retry's DELAYED row), or an end begun during the call waits for it and its
    -- UPDATE, a later statement, reads the new state. Read in the UPDATE alone, a stop
    -- not yet committed was RUNNING to the end, and an end committed after the stop's
    -- moves had read its row RUNNING left a retry DELAYED in a stopped queue, which no
    -- later call moves. An advisory lock, not the queue's row FOR SHARE: no write of
    -- the row at every end, and the lock manager's queue lets a waiting lifecycle call
    -- in before later ends (row share locks would let them starve it).
    SELECT pg_advisory_xact_lock_shared({queue_lock}, hashtext(s.queue))
      FROM (SELECT DISTINCT l.queue FROM envq.envelopes AS l WHERE l.seq = ANY(seqs)) AS s
     ORDER BY s.queue"""


FINISH_UPDATE: Final = """\
    WITH f AS MATERIALIZED (
        SELECT * FROM unnest(seqs, tokens, outcomes, decisions, causes, delays, failures,
                             errors)
                   AS u(seq, token, outcome, decision, cause, delay, failures, error)),
    -- Rows are locked in seq order, as a renewal locks them (no deadlock between two).
    locked AS MATERIALIZED (
        SELECT l.seq FROM envq.envelopes AS l
         WHERE l.seq IN (SELECT f.seq FROM f)
         ORDER BY l.seq
           FOR UPDATE),
    -- The instant of the ends, read once: the moves' time and what their due times
    -- are measured from.
    now_ AS MATERIALIZED (SELECT clock_timestamp() AS t)
    UPDATE envq.envelopes AS e
       SET state = envq.envelope_target('running', f.outcome, e.kind, q.state, false,
                                        f.decision, f.cause, q.stop_mode, false),
           event = f.outcome, decision = f.decision, cause = f.cause, limited = false,
           due_at = coalesce(n.t + f.delay * interval '1 second',
                             envq.next_due(e.schedule, e.interval_s, e.due_at, n.t)),
           updated_at = n.t,
           failures = coalesce(f.failures, e.failures), ended_token = e.lease_token,
           last_error = coalesce(f.error, e.last_error),
           history = CASE WHEN f.error IS NULL THEN e.history
                          ELSE envq.story(e.history, e.attempt, f.outcome, e.updated_at,
                                          e.lease_owner, f.error) END,
           lease_token = NULL, lease_owner = NULL, lease_expires_at = NULL
      FROM f, locked, now_ AS n, envq.queues AS q
     WHERE e.seq = f.seq AND locked.seq = e.seq AND q.name = e.queue AND e.state = 'running'
       AND e.lease_token = f.token AND e.lease_expires_at > clock_timestamp()
    RETURNING e.seq, e.state"""


SCHEDULES: Final = """\
-- ------------------------------------------------------------------------------------
-- Schedules: calendar (cron) envelopes, and the next run of a FIXED_DELAY or FIXED_RATE
-- envelope computed here, on the database's clock, from the row's scheduled start.
-- ------------------------------------------------------------------------------------
ALTER TABLE envq.envelopes
    ADD COLUMN cron text,
    ADD COLUMN cron_tz text,
    ADD CONSTRAINT envelopes_calendar CHECK (
        (cron IS NULL) = (cron_tz IS NULL)
        AND (cron IS NULL OR (interval_s = 0 AND schedule = 'fixed_delay')));
COMMENT ON COLUMN envq.envelopes.cron IS
    'A calendar envelope''s cron expression (NULL: timed by schedule and interval_s); '
    'the nodes find its fires, the database''s clock says when they have come.';
COMMENT ON COLUMN envq.envelopes.cron_tz IS
    'The IANA time zone the cron expression is read in (set with cron).';

CREATE FUNCTION envq.next_due(timing envq.schedule, every double precision,
                              scheduled timestamptz, ended timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    n bigint;
BEGIN
    IF timing = 'fixed_delay' OR scheduled IS NULL OR every IS NULL OR every <= 0 THEN
        RETURN ended + coalesce(every, 0) * interval '1 second';
    END IF;
    -- The first grid point scheduled + n * every (n >= 1) strictly after ended; the
    -- quotient is a first guess, corrected both ways against rounding.
    n := greatest(1, floor(extract(epoch FROM ended - scheduled)::float8 / every)::bigint + 1);
    WHILE n > 1 AND scheduled + ((n - 1) * every) * interval '1 second' > ended LOOP
        n := n - 1;
    END LOOP;
    WHILE scheduled + (n * every) * interval '1 second' <= ended LOOP
        n := n + 1;
    END LOOP;
    RETURN scheduled + (n * every) * interval '1 second';
END
$$;
COMMENT ON FUNCTION envq.next_due IS
    'When a periodic run that ended at ended and was scheduled at scheduled runs next: '
    'every seconds after its end (fixed_delay), or the first point of the grid '
    'scheduled + n * every after its end (fixed_rate; missed points are skipped).';
"""
