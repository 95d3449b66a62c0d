package pgstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/capstan-dev/capstan/internal/execution"
)

// Completion event delivery statuses.
const (
	EventPending   = "PENDING"
	EventDelivered = "DELIVERED"
	EventDead      = "DEAD"
)

// EventDelivery is a claimed completion event with its consumer as read at
// claim time.
type EventDelivery struct {
	ID            uuid.UUID
	ExecutionID   uuid.UUID
	ApplicationID uuid.UUID
	Type          string
	Payload       []byte
	// Attempts is the number of delivery attempts made before this one,
	// over the event's whole history (replays included).
	Attempts int
	// RoundAttempts is the number of attempts since the last replay: the
	// position in the delivery schedule.
	RoundAttempts int
	// Replays is how often the event was replayed.
	Replays    int
	CreatedAt  time.Time
	ClaimToken uuid.UUID
	// TraceContext is the W3C traceparent of the execution's trace, ""
	// when none was stored.
	TraceContext string
	// ConsumerKind is "" when the application has no consumer.
	ConsumerKind    ConsumerKind
	ConsumerTarget  string
	ConsumerVersion int64
	// Secrets are the consumer's active signing secrets in plaintext,
	// newest first.
	Secrets []string
	// SecretErr is set (wrapping ErrSecretKey) when a stored secret could
	// not be decrypted; Secrets is then empty.
	SecretErr error
}

// EventClaimParams claims due completion events.
type EventClaimParams struct {
	Owner    string
	Limit    int
	ClaimFor time.Duration
	// PerApplication bounds the claims in flight (unexpired) per
	// application, across every router; values below 1 mean 1.
	PerApplication int
	// Box opens the consumers' signing secrets; nil opens plaintext ones
	// only (see SecretBox).
	Box *SecretBox
}

// EventClaim claims up to Limit PENDING events whose next attempt is due and
// whose claim (if any) expired, fairly across applications, and returns
// them with each application's consumer as it is now.
//
// Fairness: each application gets at most PerApplication minus its claims
// still in flight (FOR UPDATE SKIP LOCKED per application, so router
// replicas share the work), and the batch is filled least-loaded first:
// an event's load is its application's claims in flight plus its rank
// among that application's due events, so every application's oldest due
// event comes before any application's second, and a freed slot goes to
// the application with the fewest deliveries in flight. One application's
// backlog never fills the batch, nor keeps the slots it frees. Applications whose consumer is disabled
// are skipped: their events wait. Replicas claiming at the same instant may
// each see the same in-flight count, so the per-application bound is exact
// for one router and at most replicas × PerApplication for several.
//
// An event whose router dies mid-delivery is claimed again after ClaimFor:
// at-least-once delivery with a stable id. The claim writes only the claim
// token and expiry; zero rows means nothing is due.
func (s *Store) EventClaim(ctx context.Context, p EventClaimParams) ([]EventDelivery, error) {
	token := uuid.New()
	rows, err := s.pool.Query(ctx, `
WITH loads AS (
  SELECT a.id AS application_id,
         (SELECT count(*) FROM completion_events f
           WHERE f.application_id = a.id AND f.status = 'PENDING'
             AND f.claim_token IS NOT NULL AND f.claimed_until >= now())::int AS in_flight
    FROM applications a
   WHERE EXISTS (SELECT 1 FROM completion_events d
                  WHERE d.application_id = a.id AND d.status = 'PENDING' AND d.next_attempt_at <= now())
     AND NOT EXISTS (SELECT 1 FROM event_consumers c WHERE c.application_id = a.id AND c.disabled_at IS NOT NULL)
), apps AS (
  SELECT application_id, in_flight, $4::int - in_flight AS room FROM loads
), candidates AS (
  SELECT e.id, e.next_attempt_at,
         apps.in_flight + row_number() OVER (PARTITION BY apps.application_id ORDER BY e.next_attempt_at, e.id) AS load
    FROM apps CROSS JOIN LATERAL (
          SELECT d.id, d.next_attempt_at FROM completion_events d
           WHERE d.application_id = apps.application_id AND d.status = 'PENDING' AND d.next_attempt_at <= now()
             AND (d.claimed_until IS NULL OR d.claimed_until < now())
           ORDER BY d.next_attempt_at, d.id
           LIMIT greatest(apps.room, 0)
             FOR UPDATE SKIP LOCKED) e
   WHERE apps.room > 0
), picked AS (
  SELECT id FROM candidates ORDER BY load, next_attempt_at, id LIMIT $3
), claimed AS (
  UPDATE completion_events e
     SET claim_token = $1, claimed_until = now() + make_interval(secs => $2)
    FROM picked
   WHERE e.id = picked.id AND e.status = 'PENDING'
  RETURNING e.id, e.execution_id, e.application_id, e.type, e.payload, e.delivery_attempts, e.round_attempts,
            e.replays, e.created_at, e.next_attempt_at, e.trace_context)
SELECT c.id, c.execution_id, c.application_id, c.type, c.payload, c.delivery_attempts, c.round_attempts,
       c.replays, c.created_at, coalesce(k.kind, ''), coalesce(k.target, ''), coalesce(k.version, 0),
       coalesce(sec.sealed, '{}'), coalesce(c.trace_context, '')
  FROM claimed c
  LEFT JOIN event_consumers k ON k.application_id = c.application_id
  LEFT JOIN LATERAL (
        SELECT array_agg(s.sealed ORDER BY s.created_at DESC, s.id) AS sealed
          FROM event_consumer_secrets s
         WHERE s.application_id = c.application_id AND (s.expires_at IS NULL OR s.expires_at > now())) sec ON true
 ORDER BY c.next_attempt_at`, token, p.ClaimFor.Seconds(), p.Limit, max(p.PerApplication, 1))
	if err != nil {
		return nil, translate(fmt.Errorf("claim events: %w", err))
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (EventDelivery, error) {
		d := EventDelivery{ClaimToken: token}
		var sealed []string
		err := r.Scan(&d.ID, &d.ExecutionID, &d.ApplicationID, &d.Type, &d.Payload, &d.Attempts, &d.RoundAttempts,
			&d.Replays, &d.CreatedAt, &d.ConsumerKind, &d.ConsumerTarget, &d.ConsumerVersion, &sealed, &d.TraceContext)
		if err != nil {
			return d, err
		}
		for _, st := range sealed {
			sec, err := p.Box.open(d.ApplicationID, st)
			if err != nil {
				d.Secrets, d.SecretErr = nil, err
				break
			}
			d.Secrets = append(d.Secrets, sec)
		}
		return d, nil
	})
	if err != nil {
		return nil, translate(fmt.Errorf("claim events: %w", err))
	}
	return out, nil
}

// EventResultParams records one delivery attempt of a claimed event.
type EventResultParams struct {
	ID         uuid.UUID
	ClaimToken uuid.UUID
	Attempt    int // 1-based number of this attempt over the event's history
	StartedAt  time.Time
	StatusCode int    // 0 when no HTTP response
	Error      string // empty on success
	Delivered  bool
	Dead       bool          // no further attempt
	RetryAfter time.Duration // delay before the next attempt when neither Delivered nor Dead
	// ConsumerKind and ConsumerVersion are the consumer the attempt used,
	// as claimed ("" and 0 when none was registered).
	ConsumerKind    ConsumerKind
	ConsumerVersion int64
	// DisableConsumer flags the consumer as disabled with DisableReason (a
	// webhook answered 410 Gone), unless it changed since the claim.
	DisableConsumer bool
	DisableReason   string
}

// EventRecorded is what recording an attempt did.
type EventRecorded struct {
	// Age is the time from the event's creation (settlement) to this
	// record, by the database clock.
	Age time.Duration
	// ConsumerDisabled reports that DisableConsumer took effect; false when
	// it was not asked for, or the consumer changed (or was already
	// disabled) since the claim.
	ConsumerDisabled bool
}

// EventRecordResult stores a delivery attempt and moves the event to
// DELIVERED, DEAD, or back to PENDING due at now()+RetryAfter, in one
// transaction with the attempt row (and, when asked, the consumer's
// disabled flag). Guard: status PENDING AND claim_token = ClaimToken; zero
// rows means the claim expired and another router took the event:
// execution.ErrConflict, and nothing is written. The consumer is disabled
// only while its version is still ConsumerVersion (zero rows: a newer
// configuration exists and is left alone).
func (s *Store) EventRecordResult(ctx context.Context, p EventResultParams) (EventRecorded, error) {
	status := EventPending
	switch {
	case p.Delivered:
		status = EventDelivered
	case p.Dead:
		status = EventDead
	}
	var rec EventRecorded
	err := s.withTx(ctx, func(tx pgx.Tx) error {
		var appID uuid.UUID
		var replay int
		err := tx.QueryRow(ctx, `
UPDATE completion_events
   SET status = $3, delivery_attempts = $4, round_attempts = round_attempts + 1,
       last_status_code = $5, last_error = $6,
       next_attempt_at = now() + make_interval(secs => $7), claim_token = NULL, claimed_until = NULL,
       delivered_at = CASE WHEN $3 = 'DELIVERED' THEN now() END, version = version + 1
 WHERE id = $1 AND claim_token = $2 AND status = 'PENDING'
RETURNING application_id, replays, now() - created_at`, p.ID, p.ClaimToken, status, p.Attempt, nullInt(p.StatusCode),
			nullable(p.Error), p.RetryAfter.Seconds()).Scan(&appID, &replay, &rec.Age)
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("record delivery of event %s: %w", p.ID, execution.ErrConflict)
		}
		if err != nil {
			return fmt.Errorf("record delivery: %w", err)
		}
		var consumerVersion *int64
		if p.ConsumerVersion != 0 {
			consumerVersion = &p.ConsumerVersion
		}
		_, err = tx.Exec(ctx, `
INSERT INTO delivery_attempts (event_id, attempt, application_id, status_code, error, started_at, replay,
                               consumer_kind, consumer_version)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)`, p.ID, p.Attempt, appID, nullInt(p.StatusCode), nullable(p.Error),
			p.StartedAt, replay, string(p.ConsumerKind), consumerVersion)
		if err != nil {
			return fmt.Errorf("insert delivery attempt: %w", err)
		}
		if p.DisableConsumer {
			tag, err := tx.Exec(ctx, `
UPDATE event_consumers
   SET disabled_at = now(), disabled_reason = $3, version = version + 1, updated_at = now()
 WHERE application_id = $1 AND version = $2 AND disabled_at IS NULL`, appID, p.ConsumerVersion, p.DisableReason)
			if err != nil {
				return fmt.Errorf("disable consumer: %w", err)
			}
			rec.ConsumerDisabled = tag.RowsAffected() == 1
		}
		return nil
	})
	if err != nil {
		return EventRecorded{}, err
	}
	return rec, nil
}

func nullInt(v int) *int {
	if v == 0 {
		return nil
	}
	return &v
}
