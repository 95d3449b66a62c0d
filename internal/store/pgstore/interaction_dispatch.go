package pgstore

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// InteractionDispatch is an interaction claimed for sending out over the
// webhook or kafka transport.
type InteractionDispatch struct {
	Interaction
	Attempt    int // the unit's attempt, bound into the resume token
	ClaimToken uuid.UUID
	Dispatches int // sends tried before this one
	// TraceContext is the W3C traceparent stored with the execution, ""
	// when none was.
	TraceContext string
}

// InteractionClaimDispatch claims up to limit interactions of the webhook
// and kafka transports that are WAITING or DISPATCHING, due to be sent and
// not under a live claim (FOR UPDATE SKIP LOCKED, so several consumers share
// the work), and marks them DISPATCHING. Completed interactions are never
// claimed, so a completed interaction is never sent again; one whose sender
// died after sending is sent again after the claim expires (at least once,
// with the same interaction id).
func (s *Store) InteractionClaimDispatch(ctx context.Context, limit int, claimFor time.Duration) ([]InteractionDispatch, error) {
	token := uuid.New()
	rows, err := s.pool.Query(ctx, `
UPDATE interactions i
   SET status = 'DISPATCHING', claim_token = $1, claimed_until = now() + make_interval(secs => $2),
       dispatch_attempts = i.dispatch_attempts + 1, version = i.version + 1, updated_at = now()
  FROM await_units u
 WHERE u.id = i.await_unit_id AND i.id IN (
        SELECT id FROM interactions
         WHERE status IN ('WAITING', 'DISPATCHING') AND transport <> 'interaction-api'
           AND next_dispatch_at <= now() AND deadline > now()
           AND (claimed_until IS NULL OR claimed_until < now())
         ORDER BY next_dispatch_at
         LIMIT $3
           FOR UPDATE SKIP LOCKED)
RETURNING i.id, i.correlation_id, i.execution_id, i.application_id, i.capability, i.status, i.transport, i.request,
          i.content_type, i.external_reference, i.deadline, i.created_at, u.attempt, i.claim_token, i.dispatch_attempts - 1,
          coalesce((SELECT x.trace_context FROM executions x WHERE x.id = i.execution_id), '')`,
		token, claimFor.Seconds(), limit)
	if err != nil {
		return nil, translate(fmt.Errorf("claim interactions: %w", err))
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (InteractionDispatch, error) {
		var d InteractionDispatch
		var ref *string
		err := r.Scan(&d.ID, &d.CorrelationID, &d.ExecutionID, &d.ApplicationID, &d.Capability, &d.Status, &d.Transport,
			&d.Request, &d.ContentType, &ref, &d.Deadline, &d.CreatedAt, &d.Attempt, &d.ClaimToken, &d.Dispatches,
			&d.TraceContext)
		d.ExternalReference = deref(ref)
		return d, err
	})
	return out, translate(err)
}

// InteractionDispatched records a send: DISPATCHED when it was delivered,
// or back to due at now()+retryIn when it failed. Guard: claim token and
// status DISPATCHING; zero rows means the interaction completed meanwhile
// or the claim expired — nothing to record, and not an error.
func (s *Store) InteractionDispatched(ctx context.Context, id, claimToken uuid.UUID, delivered bool, retryIn time.Duration) error {
	status := "DISPATCHED"
	if !delivered {
		status = "DISPATCHING"
	}
	_, err := s.pool.Exec(ctx, `
UPDATE interactions
   SET status = $3, claim_token = NULL, claimed_until = NULL,
       next_dispatch_at = CASE WHEN $3 = 'DISPATCHED' THEN NULL ELSE now() + make_interval(secs => $4) END,
       version = version + 1, updated_at = now()
 WHERE id = $1 AND claim_token = $2 AND status = 'DISPATCHING'`, id, claimToken, status, retryIn.Seconds())
	if err != nil {
		return translate(fmt.Errorf("record interaction send: %w", err))
	}
	return nil
}

// InteractionCapability returns the capability of an interaction, so the
// webhook transport can pick the secret that verifies a completion.
func (s *Store) InteractionCapability(ctx context.Context, id uuid.UUID) (string, error) {
	var c string
	if err := s.pool.QueryRow(ctx, `SELECT capability FROM interactions WHERE id = $1`, id).Scan(&c); err != nil {
		return "", translate(fmt.Errorf("interaction %s: %w", id, err))
	}
	return c, nil
}
