-- The example app's business tables. The idempotency tables come from the library's migrations.
CREATE TABLE IF NOT EXISTS ex_accounts (
    tenant      text   NOT NULL,
    account_id  text   NOT NULL,
    balance     bigint NOT NULL DEFAULT 0,
    credits     bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, account_id)
);

CREATE TABLE IF NOT EXISTS ex_credits (
    credit_id   uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant      text        NOT NULL,
    account_id  text        NOT NULL,
    amount      bigint      NOT NULL CHECK (amount > 0),
    memo        text,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS ex_payouts (
    payout_id         uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant            text        NOT NULL,
    account_id        text        NOT NULL,
    amount            bigint      NOT NULL CHECK (amount > 0),
    bank_transfer_id  text        NOT NULL UNIQUE,
    created_at        timestamptz NOT NULL DEFAULT now()
);
