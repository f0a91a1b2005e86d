-- envq schema migration: version 3 -> 4 (frozen: never edit a released migration).
-- Leases are renewed by token (a claim whose reply was lost is not kept alive by
-- its owner: adopt() takes it back, or it expires), and a renewal tells a node which
-- attempts an operator cancelled; hold() fences a decision; an end records its
-- token (ended_token) and, when it ended with an error, the envelope's story
-- (last_error, history); schema_version names the oldest version whose envq still
-- runs on this one; envq.counts keeps the envelopes per state (a send's capacity
-- check no longer counts rows); ready envelopes are claimed in the order they became
-- ready, from an index of their own; an operator's moves (retry, cancel, discard)
-- are events of the tables, and only an ended row may be deleted; the journal names
-- the node of each attempt's moves, and is read by envelope through an index.
ALTER TYPE envq.envelope_event ADD VALUE 'retry' BEFORE 'attempt_ok';
ALTER TYPE envq.envelope_event ADD VALUE 'cancel' BEFORE 'attempt_ok';
ALTER TYPE envq.envelope_event ADD VALUE 'discard' BEFORE 'attempt_ok';
ALTER TYPE envq.envelope_kind ADD VALUE 'cancelled';
ALTER TABLE envq.schema_version ADD COLUMN compatible_from integer;
UPDATE envq.schema_version SET compatible_from = version;
ALTER TABLE envq.schema_version ALTER COLUMN compatible_from SET NOT NULL;
ALTER TABLE envq.envelopes ADD COLUMN last_error jsonb;
ALTER TABLE envq.envelopes ADD COLUMN history jsonb;
ALTER TABLE envq.envelopes ADD COLUMN ended_token uuid;
DROP FUNCTION envq.renew(text, text, interval);
DROP FUNCTION envq.finish(bigint, uuid, envq.envelope_event, envq.decision_kind,
                          envq.cancel_cause, boolean, timestamptz, integer);
DROP FUNCTION envq.finish_many(bigint[], uuid[], envq.envelope_event[],
                               envq.decision_kind[], envq.cancel_cause[],
                               double precision[], integer[]);
DROP FUNCTION envq.finish_and_claim(bigint[], uuid[], envq.envelope_event[],
                                    envq.decision_kind[], envq.cancel_cause[],
                                    double precision[], integer[], text, text, integer,
                                    interval);
DROP FUNCTION envq.expire(bigint, uuid, envq.decision_kind, timestamptz, integer);
CREATE OR REPLACE FUNCTION envq.envelope_target(state envq.envelope_state, event envq.envelope_event, kind envq.envelope_kind, queue envq.queue_state, wait boolean, decision envq.decision_kind, cause envq.cancel_cause, mode envq.stop_mode, limited boolean)
RETURNS envq.envelope_state LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
  RETURN CASE
    WHEN state IS NULL AND event = 'send'
    THEN CASE
            WHEN queue = 'init' THEN 'buffered'::envq.envelope_state
            WHEN queue IN ('running', 'stopping', 'stopped', 'terminated') THEN CASE
                WHEN NOT wait THEN 'ready'::envq.envelope_state
                WHEN wait THEN 'delayed'::envq.envelope_state
            END
        END
    WHEN state = 'buffered' AND event = 'start'
    THEN CASE
            WHEN NOT wait THEN 'ready'::envq.envelope_state
            WHEN wait THEN 'delayed'::envq.envelope_state
        END
    WHEN state = 'buffered' AND event = 'terminate'
    THEN 'returned'::envq.envelope_state
    WHEN state = 'buffered' AND event = 'blacklist'
    THEN 'stopped'::envq.envelope_state
    WHEN state = 'buffered' AND event = 'cancel'
    THEN 'stopped'::envq.envelope_state
    WHEN state = 'ready' AND event = 'dispatch'
    THEN 'running'::envq.envelope_state
    WHEN state = 'ready' AND event = 'stop'
    THEN CASE
            WHEN mode = 'drain' THEN NULL
            WHEN mode = 'stop' THEN 'parked'::envq.envelope_state
        END
    WHEN state = 'ready' AND event = 'blacklist'
    THEN 'stopped'::envq.envelope_state
    WHEN state = 'ready' AND event = 'cancel'
    THEN 'stopped'::envq.envelope_state
    WHEN state = 'delayed' AND event = 'due'
    THEN 'ready'::envq.envelope_state
    WHEN state = 'delayed' AND event = 'stop'
    THEN 'parked'::envq.envelope_state
    WHEN state = 'delayed' AND event = 'blacklist'
    THEN 'stopped'::envq.envelope_state
    WHEN state = 'delayed' AND event = 'cancel'
    THEN 'stopped'::envq.envelope_state
    WHEN state = 'running' AND event = 'attempt_ok'
    THEN CASE
            WHEN kind = 'one_off' THEN 'succeeded'::envq.envelope_state
            WHEN kind = 'periodic' THEN CASE
                WHEN queue IN ('init', 'stopping', 'stopped', 'terminated') THEN 'parked'::envq.envelope_state
                WHEN queue = 'running' THEN 'delayed'::envq.envelope_state
            END
            WHEN kind IN ('blacklisted', 'cancelled') THEN 'stopped'::envq.envelope_state
        END
    WHEN state = 'running' AND event = 'attempt_error'
    THEN CASE
            WHEN kind = 'one_off' THEN CASE
                WHEN queue IN ('init', 'stopping', 'stopped', 'terminated') THEN CASE
                    WHEN decision IS NULL OR decision = 'drop' THEN 'failed'::envq.envelope_state
                    WHEN decision IN ('retry_now', 'retry_after') THEN 'parked'::envq.envelope_state
                END
                WHEN queue = 'running' THEN CASE
                    WHEN decision IS NULL OR decision = 'drop' THEN 'failed'::envq.envelope_state
                    WHEN decision = 'retry_now' THEN CASE
                        WHEN NOT limited THEN 'ready'::envq.envelope_state
                        WHEN limited THEN 'delayed'::envq.envelope_state
                    END
                    WHEN decision = 'retry_after' THEN 'delayed'::envq.envelope_state
                END
            END
            WHEN kind = 'periodic' THEN CASE
                WHEN queue IN ('init', 'stopping', 'stopped', 'terminated') THEN CASE
                    WHEN decision IS NULL OR decision IN ('retry_now', 'retry_after') THEN 'parked'::envq.envelope_state
                    WHEN decision = 'drop' THEN 'failed'::envq.envelope_state
                END
                WHEN queue = 'running' THEN CASE
                    WHEN decision IS NULL OR decision = 'retry_after' THEN 'delayed'::envq.envelope_state
                    WHEN decision = 'drop' THEN 'failed'::envq.envelope_state
                    WHEN decision = 'retry_now' THEN CASE
                        WHEN NOT limited THEN 'ready'::envq.envelope_state
                        WHEN limited THEN 'delayed'::envq.envelope_state
                    END
                END
            END
            WHEN kind IN ('blacklisted', 'cancelled') THEN 'stopped'::envq.envelope_state
        END
    WHEN state = 'running' AND event = 'attempt_timeout'
    THEN CASE
            WHEN kind = 'one_off' THEN CASE
                WHEN queue IN ('init', 'stopping', 'stopped', 'terminated') THEN CASE
                    WHEN decision IS NULL OR decision = 'drop' THEN 'failed'::envq.envelope_state
                    WHEN decision IN ('retry_now', 'retry_after') THEN 'parked'::envq.envelope_state
                END
                WHEN queue = 'running' THEN CASE
                    WHEN decision IS NULL OR decision = 'drop' THEN 'failed'::envq.envelope_state
                    WHEN decision = 'retry_now' THEN CASE
                        WHEN NOT limited THEN 'ready'::envq.envelope_state
                        WHEN limited THEN 'delayed'::envq.envelope_state
                    END
                    WHEN decision = 'retry_after' THEN 'delayed'::envq.envelope_state
                END
            END
            WHEN kind = 'periodic' THEN CASE
                WHEN queue IN ('init', 'stopping', 'stopped', 'terminated') THEN CASE
                    WHEN decision IS NULL OR decision IN ('retry_now', 'retry_after') THEN 'parked'::envq.envelope_state
                    WHEN decision = 'drop' THEN 'failed'::envq.envelope_state
                END
                WHEN queue = 'running' THEN CASE
                    WHEN decision IS NULL OR decision = 'retry_after' THEN 'delayed'::envq.envelope_state
                    WHEN decision = 'drop' THEN 'failed'::envq.envelope_state
                    WHEN decision = 'retry_now' THEN CASE
                        WHEN NOT limited THEN 'ready'::envq.envelope_state
                        WHEN limited THEN 'delayed'::envq.envelope_state
                    END
                END
            END
            WHEN kind IN ('blacklisted', 'cancelled') THEN 'stopped'::envq.envelope_state
        END
    WHEN state = 'running' AND event = 'attempt_stop'
    THEN 'stopped'::envq.envelope_state
    WHEN state = 'running' AND event = 'attempt_stop_type'
    THEN 'stopped'::envq.envelope_state
    WHEN state = 'running' AND event = 'attempt_no_retry'
    THEN CASE
            WHEN kind IN ('one_off', 'periodic') THEN 'failed'::envq.envelope_state
            WHEN kind IN ('blacklisted', 'cancelled') THEN 'stopped'::envq.envelope_state
        END
    WHEN state = 'running' AND event = 'attempt_cancelled'
    THEN CASE
            WHEN kind IN ('one_off', 'periodic') THEN CASE
                WHEN cause IS NULL THEN NULL
                WHEN cause = 'stop' THEN 'parked'::envq.envelope_state
                WHEN cause = 'terminate' THEN 'returned'::envq.envelope_state
            END
            WHEN kind IN ('blacklisted', 'cancelled') THEN 'stopped'::envq.envelope_state
        END
    WHEN state = 'running' AND event = 'attempt_expired'
    THEN CASE
            WHEN kind = 'one_off' THEN CASE
                WHEN queue IN ('init', 'stopping', 'stopped', 'terminated') THEN CASE
                    WHEN decision IS NULL OR decision = 'drop' THEN 'failed'::envq.envelope_state
                    WHEN decision IN ('retry_now', 'retry_after') THEN 'parked'::envq.envelope_state
                END
                WHEN queue = 'running' THEN CASE
                    WHEN decision IS NULL OR decision = 'drop' THEN 'failed'::envq.envelope_state
                    WHEN decision = 'retry_now' THEN CASE
                        WHEN NOT limited THEN 'ready'::envq.envelope_state
                        WHEN limited THEN 'delayed'::envq.envelope_state
                    END
                    WHEN decision = 'retry_after' THEN 'delayed'::envq.envelope_state
                END
            END
            WHEN kind = 'periodic' THEN CASE
                WHEN queue IN ('init', 'stopping', 'stopped', 'terminated') THEN CASE
                    WHEN decision IS NULL OR decision IN ('retry_now', 'retry_after') THEN 'parked'::envq.envelope_state
                    WHEN decision = 'drop' THEN 'failed'::envq.envelope_state
                END
                WHEN queue = 'running' THEN CASE
                    WHEN decision IS NULL OR decision = 'retry_after' THEN 'delayed'::envq.envelope_state
                    WHEN decision = 'drop' THEN 'failed'::envq.envelope_state
                    WHEN decision = 'retry_now' THEN CASE
                        WHEN NOT limited THEN 'ready'::envq.envelope_state
                        WHEN limited THEN 'delayed'::envq.envelope_state
                    END
                END
            END
            WHEN kind IN ('blacklisted', 'cancelled') THEN 'stopped'::envq.envelope_state
        END
    WHEN state = 'parked' AND event = 'start'
    THEN CASE
            WHEN NOT wait THEN 'ready'::envq.envelope_state
            WHEN wait THEN 'delayed'::envq.envelope_state
        END
    WHEN state = 'parked' AND event = 'terminate'
    THEN 'returned'::envq.envelope_state
    WHEN state = 'parked' AND event = 'blacklist'
    THEN 'stopped'::envq.envelope_state
    WHEN state = 'parked' AND event = 'cancel'
    THEN 'stopped'::envq.envelope_state
    WHEN state = 'failed' AND event = 'retry'
    THEN CASE
            WHEN queue = 'init' THEN 'buffered'::envq.envelope_state
            WHEN queue IN ('running', 'stopping', 'stopped', 'terminated') THEN 'ready'::envq.envelope_state
        END
    WHEN state = 'stopped' AND event = 'retry'
    THEN CASE
            WHEN queue = 'init' THEN 'buffered'::envq.envelope_state
            WHEN queue IN ('running', 'stopping', 'stopped', 'terminated') THEN 'ready'::envq.envelope_state
        END
  END;
END
$$;
COMMENT ON FUNCTION envq.envelope_target IS 'The state an event leads an envelope to (state NULL: a new one), as envq._machine.target; NULL when the event does not move it.';

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
    SELECT q.state, q.stop_mode, q.journal INTO queue_now, mode_now, journal_on
      FROM envq.queues AS q WHERE q.name = NEW.queue;
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
    IF journal_on THEN
        -- The node whose attempt moved: the claimer, or the holder of the lease ended.
        PERFORM envq.journal_move(NEW, source, queue_now,
            CASE WHEN TG_OP = 'UPDATE' THEN coalesce(NEW.lease_owner, OLD.lease_owner) END);
    END IF;
    NEW.event := NULL; NEW.decision := NULL; NEW.cause := NULL;
    NEW.wait := NULL; NEW.limited := NULL;
    -- The time of the move itself: a start measures the wait left from it.
    NEW.updated_at := clock_timestamp();
    RETURN NEW;
END
$$;
COMMENT ON FUNCTION envq.envelopes_check() IS
    'Refuses any envelope row whose change of state the tables of envq._machine do not allow.';

CREATE OR REPLACE FUNCTION envq.claim(queue_name text, owner text, how_many integer, lease interval)
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
    -- the oldest dropped past 20.
    SELECT CASE WHEN jsonb_array_length(h) > 20 THEN h - 0 ELSE h END
      FROM (SELECT coalesce(history, '[]'::jsonb) || jsonb_build_array(jsonb_build_object(
                'attempt', attempt, 'outcome', outcome,
                'started', extract(epoch FROM started)::float8,
                'ended', extract(epoch FROM clock_timestamp())::float8,
                'node', node, 'error', error - 'traceback')) AS h) AS s
$$;
COMMENT ON FUNCTION envq.story IS
    'An envelope''s story with one more failed attempt (the latest 20 kept).';

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
    WITH f AS MATERIALIZED (
        SELECT * FROM unnest(seqs, tokens, outcomes, decisions, causes, delays, failures,
                             errors)
                   AS u(seq, token, outcome, decision, cause, delay, failures, error)),
    -- Rows are locked in seq order, as a renewal locks them (no deadlock between two).
    locked AS MATERIALIZED (
        SELECT l.seq FROM envq.envelopes AS l
         WHERE l.seq IN (SELECT f.seq FROM f)
         ORDER BY l.seq
           FOR UPDATE)
    UPDATE envq.envelopes AS e
       SET state = envq.envelope_target('running', f.outcome, e.kind, q.state, false,
                                        f.decision, f.cause, q.stop_mode, false),
           event = f.outcome, decision = f.decision, cause = f.cause, limited = false,
           due_at = coalesce(clock_timestamp() + f.delay * interval '1 second',
                             envq.next_due(e.schedule, e.interval_s, e.due_at,
                                           clock_timestamp())),
           failures = coalesce(f.failures, e.failures), ended_token = e.lease_token,
           last_error = coalesce(f.error, e.last_error),
           history = CASE WHEN f.error IS NULL THEN e.history
                          ELSE envq.story(e.history, e.attempt, f.outcome, e.updated_at,
                                          e.lease_owner, f.error) END,
           lease_token = NULL, lease_owner = NULL, lease_expires_at = NULL
      FROM f, locked, envq.queues AS q
     WHERE e.seq = f.seq AND locked.seq = e.seq AND q.name = e.queue AND e.state = 'running'
       AND e.lease_token = f.token AND e.lease_expires_at > clock_timestamp()
    RETURNING e.seq, e.state
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
           FOR UPDATE)
    UPDATE envq.envelopes AS e
       SET state = envq.envelope_target('running', f.outcome, e.kind, q.state, false,
                                        f.decision, f.cause, q.stop_mode, false),
           event = f.outcome, decision = f.decision, cause = f.cause, limited = false,
           due_at = coalesce(clock_timestamp() + f.delay * interval '1 second',
                             envq.next_due(e.schedule, e.interval_s, e.due_at,
                                           clock_timestamp())),
           failures = coalesce(f.failures, e.failures), ended_token = e.lease_token,
           last_error = coalesce(f.error, e.last_error),
           history = CASE WHEN f.error IS NULL THEN e.history
                          ELSE envq.story(e.history, e.attempt, f.outcome, e.updated_at,
                                          e.lease_owner, f.error) END,
           lease_token = NULL, lease_owner = NULL, lease_expires_at = NULL
      FROM f, locked, envq.queues AS q
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
                            error jsonb DEFAULT NULL)
RETURNS envq.envelope_state
LANGUAGE plpgsql AS $$
DECLARE
    ended envq.envelope_state;
BEGIN
    UPDATE envq.envelopes AS e
       SET state = envq.envelope_target('running', 'attempt_expired', e.kind, q.state, false,
                                        expire.decision, NULL, q.stop_mode, false),
           event = 'attempt_expired', decision = expire.decision, due_at = expire.due_at,
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
    'only while that lease is still the attempt''s; NULL when it is not.';

CREATE FUNCTION envq.envelopes_discard() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    journal_on boolean;
BEGIN
    -- A handed-back row leaves with its envelope (terminate()); an ended one is
    -- discarded (the tables' discard); a live one never leaves.
    IF OLD.state = 'returned' THEN
        RETURN OLD;
    END IF;
    IF OLD.state NOT IN ('succeeded', 'failed', 'stopped') THEN
        RAISE EXCEPTION USING ERRCODE = 'EQ001',
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

DROP INDEX envq.envelopes_ready;
-- Ready envelopes in the order they became ready (the trigger stamps updated_at
-- with each move), as the in-process ready deque: a claim reads this index
-- alone (ordered by seq, the primary key's order, the planner scanned the
-- primary key past every ended row at its head).
CREATE INDEX envelopes_ready ON envq.envelopes (queue, updated_at, seq) WHERE state = 'ready';

-- Ended envelopes by the time they ended: an operator's or the nodes' purge
-- by age reads this index alone.
CREATE INDEX envelopes_ended ON envq.envelopes (queue, updated_at) WHERE state IN ('succeeded', 'failed', 'stopped');

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

-- The counts of the rows already there (the triggers keep them from now on; the
-- upgrade's lock keeps every node out meanwhile).
ALTER TABLE envq.journal ADD COLUMN node text;
CREATE INDEX journal_seq ON envq.journal (queue, seq, n);
DROP FUNCTION envq.journal_move(envq.envelopes, envq.envelope_state, envq.queue_state);
CREATE FUNCTION envq.journal_move(moved envq.envelopes, source envq.envelope_state,
                                  seen envq.queue_state, held_by text)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF source IS NOT NULL AND moved.state = source THEN
        RETURN;
    END IF;
    -- A send of an id already live is a dedup: ON CONFLICT DO NOTHING skips the row
    -- after this trigger ran, so it is not a move.
    IF source IS NULL AND moved.id IS NOT NULL AND EXISTS (
        SELECT FROM envq.envelopes AS d
         WHERE d.queue = moved.queue AND d.id = moved.id AND d.state IN ('buffered', 'ready', 'delayed', 'running', 'parked')) THEN
        RETURN;
    END IF;
    INSERT INTO envq.journal (queue, seq, from_state, to_state, event, decision, cause,
                              queue_state, node)
    VALUES (moved.queue, moved.seq, source::text, moved.state::text, moved.event::text,
            moved.decision, moved.cause, seen::text, held_by);
END
$$;
COMMENT ON FUNCTION envq.journal_move IS
    'Appends one envelope move to the journal (called by the trigger when it is on).';
LOCK TABLE envq.envelopes IN SHARE MODE;
INSERT INTO envq.counts (queue, state, slot, n)
SELECT queue, state, 0, count(*) FROM envq.envelopes GROUP BY queue, state;
COMMENT ON SCHEMA envq IS 'envq schema version 4';
INSERT INTO envq.schema_version (version, compatible_from) VALUES (4, 4);
