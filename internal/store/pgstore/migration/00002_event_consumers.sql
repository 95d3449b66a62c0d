-- +goose Up
-- Event consumers: each application registers one consumer of its completion
-- events, a webhook, a Kafka topic or a gRPC EventConsumerService, with any
-- number of signing secrets (every active one signs, for rotation). The
-- router reads the consumer when it claims an event, so a change applies to
-- every attempt claimed after it commits.

CREATE TABLE event_consumers (
    application_id  uuid        PRIMARY KEY REFERENCES applications (id),
    kind            text        NOT NULL CHECK (kind IN ('webhook', 'kafka', 'grpc')),
    -- The webhook URL, Kafka topic or gRPC target (host:port), per kind.
    target          text        NOT NULL CHECK (length(target) BETWEEN 1 AND 2048),
    -- Set when the consumer was disabled (its webhook answered 410 Gone).
    -- Events of a disabled consumer are not claimed: they wait as PENDING.
    disabled_at     timestamptz,
    disabled_reason text,
    version         bigint      NOT NULL DEFAULT 1,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE event_consumer_secrets (
    id              uuid        PRIMARY KEY,
    application_id  uuid        NOT NULL REFERENCES event_consumers (application_id) ON DELETE CASCADE,
    -- "aesgcm1:" + base64(nonce || AES-256-GCM ciphertext) under
    -- router.secret_key, or, when no key is configured (development), the
    -- plaintext "whsec_…" secret.
    sealed          text        NOT NULL,
    -- Hex of the first 8 bytes of SHA-256 over the secret as registered.
    fingerprint     text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    -- NULL: signs until removed; otherwise stops signing at this time.
    expires_at      timestamptz
);
CREATE INDEX event_consumer_secrets_application ON event_consumer_secrets (application_id, created_at);

-- The registered webhooks move to event_consumers. Their secrets are copied
-- as plaintext (SQL has no key); a router started with router.secret_key
-- encrypts them. The old columns are emptied so that no second copy of a
-- secret stays behind; they are no longer read and will be dropped later.
INSERT INTO event_consumers (application_id, kind, target)
SELECT id, 'webhook', webhook_url FROM applications WHERE webhook_url <> '';
INSERT INTO event_consumer_secrets (id, application_id, sealed, fingerprint)
SELECT gen_random_uuid(), id, webhook_secret, encode(substring(sha256(convert_to(webhook_secret, 'UTF8')) FROM 1 FOR 8), 'hex')
  FROM applications WHERE webhook_url <> '' AND webhook_secret <> '';
UPDATE applications SET webhook_url = '', webhook_secret = '' WHERE webhook_url <> '' OR webhook_secret <> '';

-- Replay starts the delivery schedule over while keeping the history:
-- delivery_attempts counts every attempt ever made (attempt numbers stay
-- unique), round_attempts only those since the last replay.
ALTER TABLE completion_events
    ADD COLUMN round_attempts   integer     NOT NULL DEFAULT 0,
    ADD COLUMN replays          integer     NOT NULL DEFAULT 0,
    ADD COLUMN last_replayed_at timestamptz;
UPDATE completion_events SET round_attempts = delivery_attempts WHERE delivery_attempts > 0;

ALTER TABLE delivery_attempts
    ADD COLUMN replay           integer     NOT NULL DEFAULT 0,
    -- The consumer the attempt used: kind and version as claimed.
    ADD COLUMN consumer_kind    text        NOT NULL DEFAULT '',
    ADD COLUMN consumer_version bigint;

-- The fair claim reads due events per application, and counts each
-- application's claims in flight.
CREATE INDEX completion_events_app_due ON completion_events (application_id, next_attempt_at)
    WHERE status = 'PENDING';
CREATE INDEX completion_events_app_claimed ON completion_events (application_id, claimed_until)
    WHERE status = 'PENDING' AND claim_token IS NOT NULL;
CREATE INDEX completion_events_created ON completion_events (created_at, id);

-- +goose Down
DROP INDEX completion_events_created;
DROP INDEX completion_events_app_claimed;
DROP INDEX completion_events_app_due;
ALTER TABLE delivery_attempts DROP COLUMN consumer_version, DROP COLUMN consumer_kind, DROP COLUMN replay;
ALTER TABLE completion_events DROP COLUMN last_replayed_at, DROP COLUMN replays, DROP COLUMN round_attempts;
-- Webhook consumers go back to the applications row; encrypted secrets
-- cannot be decrypted in SQL and are dropped (re-register them).
UPDATE applications a
   SET webhook_url = c.target,
       webhook_secret = coalesce((SELECT s.sealed FROM event_consumer_secrets s
                                   WHERE s.application_id = c.application_id AND s.sealed LIKE 'whsec\_%'
                                   ORDER BY s.created_at DESC LIMIT 1), '')
  FROM event_consumers c
 WHERE c.application_id = a.id AND c.kind = 'webhook';
DROP TABLE event_consumer_secrets;
DROP TABLE event_consumers;
