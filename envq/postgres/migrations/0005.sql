-- envq schema migration: version 4 -> 5 (frozen: never edit a released migration).
-- One reading of the clock per move: a statement that measures a due time from an
-- instant (a send, a start's arming, an end or an expiry that delays) gives that
-- instant as the row's updated_at, which the trigger keeps and the journal records as
-- the move's time (they were two readings: under load the journal's could be later,
-- and a due move then looked early from it). The trigger stamps only a move the
-- statement did not time (on a send: left at the default, the transaction's start).
-- envq.expire takes the instant. A send is journalled after its statement, from the
-- rows it inserted (envq.journal_sends): the BEFORE trigger journalled it before the
-- dedup index had its say, so a send that waited for the end of its id's live
-- envelope was left out of the journal, and a dedup could be put in.
-- An end (finish, finish_many, finish_and_claim, expire) holds its queue's advisory
-- lock (shared) before it computes its target, as lifecycle calls and bans hold it
-- exclusive: an end that read a stop not yet committed as RUNNING left a retry
-- DELAYED in a stopped queue, stranded by a later terminate. (Nodes of schema 4 do
-- not take the lock in their lifecycle calls: the race stays open for those calls
-- until every node runs schema 5's envq.)
-- A new envelope's queue is checked and its row held (FOR KEY SHARE) by the trigger
-- that already reads it, and a queue is deleted only without envelopes
-- (envq.queues_keep): the foreign key looked the row up a second time for each row
-- sent (a fifth of a send's time in the server).
DROP FUNCTION envq.expire(bigint, uuid, envq.decision_kind, timestamptz, integer, jsonb);
CREATE OR REPLACE FUNCTION envq.envelopes_check() RETURNS trigger
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
            RAISE EXCEPTION USING ERRCODE = 'EQ001',
                MESSAGE = format('envq: envelope %s cannot move from queue %L to queue %L',
                                 OLD.seq, OLD.queue, NEW.queue);
        END IF;
        -- A running envelope's row group is relabelled (its type banned, an operator's
        -- cancel); an operator's retry gives it its own group back.
        IF NEW.kind IS DISTINCT FROM OLD.kind
           AND NOT (OLD.state = 'running' AND NEW.kind IN ('blacklisted', 'cancelled'))
           AND NOT (NEW.event IS NOT DISTINCT FROM 'retry' AND NEW.kind IN ('one_off', 'periodic'))
        THEN
            RAISE EXCEPTION USING ERRCODE = 'EQ001',
                MESSAGE = format('envq: envelope %s cannot change kind from %s to %s '
                                 '(only a running one is relabelled, to %s; a retry gives '
                                 'it its own back)', OLD.seq, OLD.kind, NEW.kind,
                                 'blacklisted or cancelled');
        END IF;
        IF NEW.event IS NULL THEN
            IF NEW.state IS DISTINCT FROM OLD.state THEN
                RAISE EXCEPTION USING ERRCODE = 'EQ001',
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
        RAISE EXCEPTION USING ERRCODE = 'EQ001',
            MESSAGE = format('envq: there is no queue named %L', NEW.queue);
    END IF;
    IF TG_OP = 'INSERT' THEN
        rejected := envq.queue_refusal(queue_now, 'send');
        IF rejected IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'EQ003',
                MESSAGE = format('envq: queue %L is %s: send is rejected (%s)',
                                 NEW.queue, queue_now, rejected);
        END IF;
    END IF;
    allowed := envq.envelope_target(source, NEW.event, row_kind, queue_now,
                                    coalesce(NEW.wait, false), NEW.decision, NEW.cause,
                                    mode_now, coalesce(NEW.limited, false));
    IF allowed IS NULL OR allowed IS DISTINCT FROM NEW.state THEN
        RAISE EXCEPTION USING ERRCODE = 'EQ001',
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
CREATE OR REPLACE FUNCTION envq.journal_move(moved envq.envelopes, source envq.envelope_state,
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
CREATE OR REPLACE FUNCTION envq.broadcast(queue_name text, what envq.envelope_event)
RETURNS integer
LANGUAGE sql AS $$
    -- A start arms a buffered or parked envelope with the wait it had left when it
    -- was sent or parked (its last move), not the time that passed meanwhile.
    WITH now_ AS (SELECT clock_timestamp() AS t),
    armed AS (
        SELECT e.seq,
               CASE WHEN what = 'start' AND e.state IN ('buffered', 'parked')
                         AND e.due_at IS NOT NULL
                    THEN n.t + greatest(e.due_at - e.updated_at, interval '0')
                    ELSE e.due_at END AS due,
               what = 'start' AND e.state IN ('buffered', 'parked') AND e.due_at IS NOT NULL AS arms,
               n.t
          FROM envq.envelopes AS e, now_ AS n
         WHERE e.queue = queue_name AND e.state IN ('buffered', 'ready', 'delayed', 'running', 'parked')
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
           AND e.state IN ('buffered', 'ready', 'delayed', 'running', 'parked')
           AND envq.envelope_target(e.state, what, e.kind, q.state,
                                    coalesce(a.due > a.t, false),
                                    NULL, NULL, q.stop_mode, false) IS NOT NULL
        RETURNING 1)
    SELECT count(*)::integer FROM moved
$$;
COMMENT ON FUNCTION envq.broadcast IS
    'A queue-side event (start, stop, terminate) applied to every live envelope of a '
    'queue it moves, each where the tables lead (RUNNING ones are left to their attempts).';
CREATE OR REPLACE FUNCTION envq.finish(seq bigint, token uuid, outcome envq.envelope_event,
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
    PERFORM pg_advisory_xact_lock_shared(1701737841, hashtext(l.queue))
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
CREATE OR REPLACE FUNCTION envq.finish_many(seqs bigint[], tokens uuid[],
                                 outcomes envq.envelope_event[],
                                 decisions envq.decision_kind[],
                                 causes envq.cancel_cause[], delays double precision[],
                                 failures integer[], errors jsonb[])
RETURNS TABLE (seq bigint, state envq.envelope_state)
LANGUAGE sql AS $$
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
    SELECT pg_advisory_xact_lock_shared(1701737841, hashtext(s.queue))
      FROM (SELECT DISTINCT l.queue FROM envq.envelopes AS l WHERE l.seq = ANY(seqs)) AS s
     ORDER BY s.queue;
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
    RETURNING e.seq, e.state
$$;
COMMENT ON FUNCTION envq.finish_many IS
    'finish for many attempts in one statement (one commit): the rows it returns are '
    'the attempts whose token held; the others changed nothing.';
CREATE OR REPLACE FUNCTION envq.finish_and_claim(end_seqs bigint[], end_tokens uuid[],
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
    PERFORM pg_advisory_xact_lock_shared(1701737841, hashtext(s.queue))
       FROM (SELECT queue_name AS queue
             UNION SELECT l.queue FROM envq.envelopes AS l WHERE l.seq = ANY(end_seqs)) AS s
      ORDER BY s.queue;
    RETURN QUERY
    WITH f AS MATERIALIZED (
        SELECT * FROM unnest(end_seqs, end_tokens, end_outcomes, end_decisions, end_causes,
                             end_delays, end_failures, end_errors)
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
    RETURNING e.*;
    IF how_many > 0 THEN
        RETURN QUERY
    WITH picked AS MATERIALIZED (
        SELECT c.seq FROM envq.envelopes AS c
         WHERE c.queue = queue_name AND c.state = 'ready'
           AND EXISTS (SELECT FROM envq.queues AS q
                        WHERE q.name = queue_name AND q.state IN ('running', 'stopping'))
         ORDER BY c.updated_at, c.seq
         LIMIT how_many
           FOR UPDATE OF c SKIP LOCKED)
    UPDATE envq.envelopes AS e
       SET state = 'running', event = 'dispatch', attempt = e.attempt + 1,
           lease_token = gen_random_uuid(), lease_owner = owner,
           lease_expires_at = clock_timestamp() + lease
      FROM picked
     WHERE e.seq = picked.seq
    RETURNING e.*;
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
    PERFORM pg_advisory_xact_lock_shared(1701737841, hashtext(l.queue))
       FROM envq.envelopes AS l WHERE l.seq = expire.seq;
    UPDATE envq.envelopes AS e
       SET state = envq.envelope_target('running', 'attempt_expired', e.kind, q.state, false,
                                        expire.decision, NULL, q.stop_mode, false),
           event = 'attempt_expired', decision = expire.decision, due_at = expire.due_at,
           updated_at = coalesce(expire.at, e.updated_at),
           failures = coalesce(expire.failures, e.failures), ended_token = NULL,
           last_error = coalesce(expire.error, e.last_error),
           history = CASE WHEN expire.error IS NULL THEN e.history
                          ELSE envq.story(e.history, e.attempt, 'attempt_expired', e.updated_at,
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
CREATE FUNCTION envq.journal_sends() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO envq.journal (queue, seq, from_state, to_state, event, queue_state, at)
    SELECT s.queue, s.seq, NULL, s.state::text, 'send', q.state::text, s.updated_at
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
ALTER TABLE envq.envelopes DROP CONSTRAINT envelopes_queue_fkey;
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
COMMENT ON SCHEMA envq IS 'envq schema version 5';
INSERT INTO envq.schema_version (version, compatible_from) VALUES (5, 4);
