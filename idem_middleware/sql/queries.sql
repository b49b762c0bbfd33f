-- Named queries. Each block starts with "-- name: <name>" and lists its parameters.
-- All times are the database's: now() is the transaction's start, never the application's clock.

-- name: claim
-- Claim a key, or return the record that holds it, in one round trip.
-- $1 tenant, $2 operation, $3 key, $4 fingerprint, $5 mode, $6 retention (seconds),
-- $7 lease (seconds, or NULL in transactional mode)
-- If another transaction holds an uncommitted claim, the INSERT waits for it. When that claim
-- committed after this statement's snapshot, neither branch returns a row and the caller reads
-- the record again with `get` (a new statement sees it under READ COMMITTED).
WITH ins AS (
    INSERT INTO idem_requests AS r
        (tenant, operation, idem_key, fingerprint, state, mode, retention, lease_expires_at)
    VALUES ($1, $2, $3, $4, 'pending', $5, make_interval(secs => $6::float8),
            now() + make_interval(secs => $7::float8))
    ON CONFLICT DO NOTHING
    RETURNING r.generation
)
SELECT true AS claimed, ins.generation, NULL::bytea AS fingerprint, NULL::text AS state,
       NULL::integer AS response_status, NULL::bytea AS response_headers,
       NULL::bytea AS response_body, NULL::text AS body_omitted,
       false AS expired, false AS lease_expired
FROM ins
UNION ALL
SELECT false, r.generation, r.fingerprint, r.state,
       r.response_status, r.response_headers, r.response_body, r.body_omitted,
       r.expires_at <= now(), r.lease_expires_at <= now()
FROM idem_requests r
WHERE r.tenant = $1 AND r.operation = $2 AND r.idem_key = $3
  AND NOT EXISTS (SELECT FROM ins);

-- name: reclaim_expired
-- Take over a finished record whose retention is over, as if it were absent.
-- $1 tenant, $2 operation, $3 key, $4 fingerprint, $5 mode, $6 retention (seconds),
-- $7 lease (seconds, or NULL)
UPDATE idem_requests
SET fingerprint = $4, state = 'pending', mode = $5,
    generation = nextval('idem_generation_seq'),
    created_at = now(), updated_at = now(),
    retention = make_interval(secs => $6::float8),
    lease_expires_at = now() + make_interval(secs => $7::float8),
    expires_at = NULL, response_status = NULL, response_headers = NULL, response_body = NULL,
    body_omitted = NULL, note = NULL
WHERE tenant = $1 AND operation = $2 AND idem_key = $3
  AND state IN ('succeeded', 'failed_final') AND expires_at <= now()
RETURNING generation;

-- name: get
-- $1 tenant, $2 operation, $3 key
SELECT true AS found, generation, fingerprint, state,
       response_status, response_headers, response_body, body_omitted,
       expires_at <= now() AS expired, lease_expires_at <= now() AS lease_expired
FROM idem_requests
WHERE tenant = $1 AND operation = $2 AND idem_key = $3;

-- name: complete
-- Settle the claim held under a generation. Matches nothing if the generation is not current.
-- $1 tenant, $2 operation, $3 key, $4 generation, $5 state, $6 status, $7 headers, $8 body,
-- $9 body_omitted
UPDATE idem_requests
SET state = $5, updated_at = now(), expires_at = now() + retention, lease_expires_at = NULL,
    response_status = $6, response_headers = $7, response_body = $8, body_omitted = $9
WHERE tenant = $1 AND operation = $2 AND idem_key = $3
  AND generation = $4 AND state = 'pending';

-- name: purge_batch
-- Delete one batch of finished records whose retention is over. Never pending or unknown.
-- $1 batch size
DELETE FROM idem_requests r
USING (
    SELECT tenant, operation, idem_key FROM idem_requests
    WHERE expires_at <= now() AND state IN ('succeeded', 'failed_final')
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
) doomed
WHERE r.tenant = doomed.tenant AND r.operation = doomed.operation
  AND r.idem_key = doomed.idem_key;

-- name: stats
-- Counts per state, and the age of the oldest record in each (what an alert watches for
-- pending and unknown).
SELECT state, count(*) AS count,
       EXTRACT(EPOCH FROM now() - min(updated_at))::float8 AS oldest_age_seconds
FROM idem_requests
GROUP BY state;
