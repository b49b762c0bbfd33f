-- Named queries. Each block starts with "-- name: <name>" and lists its parameters.
-- All times are the database's: now() is the transaction's start, never the application's clock.
-- A lease is counted from clock_timestamp(), when its record is written: a statement may have
-- waited for a lock on the table first (a migration's ALTER TABLE, a CREATE INDEX), and a lease
-- counted from its start would arrive lapsed, for a duplicate to take over under a live handler.
-- A retention clock starts at clock_timestamp(), when the outcome is written: a transaction (a
-- transactional claim, a fenced one) may have begun as long before as its handler ran, and an
-- outcome is replayed for its full retention after it finished.

-- name: claim
-- Claim a key, or return the record that holds it, in one round trip.
-- $1 tenant, $2 operation, $3 key, $4 fingerprint, $5 mode, $6 retention (seconds),
-- $7 lease (seconds, or NULL in transactional mode), $8 token hash (or NULL), $9 the key's
-- claim lock (`idem_key_lock`, computed by the store; NULL when the caller holds it already)
-- A record this statement's snapshot sees is returned without trying the INSERT: the INSERT
-- would wait for a transaction that holds its row (one taking a released record over, for as
-- long as its handler runs), where the record as last committed is the answer (the caller
-- decides what to do with it, without waiting). Seeing none, the statement tries the key's
-- claim lock (held to its end) before it inserts: a transactional claim holds that lock for as
-- long as its handler runs (one that writes its pending record early, an uncommitted row the
-- INSERT would wait for, and one that writes it at commit alike), and then the key is busy
-- (`claimed` NULL): the caller waits without its connection. Only an uncommitted claim that
-- took no claim lock (another lease claim's, which commits at once) makes the INSERT wait; when
-- it committed after this statement's snapshot, no branch returns a row and the caller reads
-- the record again with `get` (a new statement sees it under READ COMMITTED).
-- With a token hash (a route that accepts only issued tokens as keys), a new record is inserted
-- only if the key is a live token of this tenant and operation (and request, if the token is
-- bound to one) and not consumed: consuming the token IS this claim, and it marks the token
-- consumed. Neither, then a row with the token's status (`token_found` and the columns of
-- `token_status`): it was refused, or (all true) a concurrent claim held the key meanwhile and
-- the caller reads the record again with `get`.
-- The token is locked before it is judged, once the key's claim lock is had (never before: a
-- claim of the key holds its token's row for as long as its handler runs), so a purge deleting
-- it (or a claim consuming it) is waited for and then it is no longer found: READ COMMITTED
-- judges a row it waited on as it is now. Judged by the statement's snapshot alone, a token
-- that expired as the claim began, deleted by a purge meanwhile, was claimed all the same and
-- its consumed mark lost with it: its intent was issued the same token again, which ran again.
-- The new record's epoch (its life) is its first generation.
WITH free AS (
    -- One row when no record is seen: whether the key's claim lock was had (tried once).
    SELECT $9::bigint IS NULL OR pg_try_advisory_xact_lock($9::bigint) AS ok
    WHERE NOT EXISTS (
        SELECT FROM idem_requests e WHERE e.tenant = $1 AND e.operation = $2 AND e.idem_key = $3
    )
), token AS (
    SELECT FROM idem_tokens t, free
    WHERE free.ok AND $8::bytea IS NOT NULL AND t.tenant = $1 AND t.token_hash = $8
      AND t.operation = $2 AND t.expires_at > now() AND t.consumed_at IS NULL
      AND (t.request_digest IS NULL OR t.request_digest = $4)
    FOR UPDATE OF t
), ins AS (
    INSERT INTO idem_requests AS r
        (tenant, operation, idem_key, fingerprint, state, mode, retention, lease_expires_at,
         generation, epoch)
    SELECT $1, $2, $3, $4, 'pending', $5, make_interval(secs => $6::float8),
           clock_timestamp() + make_interval(secs => $7::float8), g.v, g.v
    FROM (SELECT nextval('idem_generation_seq') AS v) g
    WHERE (SELECT ok FROM free) AND ($8::bytea IS NULL OR EXISTS (SELECT FROM token))
    ON CONFLICT (tenant, operation, idem_key) DO NOTHING
    RETURNING r.generation, r.epoch
), consumed AS (
    UPDATE idem_tokens t SET consumed_at = now()
    FROM ins
    WHERE $8::bytea IS NOT NULL AND t.tenant = $1 AND t.token_hash = $8
)
SELECT true AS claimed, ins.generation, ins.epoch, NULL::bytea AS fingerprint, NULL::text AS state,
       NULL::integer AS response_status, NULL::bytea AS response_headers,
       NULL::bytea AS response_body, NULL::text AS body_omitted,
       false AS expired, false AS lease_expired, false AS retry_allowed,
       NULL::boolean AS token_found, NULL::boolean AS same_operation, NULL::boolean AS live,
       NULL::boolean AS unused, NULL::boolean AS same_request
FROM ins
UNION ALL
SELECT false, r.generation, r.epoch, r.fingerprint, r.state,
       r.response_status, r.response_headers, r.response_body, r.body_omitted,
       r.expires_at <= now(), r.lease_expires_at <= now(),
       r.state = 'pending' AND r.mode = 'lease' AND r.lease_expires_at IS NULL,
       NULL, NULL, NULL, NULL, NULL
FROM idem_requests r
WHERE r.tenant = $1 AND r.operation = $2 AND r.idem_key = $3
  AND NOT EXISTS (SELECT FROM ins)
UNION ALL
-- A token claim that inserted nothing and found no record (nor a busy key): the token's status,
-- in the same round trip, so a refusal carries its reason (as `token_status`).
SELECT false, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false, false, false,
       t.token_hash IS NOT NULL, t.operation = $2, t.expires_at > now(), t.consumed_at IS NULL,
       (t.request_digest IS NULL OR t.request_digest = $4)
FROM (SELECT 1) AS one
LEFT JOIN idem_tokens t ON t.tenant = $1 AND t.token_hash = $8
WHERE $8::bytea IS NOT NULL AND NOT EXISTS (SELECT FROM ins) AND (SELECT ok FROM free)
UNION ALL
-- The key's claim lock is another transaction's: busy.
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false, false, false,
       NULL, NULL, NULL, NULL, NULL
FROM free
WHERE NOT free.ok;

-- name: claim_plain
-- `claim` for a key that is not a one-time token (`claim`'s $8 NULL), which most are: the same
-- answers, without the token's statements (the consumption's UPDATE, the token's check and its
-- status), whose nodes the server set up and tore down on every claim (measured on one
-- connection: 11-17 us of the server's CPU less per lease claim, of about 190).
-- $1 tenant, $2 operation, $3 key, $4 fingerprint, $5 mode, $6 retention (seconds),
-- $7 lease (seconds, or NULL in transactional mode), $8 the key's claim lock (NULL when the
-- caller holds it already)
WITH free AS (
    -- One row when no record is seen: whether the key's claim lock was had (tried once).
    SELECT $8::bigint IS NULL OR pg_try_advisory_xact_lock($8::bigint) AS ok
    WHERE NOT EXISTS (
        SELECT FROM idem_requests e WHERE e.tenant = $1 AND e.operation = $2 AND e.idem_key = $3
    )
), ins AS (
    INSERT INTO idem_requests AS r
        (tenant, operation, idem_key, fingerprint, state, mode, retention, lease_expires_at,
         generation, epoch)
    SELECT $1, $2, $3, $4, 'pending', $5, make_interval(secs => $6::float8),
           clock_timestamp() + make_interval(secs => $7::float8), g.v, g.v
    FROM (SELECT nextval('idem_generation_seq') AS v) g
    WHERE (SELECT ok FROM free)
    ON CONFLICT (tenant, operation, idem_key) DO NOTHING
    RETURNING r.generation, r.epoch
)
SELECT true AS claimed, ins.generation, ins.epoch, NULL::bytea AS fingerprint, NULL::text AS state,
       NULL::integer AS response_status, NULL::bytea AS response_headers,
       NULL::bytea AS response_body, NULL::text AS body_omitted,
       false AS expired, false AS lease_expired, false AS retry_allowed
FROM ins
UNION ALL
SELECT false, r.generation, r.epoch, r.fingerprint, r.state,
       r.response_status, r.response_headers, r.response_body, r.body_omitted,
       r.expires_at <= now(), r.lease_expires_at <= now(),
       r.state = 'pending' AND r.mode = 'lease' AND r.lease_expires_at IS NULL
FROM idem_requests r
WHERE r.tenant = $1 AND r.operation = $2 AND r.idem_key = $3
  AND NOT EXISTS (SELECT FROM ins)
UNION ALL
-- The key's claim lock is another transaction's: busy.
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false, false, false
FROM free
WHERE NOT free.ok;

-- name: claim_key
-- Transactional mode's claim: the record is written once, at commit (`insert_final`). On the
-- fast path (store/postgres/fused.py) it is sent after BEGIN in the same message. It never waits: "SELECT 0", the key is
-- free and claimed (its advisory lock is held to the end of the transaction); "SELECT 1", a
-- record holds it (the caller reads it with `get`); "SELECT 2", another transaction is claiming
-- it right now (the caller rolls back and waits without its connection).
-- $1 tenant, $2 operation, $3 key, $4 the key's lock (`idem_key_lock`, computed by the store)
SELECT * FROM idem_claim_key($1, $2, $3, $4);

-- name: claim_key_count
-- `claim_key` for the ordinary path (a parameterised statement): 0 free, 1 held, 2 busy.
-- $1 tenant, $2 operation, $3 key, $4 the key's lock
SELECT count(*) FROM idem_claim_key($1, $2, $3, $4);

-- name: lock_secret
-- The installation's secret of `idem_key_lock` (HMAC's two padded keys), read once by a store
-- that computes the claim lock itself (store/postgres/claim_lock.py).
SELECT inner_key, outer_key FROM idem_lock_secret;

-- name: generations_ahead
-- Checked when a store opens: a generation drawn from `idem_generation_seq` (one value lost, as
-- any rolled-back claim loses one: generations need only be new; its last value cannot tell "set
-- ahead with is_called false" from "never drawn") and the largest generation among the records a
-- fence may still compare with (the pending and unknown ones) and the $1 that expire last (their
-- indexes). A sequence behind them (set back by hand, a failover to a logical replica, which
-- copies no sequence, a restore without its setval) would hand out generations again.
-- $1 how many of the records that expire last to read
SELECT nextval('idem_generation_seq') AS drawn,
       (SELECT max(generation) FROM (
            (SELECT generation FROM idem_requests WHERE state IN ('pending', 'unknown'))
            UNION ALL
            (SELECT generation FROM idem_requests WHERE expires_at IS NOT NULL
             ORDER BY expires_at DESC LIMIT $1)
        ) AS recent) AS held;

-- name: key_arbiter
-- Checked when a store opens, planned and never run (EXPLAIN: nothing is written): whether the
-- claims' `ON CONFLICT (tenant, operation, idem_key)` finds the unique index it names, which a
-- primary key dropped by hand, or left out of a restore (pg_restore's post-data section), took
-- away with the key's only index. No parameters.
EXPLAIN INSERT INTO idem_requests (tenant, operation, idem_key) VALUES ('', '', '')
ON CONFLICT (tenant, operation, idem_key) DO NOTHING;

-- name: key_deferrable
-- Checked when a store opens, after `key_arbiter`: the DEFERRABLE constraints (primary key or
-- unique, INITIALLY IMMEDIATE or DEFERRED) whose index the claims' `ON CONFLICT (tenant,
-- operation, idem_key)` takes as an arbiter (its key columns are those three). EXPLAIN plans
-- the claim all the same; run, every claim fails ("ON CONFLICT does not support deferrable
-- unique constraints"). `definition` is the constraint's, made NOT DEFERRABLE: the fix.
-- No parameters.
SELECT quote_ident(c.conname) AS name,
       regexp_replace(pg_catalog.pg_get_constraintdef(c.oid), ' DEFERRABLE.*$', '') AS definition
FROM pg_catalog.pg_constraint c
JOIN pg_catalog.pg_index i ON i.indexrelid = c.conindid
WHERE c.conrelid = to_regclass('idem_requests') AND c.contype IN ('p', 'u') AND c.condeferrable
  AND i.indnkeyatts = 3
  AND (SELECT array_agg(a.attname::text ORDER BY a.attname) FROM pg_catalog.pg_attribute a
       WHERE a.attrelid = c.conrelid AND a.attnum IN (i.indkey[0], i.indkey[1], i.indkey[2]))
      = ARRAY['idem_key', 'operation', 'tenant'];

-- name: writable
-- Whether the server takes the store's writes (checked when a store opens): a standby does not,
-- nor do sessions that default to read-only; after how many milliseconds idle in a transaction,
-- and in one transaction (PostgreSQL 17 on; NULL before), the server ends a session (0: never);
-- and the database's encoding. No parameters.
SELECT pg_is_in_recovery() AS standby,
       current_setting('default_transaction_read_only') = 'on' AS read_only,
       (SELECT setting::bigint FROM pg_settings
         WHERE name = 'idle_in_transaction_session_timeout') AS idle_ms,
       (SELECT setting::bigint FROM pg_settings
         WHERE name = 'transaction_timeout') AS transaction_ms,
       current_setting('server_encoding') AS server_encoding;

-- name: privileges
-- Whether the session's role holds each privilege its requests need (checked when a store
-- opens): $1 the kinds ('table', 'sequence' or 'function'), $2 the objects' names as the
-- store's statements name them (found on the search_path), $3 the privileges, one per row.
-- `object` is the schema-qualified name, NULL (and `held` too) for an object that is not there;
-- `row_security` whether a row-level security policy filters what this role sees of a table.
SELECT t.kind, t.name, t.privilege, o.object,
       CASE t.kind
           WHEN 'table' THEN has_table_privilege(o.oid, t.privilege)
           WHEN 'sequence' THEN has_sequence_privilege(o.oid, t.privilege)
           ELSE has_function_privilege(o.oid, t.privilege)
       END AS held,
       CASE WHEN t.kind = 'table' THEN pg_catalog.row_security_active(o.oid) END AS row_security,
       quote_ident(current_user) AS role
FROM unnest($1::text[], $2::text[], $3::text[]) AS t(kind, name, privilege)
LEFT JOIN LATERAL (
    SELECT c.oid, quote_ident(n.nspname) || '.' || quote_ident(c.relname) AS object
    FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
    WHERE t.kind <> 'function' AND c.oid = to_regclass(t.name)
    UNION ALL
    SELECT p.oid, quote_ident(n.nspname) || '.' || quote_ident(p.proname)
               || '(' || pg_catalog.pg_get_function_identity_arguments(p.oid) || ')'
    FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
    WHERE t.kind = 'function' AND p.oid = to_regprocedure(t.name)
) o ON true;

-- name: insert_final
-- The record of a `claim_key` claim, written once with its outcome, sent with the COMMIT. A
-- record that appeared meanwhile (written by a claim that took no advisory lock) makes this fail
-- with a unique violation, which aborts the transaction before the COMMIT runs.
-- $1 tenant, $2 operation, $3 key, $4 fingerprint, $5 generation, $6 retention (seconds),
-- $7 state, $8 status, $9 headers, $10 body, $11 body_omitted
INSERT INTO idem_requests
    (tenant, operation, idem_key, fingerprint, state, mode, generation, epoch, retention,
     expires_at, response_status, response_headers, response_body, body_omitted)
VALUES ($1, $2, $3, $4, $7, 'transactional', $5, $5, make_interval(secs => $6::float8),
        clock_timestamp() + make_interval(secs => $6::float8), $8, $9, $10, $11);

-- name: insert_final_checked
-- `insert_final` for the simple-query message that also carries the COMMIT: an INSERT that wrote
-- no row (a BEFORE trigger on the table returned NULL) divides by zero, which aborts the
-- transaction before the COMMIT runs, as `complete_checked` does (in a WITH, a rule that would
-- do instead nothing is refused by the server). Else the handler's writes committed with no
-- record: every retry ran it again.
-- $1 tenant, $2 operation, $3 key, $4 fingerprint, $5 generation, $6 retention (seconds),
-- $7 state, $8 status, $9 headers, $10 body, $11 body_omitted
WITH inserted AS (
    INSERT INTO idem_requests
        (tenant, operation, idem_key, fingerprint, state, mode, generation, epoch, retention,
         expires_at, response_status, response_headers, response_body, body_omitted)
    VALUES ($1, $2, $3, $4, $7, 'transactional', $5, $5, make_interval(secs => $6::float8),
            clock_timestamp() + make_interval(secs => $6::float8), $8, $9, $10, $11)
    RETURNING 1
)
SELECT 1 / count(*) FROM inserted;

-- name: write_deferred
-- A fast claim's record, deferred to its completion, written now because its transaction claims
-- another key: as the ordinary claim's pending record, so that later claims see it and the
-- commit keeps it (the store's twin and its ordinary path agree).
-- $1 tenant, $2 operation, $3 key, $4 fingerprint, $5 generation, $6 retention (seconds)
INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode, generation,
                           epoch, retention)
VALUES ($1, $2, $3, $4, 'pending', 'transactional', $5, $5, make_interval(secs => $6::float8));

-- name: draw_generations
-- Generations for the fast claim (a simple query returns no rows, so `claim_key` cannot return
-- one), drawn in a batch inside the transaction of the claim that found none left (so the draw
-- costs no commit of its own). Each is used at most once, so a generation is still never
-- reused. $1 how many
SELECT nextval('idem_generation_seq') FROM generate_series(1, $1);

-- name: reclaim_expired
-- Take over a finished record whose retention is over, as if it were absent: a new life (epoch).
-- With a token hash, the caller checked the token (`token_status`); this marks it consumed.
-- It never waits: the row is locked first with NOWAIT, so a row another session holds (a
-- transactional claim reclaiming it, for as long as its handler runs) fails the statement with
-- lock_not_available, and the caller reports the key busy (it waits without its connection).
-- $1 tenant, $2 operation, $3 key, $4 fingerprint, $5 mode, $6 retention (seconds),
-- The token is locked and judged again once the record is (as in `claim`): a purge that deleted
-- it since `token_status` read it leaves nothing to reclaim, and the caller claims again.
-- $7 lease (seconds, or NULL), $8 token hash (or NULL)
WITH locked AS (
    SELECT FROM idem_requests
    WHERE tenant = $1 AND operation = $2 AND idem_key = $3
      AND state IN ('succeeded', 'failed_final') AND expires_at <= now()
    FOR UPDATE NOWAIT
), token AS (
    SELECT FROM idem_tokens t, locked
    WHERE $8::bytea IS NOT NULL AND t.tenant = $1 AND t.token_hash = $8
      AND t.operation = $2 AND t.expires_at > now() AND t.consumed_at IS NULL
      AND (t.request_digest IS NULL OR t.request_digest = $4)
    FOR UPDATE OF t
), reclaimed AS (
    UPDATE idem_requests r
    SET fingerprint = $4, state = 'pending', mode = $5, generation = g.v, epoch = g.v,
        created_at = now(), updated_at = now(),
        retention = make_interval(secs => $6::float8),
        lease_expires_at = clock_timestamp() + make_interval(secs => $7::float8),
        expires_at = NULL, response_status = NULL, response_headers = NULL, response_body = NULL,
        body_omitted = NULL, note = NULL
    FROM locked, (SELECT nextval('idem_generation_seq') AS v) g
    WHERE r.tenant = $1 AND r.operation = $2 AND r.idem_key = $3
      AND ($8::bytea IS NULL OR EXISTS (SELECT FROM token))
    RETURNING r.generation, r.epoch
), consumed AS (
    UPDATE idem_tokens t SET consumed_at = now()
    FROM reclaimed
    WHERE $8::bytea IS NOT NULL AND t.tenant = $1 AND t.token_hash = $8
)
SELECT generation, epoch FROM reclaimed;

-- name: reclaim_released
-- Transactional mode's claim of a lease-mode record released for the client's retry (found not
-- to have happened) after its route moved to transactional mode: the claim's transaction takes
-- it over as its own, under a new generation and a new life. Rolled back, the record is the
-- released one again; committed, `complete` settles it. Taken over only by the same request.
-- It never waits: the record's row is locked first with NOWAIT, so a row another session holds
-- (another transaction taking it over, for as long as its handler runs) fails the statement
-- with lock_not_available, and the caller reports the key busy (it waits without its
-- connection). No row: the record is no longer the one released under that generation. `same`
-- false: another request's record, left as it is (the caller's answer is 422 key-reused).
-- $1 tenant, $2 operation, $3 key, $4 fingerprint, $5 the released record's generation,
-- $6 retention (seconds)
WITH locked AS (
    SELECT fingerprint = $4 AS same FROM idem_requests
    WHERE tenant = $1 AND operation = $2 AND idem_key = $3
      AND generation = $5 AND state = 'pending' AND mode = 'lease' AND lease_expires_at IS NULL
    FOR UPDATE NOWAIT
), reclaimed AS (
    UPDATE idem_requests r
    SET mode = 'transactional', generation = g.v, epoch = g.v, updated_at = now(),
        retention = make_interval(secs => $6::float8)
    FROM locked, (SELECT nextval('idem_generation_seq') AS v) g
    WHERE r.tenant = $1 AND r.operation = $2 AND r.idem_key = $3 AND locked.same
    RETURNING g.v AS generation
)
SELECT locked.same, reclaimed.generation, reclaimed.generation AS epoch
FROM locked LEFT JOIN reclaimed ON true;

-- name: expire_lapsed
-- `expire_lease` for a transactional claim that found a lapsed lease-mode record of the same
-- request (its route moved to transactional mode): run on its own after the claim's transaction
-- ended, and never waiting: a record whose row another session holds (its executor's fenced
-- transaction, past its lease) is left as it is. Returns the record as `get` does, if it moved.
-- $1 tenant, $2 operation, $3 key, $4 generation, $5 notification payload
WITH locked AS (
    SELECT FROM idem_requests
    WHERE tenant = $1 AND operation = $2 AND idem_key = $3
      AND generation = $4 AND state = 'pending' AND lease_expires_at <= now()
    FOR UPDATE SKIP LOCKED
), moved AS (
    UPDATE idem_requests r
    SET state = 'unknown', updated_at = now(), lease_expires_at = NULL,
        note = concat_ws(E'\n', note,
                         to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z "')
                         || 'lease expired')
    FROM locked
    WHERE r.tenant = $1 AND r.operation = $2 AND r.idem_key = $3
    RETURNING r.generation, r.epoch, r.fingerprint, r.state, r.response_status,
              r.response_headers, r.response_body, r.body_omitted, r.expires_at
)
SELECT true AS found, generation, epoch, fingerprint, state, response_status,
       response_headers, response_body, body_omitted, false AS expired,
       false AS lease_expired, false AS retry_allowed, pg_notify('idem_middleware', $5) AS notified
FROM moved;

-- name: get
-- $1 tenant, $2 operation, $3 key
SELECT true AS found, generation, epoch, fingerprint, state,
       response_status, response_headers, response_body, body_omitted,
       expires_at <= now() AS expired, lease_expires_at <= now() AS lease_expired,
       state = 'pending' AND mode = 'lease' AND lease_expires_at IS NULL AS retry_allowed
FROM idem_requests
WHERE tenant = $1 AND operation = $2 AND idem_key = $3;

-- name: peek
-- The status resource's read, one statement that writes and locks nothing: the committed
-- record (as `get`), and `claiming`, whether a transaction holds the key's claim lock now. A
-- transactional claim holds that lock until it commits, and its record is written only then:
-- without a live record, the lock is the only sign that the request runs. The lock is read
-- from pg_locks (a try of it would make a claim arriving in that instant find the key busy);
-- a one-bigint advisory lock shows as classid = its high 32 bits, objid = its low, objsubid 1.
-- $1 tenant, $2 operation, $3 key, $4 the key's claim lock (`idem_key_lock`)
SELECT g.*, CASE WHEN g.found AND g.expired IS NOT TRUE THEN false ELSE EXISTS (
    SELECT FROM pg_catalog.pg_locks l
    WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
      AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d
                         WHERE d.datname = current_database())
      AND l.classid = (($4::bigint >> 32) & 4294967295)::oid
      AND l.objid = ($4::bigint & 4294967295)::oid
) END AS claiming
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
    SELECT true AS found, generation, epoch, fingerprint, state,
           response_status, response_headers, response_body, body_omitted,
           expires_at <= now() AS expired, lease_expires_at <= now() AS lease_expired,
           state = 'pending' AND mode = 'lease' AND lease_expires_at IS NULL AS retry_allowed
    FROM idem_requests WHERE tenant = $1 AND operation = $2 AND idem_key = $3
) g ON true;

-- name: complete
-- Settle the claim held under a generation. Matches nothing if the generation is not current.
-- $1 tenant, $2 operation, $3 key, $4 generation, $5 state, $6 status, $7 headers, $8 body,
-- $9 body_omitted
UPDATE idem_requests
SET state = $5, updated_at = now(), expires_at = clock_timestamp() + retention,
    lease_expires_at = NULL, response_status = $6, response_headers = $7, response_body = $8,
    body_omitted = $9
WHERE tenant = $1 AND operation = $2 AND idem_key = $3
  AND generation = $4 AND state = 'pending';

-- name: complete_checked
-- `complete` for the simple-query message that also carries the COMMIT (one round trip): a
-- simple query reports only its last command's status, so a completion that matched nothing
-- divides by zero instead, which aborts the transaction before the COMMIT runs.
-- $1 tenant, $2 operation, $3 key, $4 generation, $5 state, $6 status, $7 headers, $8 body,
-- $9 body_omitted
WITH completed AS (
    UPDATE idem_requests
    SET state = $5, updated_at = now(), expires_at = clock_timestamp() + retention,
        lease_expires_at = NULL, response_status = $6, response_headers = $7,
        response_body = $8, body_omitted = $9
    WHERE tenant = $1 AND operation = $2 AND idem_key = $3
      AND generation = $4 AND state = 'pending'
    RETURNING 1
)
SELECT 1 / count(*) FROM completed;

-- name: purge_batch
-- Delete one batch of finished records whose retention is over. Never pending or unknown.
-- The batch is chosen once (a CTE that locks rows is materialized; said so here): as a subquery
-- in `USING`, a nested loop ran it again for each row, each run skipping the rows the statement
-- had deleted and locking the next, and one batch deleted every row it could reach.
-- Each batch starts where the one before ended ($2, the latest expires_at it deleted), not at
-- the index's first entry: the entries of the rows deleted before stay in the index until a
-- vacuum, and while any snapshot older than the deletes is open (a long transaction, a backup,
-- a standby's feedback) no scan may mark them dead, so a batch started from the first entry
-- walked every row the run had deleted so far, each one's heap row too: measured on 2 million
-- records, batch 300 took 230 ms instead of 14 (a run of 1,000 batches, minutes instead of 15 s).
-- A row left behind (locked by a retry reclaiming it as the batch passed) waits for the next run.
-- (`coalesce`, not `$2 IS NULL OR`: the bound stays an index condition in a generic plan.)
-- $1 batch size, $2 the latest expires_at the run's previous batch deleted (NULL: the first)
WITH doomed AS MATERIALIZED (
    SELECT tenant, operation, idem_key FROM idem_requests
    WHERE expires_at <= now() AND state IN ('succeeded', 'failed_final')
      AND expires_at >= coalesce($2::timestamptz, '-infinity')
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
DELETE FROM idem_requests r
USING doomed
WHERE r.tenant = doomed.tenant AND r.operation = doomed.operation
  AND r.idem_key = doomed.idem_key
RETURNING r.expires_at;

-- name: stats
-- Counts per state, the age of the oldest record in each (what an alert watches for pending
-- and unknown), and the pending records whose lease lapsed. Reads the whole table.
SELECT state, count(*) AS count,
       EXTRACT(EPOCH FROM now() - min(updated_at))::float8 AS oldest_age_seconds,
       count(*) FILTER (WHERE lease_expires_at <= now()) AS lapsed
FROM idem_requests
GROUP BY state;

-- name: stats_unresolved
-- `stats` of pending and unknown records alone: the predicate is the partial index
-- idem_requests_unresolved_idx's own, so only its entries are read (a few thousand, whatever
-- the table's size) and the heap rows of pending ones, for their lease.
SELECT state, count(*) AS count,
       EXTRACT(EPOCH FROM now() - min(updated_at))::float8 AS oldest_age_seconds,
       count(*) FILTER (WHERE lease_expires_at <= now()) AS lapsed
FROM idem_requests
WHERE state IN ('pending', 'unknown')
GROUP BY state;

-- name: heartbeat
-- Renew the lease of the claim held under a generation; true while that generation holds a
-- pending claim. Matches nothing once the generation is stale or the record is settled, so a
-- renewal can never land after a completion or a takeover. It never waits for the record's row
-- lock: the executor's own fenced transaction holds it for as long as the handler keeps it open
-- (a slow downstream call), and a renewal waiting there held a second connection all along and
-- renewed nothing. A locked record is left as it is and answered from its last committed
-- version: no takeover or expiry can change it while the lock is held (each locks the row
-- first), and once the lock is gone the next renewal renews it. A renewal never shortens the
-- lease: one whose statement was held up (a table lock) and lands after a later one keeps the
-- later one's end, which is what the execution counts on; and one held up longer than the lease
-- still gives a whole lease from when it writes (clock_timestamp()).
-- $1 tenant, $2 operation, $3 key, $4 generation, $5 lease (seconds)
WITH renewable AS (
    SELECT FROM idem_requests
    WHERE tenant = $1 AND operation = $2 AND idem_key = $3
      AND generation = $4 AND state = 'pending'
    FOR UPDATE SKIP LOCKED
), renewed AS (
    UPDATE idem_requests r
    SET lease_expires_at = GREATEST(
        lease_expires_at, clock_timestamp() + make_interval(secs => $5::float8)
    )
    FROM renewable
    WHERE r.tenant = $1 AND r.operation = $2 AND r.idem_key = $3
    RETURNING 1
)
SELECT EXISTS (SELECT FROM renewed) OR EXISTS (
    SELECT FROM idem_requests
    WHERE tenant = $1 AND operation = $2 AND idem_key = $3
      AND generation = $4 AND state = 'pending'
) AS alive;

-- name: heartbeat_batch
-- `heartbeat` for many renewals in one statement: those waiting for their turn on the lease
-- renewals' connection (store/postgres/renewals.py). Row n answers the n-th renewal: `alive`,
-- as `heartbeat` answers it alone. Each record is reached through its primary key, once per
-- renewal (nested loops over the renewals: LATERAL; the answer's probe has its LIMIT so that
-- the planner neither hashes the join nor hashes every pending record for it). A record is
-- never waited for (SKIP LOCKED: a locked one is left as it is and answered from its last
-- committed version), a lease never shortened (GREATEST), and a record renewed twice in one
-- batch under its generation gets the longer of the two.
-- $1 tenants, $2 operations, $3 keys, $4 generations, $5 leases (seconds): arrays, one element
-- per renewal
WITH asked AS (
    SELECT tenant, operation, idem_key, generation, secs, n
    FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::float8[])
        WITH ORDINALITY AS a (tenant, operation, idem_key, generation, secs, n)
), renewable AS (
    SELECT l.tenant, l.operation, l.idem_key, l.generation, l.secs
    FROM (
        SELECT tenant, operation, idem_key, generation, max(secs) AS secs
        FROM asked
        GROUP BY tenant, operation, idem_key, generation
    ) AS l
    CROSS JOIN LATERAL (
        SELECT FROM idem_requests r
        WHERE r.tenant = l.tenant AND r.operation = l.operation AND r.idem_key = l.idem_key
          AND r.generation = l.generation AND r.state = 'pending'
        FOR UPDATE SKIP LOCKED
    ) AS locked
), renewed AS (
    UPDATE idem_requests r
    SET lease_expires_at = GREATEST(
        r.lease_expires_at, clock_timestamp() + make_interval(secs => w.secs)
    )
    FROM renewable w
    WHERE r.tenant = w.tenant AND r.operation = w.operation AND r.idem_key = w.idem_key
    RETURNING r.tenant, r.operation, r.idem_key, w.generation
)
SELECT a.n, w.idem_key IS NOT NULL OR p.pending IS NOT NULL AS alive
FROM asked a
LEFT JOIN renewed w
    ON w.tenant = a.tenant AND w.operation = a.operation AND w.idem_key = a.idem_key
   AND w.generation = a.generation
LEFT JOIN LATERAL (
    SELECT true AS pending FROM idem_requests r
    WHERE r.tenant = a.tenant AND r.operation = a.operation AND r.idem_key = a.idem_key
      AND r.generation = a.generation AND r.state = 'pending'
    LIMIT 1
) AS p ON true
ORDER BY a.n;

-- name: expire_lease
-- A pending record whose lease lapsed becomes unknown: a lost lease does not prove the effect
-- did not happen; waiters are woken. It never waits: the row is locked first with NOWAIT, so a
-- row another session holds (its executor's fenced transaction, past its lease) fails the
-- statement with lock_not_available, and the caller waits without its connection (or, a batch,
-- passes the record over). $1 tenant, $2 operation, $3 key, $4 generation,
-- $5 notification payload
WITH locked AS (
    SELECT FROM idem_requests
    WHERE tenant = $1 AND operation = $2 AND idem_key = $3
      AND generation = $4 AND state = 'pending' AND lease_expires_at <= now()
    FOR UPDATE NOWAIT
), moved AS (
    UPDATE idem_requests r
    SET state = 'unknown', updated_at = now(), lease_expires_at = NULL,
        note = concat_ws(E'\n', note,
                         to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z "')
                         || 'lease expired')
    FROM locked
    WHERE r.tenant = $1 AND r.operation = $2 AND r.idem_key = $3
    RETURNING 1
)
SELECT count(*) AS moved, pg_notify('idem_middleware', $5) AS notified FROM moved;

-- name: takeover
-- Become the executor of a record under a new generation: a pending record whose lease lapsed
-- (or was released for a retry: no lease), or an unknown one reconciled as "did not happen".
-- It never waits: the row is locked first with NOWAIT, so a row another session holds (an earlier
-- executor's or a reconciler's fenced transaction, a transaction taking a released record over)
-- fails the statement with lock_not_available, and the caller waits without its connection and
-- tries again. (The lock is taken in the CTE, before the new values are computed.)
-- An unknown transactional record (an operator reopened it) is never taken over: its writes
-- committed with its outcome. A record taken over is a lease-mode record from then on.
-- An unknown one's audit trail says so, as a batch's release for a retry (`allow_retry`) does.
-- $1 tenant, $2 operation, $3 key, $4 expected generation, $5 expected state, $6 lease (seconds)
WITH locked AS (
    SELECT FROM idem_requests
    WHERE tenant = $1 AND operation = $2 AND idem_key = $3 AND generation = $4 AND state = $5
      AND (state <> 'pending' OR lease_expires_at IS NULL OR lease_expires_at <= now())
      AND (state = 'pending' OR mode = 'lease')
    FOR UPDATE NOWAIT
)
UPDATE idem_requests r
SET generation = nextval('idem_generation_seq'), state = 'pending', mode = 'lease',
    updated_at = now(), lease_expires_at = clock_timestamp() + make_interval(secs => $6::float8),
    note = CASE WHEN r.state = 'unknown'
                THEN concat_ws(E'\n', r.note,
                               to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z "')
                               || 'reconciled unknown -> pending: not happened')
                ELSE r.note END
FROM locked
WHERE r.tenant = $1 AND r.operation = $2 AND r.idem_key = $3
RETURNING r.generation;

-- name: unclaim
-- A takeover that landed for a request already gone (cancelled with the statement in flight):
-- nobody runs under its generation, so the record is left to the next retry as one released for
-- it (no lease), its epoch and fingerprint kept; waiters are woken.
-- $1 tenant, $2 operation, $3 key, $4 generation, $5 notification payload
WITH moved AS (
    UPDATE idem_requests SET lease_expires_at = NULL, updated_at = now()
    WHERE tenant = $1 AND operation = $2 AND idem_key = $3 AND generation = $4
      AND state = 'pending'
    RETURNING 1
)
SELECT count(*) AS moved, pg_notify('idem_middleware', $5) AS notified FROM moved;

-- name: fence
-- Lock the record for a fenced transaction, if the generation is still the current executor.
-- Held until that transaction ends, so no takeover can slip between the check and the commit.
-- $1 tenant, $2 operation, $3 key, $4 generation, $5 expected state
SELECT 1 FROM idem_requests
WHERE tenant = $1 AND operation = $2 AND idem_key = $3 AND generation = $4 AND state = $5
FOR UPDATE;

-- name: fence_nowait
-- `fence` for a reconciler (an unknown record): it never waits for another session's lock on
-- the row (another reconciler's fence, for as long as it asks its downstream system), its
-- pooled connection held; the statement fails with lock_not_available instead (`ClaimBusy`).
-- $1 tenant, $2 operation, $3 key, $4 generation, $5 expected state
SELECT 1 FROM idem_requests
WHERE tenant = $1 AND operation = $2 AND idem_key = $3 AND generation = $4 AND state = $5
FOR UPDATE NOWAIT;

-- name: settle
-- Lease mode and operators: move a record from an expected state under a generation to its
-- outcome, and wake the waiters (NOTIFY is delivered at commit) if any is registered in
-- `idem_waiters` (a NOTIFY wakes every listening process: most settlements have no waiter). A
-- final state gets its response and its retention clock; unknown gets neither.
-- $1 tenant, $2 operation, $3 key, $4 generation, $5 expected state, $6 new state, $7 status,
-- $8 headers, $9 body, $10 body_omitted, $11 note, $12 notification payload
WITH settled AS (
    UPDATE idem_requests
    SET state = $6, updated_at = now(), lease_expires_at = NULL,
        expires_at = CASE WHEN $6 IN ('succeeded', 'failed_final')
                          THEN clock_timestamp() + retention END,
        response_status = $7, response_headers = $8, response_body = $9, body_omitted = $10,
        note = CASE WHEN $11::text IS NULL THEN note
                    ELSE concat_ws(E'\n', note,
                                   to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z "')
                                   || $11) END
    WHERE tenant = $1 AND operation = $2 AND idem_key = $3 AND generation = $4 AND state = $5
    RETURNING 1
)
SELECT count(*) AS settled, (
    SELECT count(*) FROM (
        SELECT pg_notify('idem_middleware', $12) FROM idem_waiters WHERE token = $12 LIMIT 1
    ) AS woken
) AS notified
FROM settled;

-- name: settle_checked
-- `settle` for the message that also carries the COMMIT, at the end of a fenced transaction. The
-- fence holds the record's row lock under this generation and state, so it always matches; if it
-- did not, the division by zero aborts the transaction before the COMMIT runs.
-- $1 tenant, $2 operation, $3 key, $4 generation, $5 expected state, $6 new state, $7 status,
-- $8 headers, $9 body, $10 body_omitted, $11 note, $12 notification payload
WITH settled AS (
    UPDATE idem_requests
    SET state = $6, updated_at = now(), lease_expires_at = NULL,
        expires_at = CASE WHEN $6 IN ('succeeded', 'failed_final')
                          THEN clock_timestamp() + retention END,
        response_status = $7, response_headers = $8, response_body = $9, body_omitted = $10,
        note = CASE WHEN $11::text IS NULL THEN note
                    ELSE concat_ws(E'\n', note,
                                   to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z "')
                                   || $11) END
    WHERE tenant = $1 AND operation = $2 AND idem_key = $3 AND generation = $4 AND state = $5
    RETURNING 1
)
SELECT 1 / count(*) AS settled, (
    SELECT count(*) FROM (
        SELECT pg_notify('idem_middleware', $12) FROM idem_waiters WHERE token = $12 LIMIT 1
    ) AS woken
) AS notified
FROM settled;

-- name: release
-- Forget a claim whose request did nothing (a 4xx meaning "fix and retry"), and wake waiters.
-- If the key is a one-time token this record's life consumed, nothing happened: it is unused
-- again. That life's claim (`claim`, `reclaim_expired`) stamped the token's `consumed_at` and the
-- record's `created_at` with its transaction's now(), kept across takeovers; a life begun with
-- the token as a plain key (`require_token` turned off meanwhile) never gives it back.
-- $1 tenant, $2 operation, $3 key, $4 generation, $5 notification payload
WITH released AS (
    DELETE FROM idem_requests
    WHERE tenant = $1 AND operation = $2 AND idem_key = $3
      AND generation = $4 AND state = 'pending'
    RETURNING created_at
), restored AS (
    UPDATE idem_tokens t SET consumed_at = NULL
    FROM released
    WHERE t.tenant = $1 AND t.token_hash = sha256(convert_to($3, 'UTF8')) AND t.operation = $2
      AND t.consumed_at = released.created_at
)
SELECT count(*) AS released, pg_notify('idem_middleware', $5) AS notified FROM released;

-- name: allow_retry
-- An operator (or a reconciler run by the CLI) decided an unknown request did not happen: it
-- becomes claimable by the client's next retry, under a new generation and with no lease.
-- Lease mode only: a transactional record's writes committed with its outcome, and no
-- transactional claim would take a pending record over (it would stay pending for good).
-- $1 tenant, $2 operation, $3 key, $4 generation, $5 note, $6 notification payload
WITH moved AS (
    UPDATE idem_requests
    SET state = 'pending', generation = nextval('idem_generation_seq'), updated_at = now(),
        lease_expires_at = NULL,
        note = concat_ws(E'\n', note,
                         to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z "') || $5)
    WHERE tenant = $1 AND operation = $2 AND idem_key = $3 AND generation = $4
      AND state = 'unknown' AND mode = 'lease'
    RETURNING 1
)
SELECT count(*) AS moved, pg_notify('idem_middleware', $6) AS notified FROM moved;

-- name: list_records
-- Operators (and `reconcile`): records by state, optionally one tenant and/or operation, oldest
-- first; but an unknown record `reconcile` asked about under its generation (`mark_asked`) after
-- every one it has not, those asked longest ago first (the batch's rotation: migration 0012).
-- $1 states (text[]), $2 tenant or NULL, $3 operation or NULL, $4 limit, $5 stale pending
-- only: lease lapsed (bool)
SELECT tenant, operation, idem_key, state, generation, mode, created_at, updated_at,
       lease_expires_at, expires_at, response_status, note,
       lease_expires_at <= now() AS lease_expired, epoch,
       reopened_generation IS NOT DISTINCT FROM generation AS reopened
FROM idem_requests
WHERE state = ANY($1::text[])
  AND ($2::text IS NULL OR tenant = $2)
  AND ($3::text IS NULL OR operation = $3)
  AND (NOT $5 OR state <> 'pending' OR lease_expires_at IS NULL OR lease_expires_at <= now())
ORDER BY CASE WHEN state = 'unknown' AND reconcile_asked_generation = generation
              THEN reconcile_asked_at END NULLS FIRST,
         updated_at, tenant, operation, idem_key
LIMIT $4;

-- name: mark_asked
-- `reconcile` asked the reconciler of an unknown record and left it unknown (it could not tell
-- yet, it failed, the record was held, its release was refused): stamped with the database's
-- time and the generation, so that the next runs ask the others first (see `list_records`).
-- `updated_at` is left as it is (the oldest unresolved record's age is read from it), and
-- nobody is woken (nothing changed for a waiter). It never waits: a row another session holds
-- (a reconciler's or an executor's fenced transaction) is left unstamped.
-- $1 tenant, $2 operation, $3 key, $4 generation
WITH locked AS (
    SELECT FROM idem_requests
    WHERE tenant = $1 AND operation = $2 AND idem_key = $3
      AND generation = $4 AND state = 'unknown'
    FOR UPDATE SKIP LOCKED
), stamped AS (
    UPDATE idem_requests r
    SET reconcile_asked_at = now(), reconcile_asked_generation = $4
    FROM locked
    WHERE r.tenant = $1 AND r.operation = $2 AND r.idem_key = $3
    RETURNING 1
)
SELECT count(*) AS stamped FROM stamped;

-- name: list_page
-- Operators (`idem-middleware list`): one page of one state's records, oldest first, after the
-- last record of the page before (keyset paging: each page a short statement of its own, no
-- transaction held between them). The order is total (updated_at, then the key), so a page
-- starts exactly after the one before, whatever was inserted or deleted meanwhile. Records
-- changed after the first page ($6) are left out: a record listed and then moved (a takeover, a
-- lapsed lease turned unknown) is not listed twice, unless the transaction that moved it began
-- before the first page (updated_at is its now()). `listed_at` is the first page's bound. A
-- record changed "later" than the clock reads as its page is read (its updated_at ahead of the
-- server's clock: a clock stepped back since, an edit by hand) was never moved meanwhile, and
-- is listed, last (it was left out: `stats` counted it, and `list` said there was none).
-- For pending and unknown each page reads idem_requests_unresolved_idx from the cursor on; the
-- finished states have no such index, so each of their pages reads the table.
-- $1 state, $2 tenant or NULL, $3 operation or NULL, $4 page size, $5 stale pending only,
-- $6 changed at the latest (NULL on the first page: now), $7 updated_at, $8 tenant,
-- $9 operation, $10 key of the last record listed (NULLs on the first page)
SELECT tenant, operation, idem_key, state, generation, mode, created_at, updated_at,
       lease_expires_at, expires_at, response_status, note,
       lease_expires_at <= now() AS lease_expired, epoch,
       reopened_generation IS NOT DISTINCT FROM generation AS reopened,
       coalesce($6::timestamptz, now()) AS listed_at
FROM idem_requests
WHERE state = $1::text
  AND ($2::text IS NULL OR tenant = $2)
  AND ($3::text IS NULL OR operation = $3)
  AND (NOT $5 OR state <> 'pending' OR lease_expires_at IS NULL OR lease_expires_at <= now())
  AND (updated_at <= coalesce($6::timestamptz, now()) OR updated_at > clock_timestamp())
  AND ($7::timestamptz IS NULL
       OR updated_at >= $7 AND (updated_at, tenant, operation, idem_key) > ($7, $8, $9, $10))
ORDER BY updated_at, tenant, operation, idem_key
LIMIT $4;

-- name: token_status
-- Why a token was refused (another tenant's token is simply not found).
-- $1 tenant, $2 token hash, $3 operation, $4 fingerprint
SELECT operation = $3 AS same_operation, expires_at > now() AS live,
       consumed_at IS NULL AS unused,
       (request_digest IS NULL OR request_digest = $4) AS same_request
FROM idem_tokens
WHERE tenant = $1 AND token_hash = $2;

-- name: issue_token
-- Issue a token, or return the one already issued for this intent (renewing it if it expired,
-- unless it was consumed: `spent` then, and the caller refuses).
-- Nothing here waits for a row lock, its pooled connection held: an intent's live token is
-- read, not written (a transactional claim consuming it holds its row for as long as its
-- handler runs), and an expired token whose row another transaction holds (such a claim, its
-- handler running past the token's time to live) is answered `busy`, nothing written: the
-- caller asks again once it has let go of the connection. Only a first issue, or an expired
-- token's renewal, writes.
-- $1 tenant, $2 token hash, $3 operation, $4 request digest or NULL, $5 intent id or NULL,
-- $6 time to live (seconds)
WITH live AS (
    SELECT token_hash, expires_at, request_digest
    FROM idem_tokens
    WHERE tenant = $1 AND operation = $3 AND intent_id = $5 AND expires_at > now()
), expired AS (
    -- The intent's expired token (one row at most: the intent is the table's unique key), and
    -- whether this statement could lock its row.
    SELECT (SELECT count(*) FROM idem_tokens
            WHERE tenant = $1 AND operation = $3 AND intent_id = $5 AND expires_at <= now())
           AS found,
           (SELECT count(*) FROM (
                SELECT FROM idem_tokens
                WHERE tenant = $1 AND operation = $3 AND intent_id = $5 AND expires_at <= now()
                FOR UPDATE SKIP LOCKED) lockable)
           AS free
), issued AS (
    INSERT INTO idem_tokens AS t
        (tenant, token_hash, operation, request_digest, intent_id, expires_at)
    SELECT $1::text, $2::bytea, $3::text, $4::bytea, $5::text,
           now() + make_interval(secs => $6::float8)
    WHERE NOT EXISTS (SELECT FROM live) AND (SELECT found = free FROM expired)
    ON CONFLICT (tenant, operation, intent_id) DO UPDATE
    SET expires_at = CASE
        WHEN t.expires_at <= now() AND t.consumed_at IS NULL THEN EXCLUDED.expires_at
        ELSE t.expires_at
    END
    RETURNING t.token_hash, t.expires_at, t.request_digest,
              t.consumed_at IS NOT NULL AND t.expires_at <= now() AS spent
)
SELECT token_hash, expires_at, request_digest, false AS spent, false AS busy FROM live
UNION ALL
SELECT token_hash, expires_at, request_digest, spent, false FROM issued
UNION ALL
SELECT NULL, NULL, NULL, false, true FROM expired
WHERE NOT EXISTS (SELECT FROM live) AND found > free;

-- name: watch_begin
-- A lease-mode duplicate starts waiting for a record: settlements of it notify from now on.
-- $1 the record's notification payload, $2 this wait's random id
INSERT INTO idem_waiters (token, waiter) VALUES ($1, $2) ON CONFLICT DO NOTHING;

-- name: watch_end
-- The wait is over. $1 the record's notification payload, $2 this wait's id
DELETE FROM idem_waiters WHERE token = $1 AND waiter = $2;

-- name: purge_waiters
-- Delete one batch of waits left behind by processes that died (a wait lasts seconds; an hour
-- is far past any). $1 batch size
DELETE FROM idem_waiters w
USING (
    SELECT token, waiter FROM idem_waiters
    WHERE since < now() - interval '1 hour'
    LIMIT $1
) AS old
WHERE w.token = old.token AND w.waiter = old.waiter;

-- name: purge_tokens
-- Delete one batch of expired tokens, except the consumed tokens of an intent: those stay as
-- tombstones (an intent's token is the same every time it is issued, so without its tombstone
-- issuing for that intent again would bring a used token back to life). $1 batch size, $2 the
-- latest expires_at the run's previous batch deleted (NULL: the first)
-- (The batch chosen once, and started where the batch before it ended: see purge_batch.)
WITH doomed AS MATERIALIZED (
    SELECT tenant, token_hash FROM idem_tokens
    WHERE expires_at <= now() AND (consumed_at IS NULL OR intent_id IS NULL)
      AND expires_at >= coalesce($2::timestamptz, '-infinity')
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
DELETE FROM idem_tokens t
USING doomed
WHERE t.tenant = doomed.tenant AND t.token_hash = doomed.token_hash
RETURNING t.expires_at;

-- name: outbox_add
-- $1 event id, $2 tenant, $3 topic, $4 payload (JSON text). One row (true) when written, none
-- when an event of this id is there already (see outbox_same).
INSERT INTO idem_outbox (event_id, tenant, topic, payload) VALUES ($1, $2, $3, $4::text::jsonb)
ON CONFLICT (event_id) DO NOTHING
RETURNING true;

-- name: outbox_same
-- $1 event id, $2 tenant, $3 topic, $4 payload (JSON text): whether the event of this id holds
-- the same tenant, topic and payload (NULL: there is none). A statement of its own, so that it
-- sees an event another transaction committed while outbox_add waited for it.
SELECT tenant IS NOT DISTINCT FROM $2 AND topic = $3 AND payload = $4::text::jsonb
FROM idem_outbox WHERE event_id = $1;

-- name: outbox_claim
-- Reserve the next due event for one send, and count the attempt now: other publishers skip it
-- until the reservation lapses ($1 seconds: the send's timeout and a margin). A publisher that
-- dies mid-send leaves the event to be sent again after that, its attempt counted, so an event
-- that kills its publisher every time is parked after $2 attempts like any failing event.
-- Returns the event (attempts = this attempt's number), with `parked` if it is parked instead.
WITH next AS (
    SELECT event_id FROM idem_outbox
    WHERE sent_at IS NULL AND parked_at IS NULL AND next_attempt_at <= now()
    ORDER BY next_attempt_at, created_at
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)
UPDATE idem_outbox o
SET attempts = CASE WHEN o.attempts >= $2 THEN o.attempts ELSE o.attempts + 1 END,
    next_attempt_at = now() + make_interval(secs => $1::float8),
    parked_at = CASE WHEN o.attempts >= $2 THEN now() END,
    last_error = CASE
        WHEN o.attempts >= $2 THEN 'no publisher finished sending it (' || o.attempts || ' attempts)'
        ELSE o.last_error
    END
FROM next
WHERE o.event_id = next.event_id
RETURNING o.event_id, o.tenant, o.topic, o.payload::text AS payload, o.attempts,
          o.parked_at IS NOT NULL AS parked;

-- name: outbox_sent
-- A delivered event is sent, whichever attempt delivered it: a publisher whose reservation lapsed
-- and whose event another publisher reserved again, failed or parked meanwhile, still delivered
-- it, so sending wins over parking (and the other publisher's later result changes nothing).
-- $1 event id
UPDATE idem_outbox SET sent_at = now(), parked_at = NULL, last_error = NULL
WHERE event_id = $1 AND sent_at IS NULL;

-- name: outbox_failed
-- A failed send: back off, or park the event for an operator after `max attempts` tries.
-- $1 event id, $2 error, $3 backoff (seconds), $4 max attempts, $5 the attempt that failed
UPDATE idem_outbox
SET last_error = $2,
    next_attempt_at = now() + make_interval(secs => $3::float8),
    parked_at = CASE WHEN attempts >= $4 THEN now() END
WHERE event_id = $1 AND attempts = $5 AND sent_at IS NULL;

-- name: outbox_requeue
-- An operator sends parked events again. $1 event ids (text[]). One row per id asked for, and
-- what became of it: requeued, or why not (no such event, or one not parked: unsent or sent),
-- so that an id mistyped or already sent is named, not counted as nothing.
WITH requeued AS (
    UPDATE idem_outbox SET parked_at = NULL, attempts = 0, next_attempt_at = now()
    WHERE event_id = ANY($1::text[]) AND parked_at IS NOT NULL
    RETURNING event_id
)
SELECT asked.event_id,
       CASE WHEN requeued.event_id IS NOT NULL THEN 'requeued'
            WHEN event.event_id IS NULL THEN 'unknown'
            WHEN event.sent_at IS NOT NULL THEN 'sent'
            ELSE 'unsent' END AS outcome
FROM unnest($1::text[]) WITH ORDINALITY AS asked (event_id, n)
LEFT JOIN requeued ON requeued.event_id = asked.event_id
LEFT JOIN idem_outbox AS event ON event.event_id = asked.event_id
ORDER BY asked.n;

-- name: outbox_row_security
-- Whether a row-level security policy filters what this role sees of the outbox (a publisher
-- that sees none of the events is refused, not left idle: `privileges.require_outbox_visible`).
SELECT pg_catalog.row_security_active(to_regclass('idem_outbox')) AS filtered,
       quote_ident(current_user) AS role;

-- name: outbox_stats
SELECT count(*) FILTER (WHERE sent_at IS NULL AND parked_at IS NULL) AS unsent,
       count(*) FILTER (WHERE parked_at IS NOT NULL) AS parked,
       count(*) FILTER (WHERE sent_at IS NOT NULL) AS sent,
       EXTRACT(EPOCH FROM now() - min(created_at) FILTER (WHERE sent_at IS NULL))::float8
           AS oldest_unsent_age_seconds
FROM idem_outbox;

-- name: outbox_list
-- $1 parked only (bool), $2 limit
SELECT event_id, tenant, topic, attempts, created_at, next_attempt_at, sent_at, parked_at,
       last_error
FROM idem_outbox
WHERE sent_at IS NULL AND (NOT $1 OR parked_at IS NOT NULL)
ORDER BY created_at
LIMIT $2;

-- name: outbox_purge
-- Delete one batch of events sent more than $2 seconds ago, oldest first (a run stopped at its
-- limit leaves the youngest). $1 batch size, $2 age (seconds), $3 the latest sent_at the run's
-- previous batch deleted (NULL: the first)
-- (The batch chosen once, and started where the batch before it ended: see purge_batch.)
WITH doomed AS MATERIALIZED (
    SELECT event_id FROM idem_outbox
    WHERE sent_at <= now() - make_interval(secs => $2::float8)
      AND sent_at >= coalesce($3::timestamptz, '-infinity')
    ORDER BY sent_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
DELETE FROM idem_outbox o
USING doomed
WHERE o.event_id = doomed.event_id
RETURNING o.sent_at;

-- name: inbox_record
-- A consumer notes an event in its own transaction; no row back means it was applied before.
-- $1 consumer, $2 event id
INSERT INTO idem_inbox (consumer, event_id) VALUES ($1, $2)
ON CONFLICT (consumer, event_id) DO NOTHING
RETURNING 1;

-- name: inbox_purge
-- Delete one batch of consumers' inbox rows recorded more than $2 seconds ago, oldest first.
-- $1 batch size, $2 age (seconds), $3 the latest received_at the run's previous batch deleted
-- (NULL: the first)
-- (The batch chosen once, and started where the batch before it ended: see purge_batch.)
WITH doomed AS MATERIALIZED (
    SELECT consumer, event_id FROM idem_inbox
    WHERE received_at <= now() - make_interval(secs => $2::float8)
      AND received_at >= coalesce($3::timestamptz, '-infinity')
    ORDER BY received_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
DELETE FROM idem_inbox i
USING doomed
WHERE i.consumer = doomed.consumer AND i.event_id = doomed.event_id
RETURNING i.received_at;

-- name: amend
-- An operator's move (resolve, re-resolve, reopen, release for a retry): like `settle`, but the
-- note is appended to the record's audit trail, one line per move, stamped with the database's
-- time; a move to pending releases the record for the client's next retry (a new generation, no
-- lease). Wakes the waiters.
-- A move to an outcome (succeeded, failed_final) takes a new generation too: a re-resolve leaves
-- the state as it was (succeeded -> succeeded), so two operators who read the record at once both
-- matched (generation, state), and one correction was lost with both told it was made. A reopen
-- (to `unknown`) does as well: an execution of the old generation still running (its lease
-- lapsed, its record marked `unknown`, then settled, then reopened) would otherwise record its
-- late outcome over the operator's reopen. Every move changes the generation: of two operators'
-- moves made from one reading, the second matches nothing and is refused.
-- The row lock is waited for at most 6 s (`bound`: the transaction's own lock_timeout, set before
-- the row reaches the UPDATE's lock), a second past ops.py's `_BUSY_WAIT`, after which the
-- operator is told the record is busy and the client cancels the statement: a client that died
-- meanwhile (killed, its connection lost) cannot leave the statement waiting, to land later.
-- $1 tenant, $2 operation, $3 key, $4 generation, $5 expected state, $6 new state, $7 status,
-- $8 headers, $9 body, $10 body_omitted, $11 audit line, $12 notification payload
WITH bound AS MATERIALIZED (
    SELECT set_config('lock_timeout', '6s', true) AS lock_timeout
), amended AS (
    UPDATE idem_requests
    SET state = $6, updated_at = now(), lease_expires_at = NULL,
        generation = g.v,
        -- A reopen (an outcome back to `unknown`) is marked with its generation: only an
        -- operator settles the record, since its outcome may have committed writes with it.
        reopened_generation = CASE WHEN $6 = 'unknown' AND $5 IN ('succeeded', 'failed_final')
                                   THEN g.v END,
        expires_at = CASE WHEN $6 IN ('succeeded', 'failed_final')
                          THEN clock_timestamp() + retention END,
        response_status = $7, response_headers = $8, response_body = $9, body_omitted = $10,
        note = concat_ws(E'\n', note,
                         to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z "') || $11)
    FROM bound, (SELECT nextval('idem_generation_seq') AS v) g
    WHERE tenant = $1 AND operation = $2 AND idem_key = $3 AND generation = $4 AND state = $5
      AND bound.lock_timeout IS NOT NULL
      -- A pending lease-mode record only with its lease lapsed (renewed since it was read, an
      -- execution still runs it), or released for a retry (no lease: nobody runs it).
      AND (state <> 'pending' OR mode <> 'lease' OR lease_expires_at IS NULL
           OR lease_expires_at <= now())
    RETURNING 1
)
SELECT count(*) AS amended, pg_notify('idem_middleware', $12) AS notified FROM amended;

-- name: describe
-- Operators: one record as `list` shows it. $1 tenant, $2 operation, $3 key
SELECT tenant, operation, idem_key, state, generation, mode, created_at, updated_at,
       lease_expires_at, expires_at, response_status, note,
       lease_expires_at <= now() AS lease_expired, epoch,
       reopened_generation IS NOT DISTINCT FROM generation AS reopened
FROM idem_requests
WHERE tenant = $1 AND operation = $2 AND idem_key = $3;
