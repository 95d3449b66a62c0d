-- +goose Up
-- Await units and interactions (SYSTEM §6): one durable completion contract
-- per boundary where an execution waits on the outside world, and the
-- transport-facing records inside it. Executions park on a unit with
-- await_unit_id; the response payload lives on the interaction, never on the
-- execution row.

CREATE TABLE await_units (
    -- Deterministic: derived from (execution, attempt, step), so a replay
    -- finds the unit it opened before instead of opening another.
    id              uuid        PRIMARY KEY,
    execution_id    uuid        NOT NULL REFERENCES executions (id),
    application_id  uuid        NOT NULL REFERENCES applications (id),
    attempt         integer     NOT NULL,
    step            text        NOT NULL,
    cardinality     text        NOT NULL CHECK (cardinality IN ('ONE_TO_ONE', 'MANY_TO_ONE', 'ONE_TO_MANY', 'MANY_TO_MANY')),
    transport       text        NOT NULL CHECK (transport IN ('interaction-api', 'webhook', 'kafka')),
    status          text        NOT NULL DEFAULT 'WAITING'
                                CHECK (status IN ('WAITING', 'COMPLETED', 'FAILED', 'TIMED_OUT', 'CANCELLED')),
    deadline        timestamptz NOT NULL,
    version         bigint      NOT NULL DEFAULT 1,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    UNIQUE (execution_id, attempt, step)
);
CREATE INDEX await_units_execution ON await_units (execution_id);

CREATE TABLE interactions (
    id                  uuid        PRIMARY KEY,
    await_unit_id       uuid        NOT NULL REFERENCES await_units (id),
    execution_id        uuid        NOT NULL REFERENCES executions (id),
    application_id      uuid        NOT NULL REFERENCES applications (id),
    capability          text        NOT NULL,
    -- Position of the item in the unit (0 for ONE_TO_ONE).
    seq                 integer     NOT NULL DEFAULT 0,
    idempotency_key     text        NOT NULL UNIQUE,
    correlation_id      text        NOT NULL UNIQUE,
    transport           text        NOT NULL,
    status              text        NOT NULL DEFAULT 'WAITING'
                                    CHECK (status IN ('WAITING', 'DISPATCHING', 'DISPATCHED',
                                                      'COMPLETED', 'FAILED', 'TIMED_OUT', 'CANCELLED')),
    request             bytea       NOT NULL,
    content_type        text        NOT NULL,
    external_reference  text,
    deadline            timestamptz NOT NULL,
    -- The admitted completion: result or failure, and a hash to recognise
    -- an identical duplicate.
    result              bytea,
    result_content_type text,
    failure_class       text,
    failure_message     text,
    failure_retryable   boolean     NOT NULL DEFAULT false,
    completion_hash     bytea,
    completed_at        timestamptz,
    dispatch_attempts   integer     NOT NULL DEFAULT 0,
    next_dispatch_at    timestamptz,
    claim_token         uuid,
    claimed_until       timestamptz,
    version             bigint      NOT NULL DEFAULT 1,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    UNIQUE (await_unit_id, seq)
);
CREATE INDEX interactions_pending ON interactions (capability, deadline)
    WHERE status IN ('WAITING', 'DISPATCHING', 'DISPATCHED');
CREATE INDEX interactions_dispatch ON interactions (next_dispatch_at)
    WHERE status IN ('WAITING', 'DISPATCHING') AND transport <> 'interaction-api';

ALTER TABLE executions
    ADD COLUMN await_unit_id    uuid REFERENCES await_units (id),
    ADD COLUMN progress_percent integer NOT NULL DEFAULT 0 CHECK (progress_percent BETWEEN 0 AND 100),
    ADD COLUMN progress_message text NOT NULL DEFAULT '';

-- Late or refused completions are counted, not lost silently.
CREATE TABLE completion_refusals (
    id              bigserial   PRIMARY KEY,
    interaction_id  uuid,
    reason          text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE completion_refusals;
ALTER TABLE executions DROP COLUMN await_unit_id, DROP COLUMN progress_percent, DROP COLUMN progress_message;
DROP TABLE interactions;
DROP TABLE await_units;
