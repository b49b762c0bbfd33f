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

-- The money of payouts whose outcome is not known yet (example_app/ledger.py): out of the
-- balance while held, released by the payout's debit.
CREATE TABLE IF NOT EXISTS ex_holds (
    hold_key    text        PRIMARY KEY,
    tenant      text        NOT NULL,
    account_id  text        NOT NULL,
    amount      bigint      NOT NULL CHECK (amount > 0),
    created_at  timestamptz NOT NULL DEFAULT now()
);
