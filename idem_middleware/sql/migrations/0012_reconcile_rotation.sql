-- 0012: `reconcile` takes its turns in rotation. It asks the reconcilers about the unknown
-- records it has not asked yet first (oldest first), then those it asked longest ago: a record
-- whose reconciler keeps answering "cannot tell yet" (or fails, or is found held) no longer stays
-- first in line for good, so that `--limit` of them never keep the newer ones from their turn.
-- `updated_at` is left as it is (the alert on the oldest unresolved record reads it).
--
-- When a run last asked about the record, and the generation it was unknown under then: the
-- stamp counts only while the record keeps that generation (unknown, nobody has moved it since).
-- A record that goes unknown again later (a reopen, a new lease lapsed after a takeover) does so
-- under another generation, and is first in line again, with nothing to reset. NULL for every
-- record before this migration (never asked). Adding columns without a default rewrites nothing.
ALTER TABLE idem_requests
    ADD COLUMN reconcile_asked_at timestamptz,
    ADD COLUMN reconcile_asked_generation bigint;
