-- 0001: the idempotency record table, its generation sequence and indexes.

CREATE TABLE idem_schema_migrations (
    version     integer     PRIMARY KEY,
    name        text        NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- Every claim and takeover draws a generation from here, so a generation is never reused, even
-- for a key that was purged and claimed again: a late executor can never match a newer owner.
CREATE SEQUENCE idem_generation_seq;

CREATE TABLE idem_requests (
    tenant            text        NOT NULL,
    operation         text        NOT NULL,
    idem_key          text        NOT NULL,
    fingerprint       bytea       NOT NULL,
    state             text        NOT NULL,
    mode              text        NOT NULL,
    generation        bigint      NOT NULL DEFAULT nextval('idem_generation_seq'),
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    retention         interval    NOT NULL,
    lease_expires_at  timestamptz,
    expires_at        timestamptz,
    response_status   integer,
    response_headers  bytea,
    response_body     bytea,
    body_omitted      text,
    note              text,
    -- The tenant leads, so the table can be distributed (Citus) and co-located by tenant.
    CONSTRAINT idem_requests_pkey PRIMARY KEY (tenant, operation, idem_key),
    CONSTRAINT idem_requests_state_check
        CHECK (state IN ('pending', 'succeeded', 'failed_final', 'unknown')),
    CONSTRAINT idem_requests_mode_check CHECK (mode IN ('transactional', 'lease')),
    CONSTRAINT idem_requests_key_length CHECK (octet_length(idem_key) BETWEEN 1 AND 255),
    -- Only finished outcomes expire and carry a response; pending and unknown never expire.
    CONSTRAINT idem_requests_final_check CHECK (
        (state IN ('succeeded', 'failed_final'))
            = (expires_at IS NOT NULL AND response_status IS NOT NULL)
    ),
    CONSTRAINT idem_requests_lease_check CHECK (state = 'pending' OR lease_expires_at IS NULL)
);

-- Purge walks expired finished records in batches.
CREATE INDEX idem_requests_expires_idx ON idem_requests (expires_at)
    WHERE expires_at IS NOT NULL;

-- Operators (and the stats an alert watches) look for unresolved records by age.
CREATE INDEX idem_requests_unresolved_idx ON idem_requests (state, updated_at)
    WHERE state IN ('pending', 'unknown');
