-- +goose Up
-- Capstan's first schema: applications, executions, dispatch records (the
-- outbox), attempts and completion events. Every mutable row has a version
-- that every guarded update checks and increments.

CREATE TABLE applications (
    id              uuid        PRIMARY KEY,
    name            text        NOT NULL UNIQUE CHECK (length(name) BETWEEN 1 AND 128),
    -- SHA-256 of the API key; the key itself is never stored.
    api_key_hash    bytea       NOT NULL UNIQUE,
    -- The registered event consumer (webhook). Empty URL: no consumer yet.
    webhook_url     text        NOT NULL DEFAULT '',
    -- Standard Webhooks signing secret ("whsec_" + base64).
    webhook_secret  text        NOT NULL DEFAULT '',
    version         bigint      NOT NULL DEFAULT 1,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE executions (
    id                  uuid        PRIMARY KEY,
    application_id      uuid        NOT NULL REFERENCES applications (id),
    capability          text        NOT NULL,
    release             text        NOT NULL,
    mode                text        NOT NULL CHECK (mode IN ('ASYNC', 'SYNC')),
    status              text        NOT NULL CHECK (status IN ('QUEUED', 'RUNNING', 'WAITING_EXTERNAL',
                                        'RETRY_SCHEDULED', 'SUCCEEDED', 'FAILED', 'TIMED_OUT', 'CANCELLED')),
    -- Number of the latest attempt started; 0 before the first.
    attempt             integer     NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    max_attempts        integer     NOT NULL CHECK (max_attempts >= 1),
    version             bigint      NOT NULL DEFAULT 1,
    input               bytea       NOT NULL,
    content_type        text        NOT NULL,
    idempotency_key     text,
    -- SHA-256 over capability, content type and input: "same request".
    request_hash        bytea       NOT NULL,
    lease_owner         text,
    lease_token         uuid,
    lease_expires_at    timestamptz,
    -- Acceptance time + the release's async budget (database clock).
    budget_deadline     timestamptz NOT NULL,
    output              bytea,
    output_content_type text,
    failure_class       text,
    failure_reason      text,
    failure_message     text,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    settled_at          timestamptz,
    CHECK ((settled_at IS NULL) = (status IN ('QUEUED', 'RUNNING', 'WAITING_EXTERNAL', 'RETRY_SCHEDULED')))
);

-- Idempotency keys are scoped to the application; concurrent first
-- submissions with one key collide here and exactly one wins.
CREATE UNIQUE INDEX executions_idempotency_key ON executions (application_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX executions_lease_expiry ON executions (lease_expires_at)
    WHERE status IN ('RUNNING', 'WAITING_EXTERNAL');
CREATE INDEX executions_budget ON executions (budget_deadline)
    WHERE status IN ('QUEUED', 'RUNNING', 'WAITING_EXTERNAL', 'RETRY_SCHEDULED');
CREATE INDEX executions_application ON executions (application_id, created_at);

-- The outbox: "attempt N of execution E is due at T".
CREATE TABLE dispatch_records (
    id              uuid        PRIMARY KEY,
    execution_id    uuid        NOT NULL REFERENCES executions (id),
    application_id  uuid        NOT NULL,
    attempt         integer     NOT NULL CHECK (attempt >= 1),
    due_at          timestamptz NOT NULL,
    claim_token     uuid,
    claimed_by      text,
    claimed_until   timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    UNIQUE (execution_id, attempt)
);
CREATE INDEX dispatch_records_due ON dispatch_records (due_at);

CREATE TABLE attempts (
    execution_id    uuid        NOT NULL REFERENCES executions (id),
    attempt         integer     NOT NULL CHECK (attempt >= 1),
    application_id  uuid        NOT NULL,
    worker          text        NOT NULL,
    lease_token     uuid        NOT NULL,
    -- RUNNING, SUCCEEDED, FAILED (terminal failure), RETRYABLE_FAILURE, LEASE_EXPIRED, ABANDONED
    outcome         text        NOT NULL DEFAULT 'RUNNING',
    failure_class   text,
    failure_message text,
    started_at      timestamptz NOT NULL DEFAULT now(),
    ended_at        timestamptz,
    PRIMARY KEY (execution_id, attempt)
);

CREATE TABLE completion_events (
    id                  uuid        PRIMARY KEY,
    -- Exactly one completion event per execution.
    execution_id        uuid        NOT NULL UNIQUE REFERENCES executions (id),
    application_id      uuid        NOT NULL REFERENCES applications (id),
    type                text        NOT NULL,
    -- protobuf-JSON of capstan.event.v1.CompletionEvent, the delivered body.
    payload             bytea       NOT NULL,
    status              text        NOT NULL DEFAULT 'PENDING' CHECK (status IN ('PENDING', 'DELIVERED', 'DEAD')),
    delivery_attempts   integer     NOT NULL DEFAULT 0,
    next_attempt_at     timestamptz NOT NULL DEFAULT now(),
    claim_token         uuid,
    claimed_until       timestamptz,
    last_status_code    integer,
    last_error          text,
    version             bigint      NOT NULL DEFAULT 1,
    created_at          timestamptz NOT NULL DEFAULT now(),
    delivered_at        timestamptz
);
CREATE INDEX completion_events_due ON completion_events (next_attempt_at) WHERE status = 'PENDING';
CREATE INDEX completion_events_application ON completion_events (application_id, status, created_at);

CREATE TABLE delivery_attempts (
    event_id        uuid        NOT NULL REFERENCES completion_events (id),
    attempt         integer     NOT NULL,
    application_id  uuid        NOT NULL,
    status_code     integer,
    error           text,
    started_at      timestamptz NOT NULL,
    ended_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_id, attempt)
);

-- +goose Down
DROP TABLE delivery_attempts;
DROP TABLE completion_events;
DROP TABLE attempts;
DROP TABLE dispatch_records;
DROP TABLE executions;
DROP TABLE applications;
