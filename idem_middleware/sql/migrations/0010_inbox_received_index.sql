-- 0010: `inbox purge` finds consumers' inbox rows recorded long enough ago through an index on
-- `received_at` (set to now() when `consume_once` records the event; every existing row has it
-- already, so rows recorded before this migration are purged by their age like any other).
-- Without it, each batch read `idem_inbox` from its first page until it had found its batch.
--
-- An event's row gets its entry when it is recorded: one more index entry per consumed event.
-- Building it locks `idem_inbox` against writes while it runs (a second or so per million rows):
-- migrate outside the busiest hour, or create the index by hand first with `CREATE INDEX
-- CONCURRENTLY` under this name, and this migration leaves it as it is.
-- A build by hand that did not finish (`CREATE INDEX CONCURRENTLY` cancelled, or timed out)
-- leaves an invalid index of this name, which no query uses and `IF NOT EXISTS` would keep for
-- good: it is dropped, and built again below.
DO $idem$
DECLARE
    invalid regclass;  -- (found by the table this migration indexes, whatever schema holds it)
BEGIN
    SELECT i.indexrelid::regclass INTO invalid
    FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
    WHERE i.indrelid = 'idem_inbox'::regclass AND c.relname = 'idem_inbox_received_idx' AND NOT i.indisvalid;
    IF invalid IS NOT NULL THEN
        EXECUTE format('DROP INDEX %s', invalid);
    END IF;
END
$idem$;
CREATE INDEX IF NOT EXISTS idem_inbox_received_idx ON idem_inbox (received_at);
