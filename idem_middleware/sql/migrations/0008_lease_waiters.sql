-- 0008: lease-mode waiters say which records they wait on, so that a settlement notifies only
-- when someone waits. A NOTIFY wakes every process that listens (each one's LISTEN connection,
-- and its backend), whatever its payload; most settlements have no waiter at all.
--
-- A row per wait: the record's notification payload (`notify_token`: a digest, no raw key) and
-- a random id of the wait, written when a duplicate starts waiting and deleted when it stops.
-- UNLOGGED: a crash or a failover empties it, and the waiters of that moment poll, as they do
-- whenever a notification does not come. Rows a waiter could not delete (its process died) are
-- removed by `purge` once they are an hour old.
CREATE UNLOGGED TABLE idem_waiters (
    token  text        NOT NULL,
    waiter bigint      NOT NULL,
    since  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT idem_waiters_pkey PRIMARY KEY (token, waiter)
);

CREATE INDEX idem_waiters_since_idx ON idem_waiters (since);
