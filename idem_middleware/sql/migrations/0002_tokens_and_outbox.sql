-- 0002: one-time submission tokens, and the transactional outbox with its consumers' inbox.

-- A token is stored only as its SHA-256. It is consumed by the claim of the idempotency record
-- whose key it is: a token is "used" exactly when idem_requests holds a record for it.
CREATE TABLE idem_tokens (
    tenant          text        NOT NULL,
    token_hash      bytea       NOT NULL,
    operation       text        NOT NULL,
    request_digest  bytea,
    intent_id       text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL,
    CONSTRAINT idem_tokens_pkey PRIMARY KEY (tenant, token_hash),
    -- Issuing is idempotent: one token per (tenant, operation, intent).
    CONSTRAINT idem_tokens_intent_key UNIQUE (tenant, operation, intent_id)
);

CREATE INDEX idem_tokens_expires_idx ON idem_tokens (expires_at);

-- Events written in the same transaction as the business write and the idempotency outcome.
CREATE TABLE idem_outbox (
    event_id         text        NOT NULL,
    tenant           text,
    topic            text        NOT NULL,
    payload          jsonb       NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    attempts         integer     NOT NULL DEFAULT 0,
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    sent_at          timestamptz,
    parked_at        timestamptz,
    last_error       text,
    CONSTRAINT idem_outbox_pkey PRIMARY KEY (event_id),
    CONSTRAINT idem_outbox_done_check CHECK (sent_at IS NULL OR parked_at IS NULL)
);

-- Publishers pick due, unsent, unparked events in order.
CREATE INDEX idem_outbox_due_idx ON idem_outbox (next_attempt_at)
    WHERE sent_at IS NULL AND parked_at IS NULL;

-- A consumer records each event it applied, in its own transaction, so a redelivery is skipped.
CREATE TABLE idem_inbox (
    consumer     text        NOT NULL,
    event_id     text        NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT idem_inbox_pkey PRIMARY KEY (consumer, event_id)
);
