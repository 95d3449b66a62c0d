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

// EventDelivery is a claimed completion event with its consumer.
type EventDelivery struct {
	ID            uuid.UUID
	ExecutionID   uuid.UUID
	ApplicationID uuid.UUID
	Type          string
	Payload       []byte
	Attempts      int // delivery attempts made before this one
	CreatedAt     time.Time
	WebhookURL    string
	WebhookSecret string
	ClaimToken    uuid.UUID
}

// EventClaimParams claims due completion events.
type EventClaimParams struct {
	Owner    string
	Limit    int
	ClaimFor time.Duration
}

// EventClaim claims up to Limit PENDING events whose next attempt is due and
// whose claim (if any) expired, oldest first, with FOR UPDATE SKIP LOCKED so
// router replicas share the work. An event whose router dies mid-delivery is
// claimed again after ClaimFor: at-least-once delivery with a stable id.
func (s *Store) EventClaim(ctx context.Context, p EventClaimParams) ([]EventDelivery, error) {
	token := uuid.New()
	rows, err := s.pool.Query(ctx, `
WITH claimed AS (
  UPDATE completion_events e
     SET claim_token = $1, claimed_until = now() + make_interval(secs => $2)
   WHERE e.id IN (
          SELECT id FROM completion_events
           WHERE status = 'PENDING' AND next_attempt_at <= now()
             AND (claimed_until IS NULL OR claimed_until < now())
           ORDER BY next_attempt_at
           LIMIT $3
             FOR UPDATE SKIP LOCKED)
  RETURNING e.id, e.execution_id, e.application_id, e.type, e.payload, e.delivery_attempts, e.created_at, e.claim_token)
SELECT c.id, c.execution_id, c.application_id, c.type, c.payload, c.delivery_attempts, c.created_at,
       a.webhook_url, a.webhook_secret, c.claim_token
  FROM claimed c JOIN applications a ON a.id = c.application_id`, token, p.ClaimFor.Seconds(), p.Limit)
	if err != nil {
		return nil, translate(fmt.Errorf("claim events: %w", err))
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (EventDelivery, error) {
		var d EventDelivery
		err := r.Scan(&d.ID, &d.ExecutionID, &d.ApplicationID, &d.Type, &d.Payload, &d.Attempts, &d.CreatedAt,
			&d.WebhookURL, &d.WebhookSecret, &d.ClaimToken)
		return d, err
	})
	return out, translate(err)
}

// EventResultParams records one delivery attempt of a claimed event.
type EventResultParams struct {
	ID         uuid.UUID
	ClaimToken uuid.UUID
	Attempt    int // 1-based number of this delivery attempt
	StartedAt  time.Time
	StatusCode int    // 0 when no HTTP response
	Error      string // empty on success
	Delivered  bool
	Dead       bool          // no further attempt
	RetryAfter time.Duration // delay before the next attempt when neither Delivered nor Dead
}

// EventRecordResult stores a delivery attempt and moves the event to
// DELIVERED, DEAD, or back to PENDING due at now()+RetryAfter. Guard:
// status PENDING AND claim_token = ClaimToken; zero rows means the claim
// expired and another router took the event: execution.ErrConflict, and
// nothing is written.
func (s *Store) EventRecordResult(ctx context.Context, p EventResultParams) error {
	status := EventPending
	switch {
	case p.Delivered:
		status = EventDelivered
	case p.Dead:
		status = EventDead
	}
	return s.withTx(ctx, func(tx pgx.Tx) error {
		var appID uuid.UUID
		err := tx.QueryRow(ctx, `
UPDATE completion_events
   SET status = $3, delivery_attempts = $4, last_status_code = $5, last_error = $6,
       next_attempt_at = now() + make_interval(secs => $7), claim_token = NULL, claimed_until = NULL,
       delivered_at = CASE WHEN $3 = 'DELIVERED' THEN now() END, version = version + 1
 WHERE id = $1 AND claim_token = $2 AND status = 'PENDING'
RETURNING application_id`, p.ID, p.ClaimToken, status, p.Attempt, nullInt(p.StatusCode), nullable(p.Error),
			p.RetryAfter.Seconds()).Scan(&appID)
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("record delivery of event %s: %w", p.ID, execution.ErrConflict)
		}
		if err != nil {
			return fmt.Errorf("record delivery: %w", err)
		}
		_, err = tx.Exec(ctx, `
INSERT INTO delivery_attempts (event_id, attempt, application_id, status_code, error, started_at)
VALUES ($1, $2, $3, $4, $5, $6)`, p.ID, p.Attempt, appID, nullInt(p.StatusCode), nullable(p.Error), p.StartedAt)
		if err != nil {
			return fmt.Errorf("insert delivery attempt: %w", err)
		}
		return nil
	})
}

func nullInt(v int) *int {
	if v == 0 {
		return nil
	}
	return &v
}
