package pgstore

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// DispatchRecord is an outbox row: attempt N of an execution is due.
type DispatchRecord struct {
	ID          uuid.UUID
	ExecutionID uuid.UUID
	Attempt     int
	DueAt       time.Time
	// TraceContext is the W3C traceparent of the execution's trace, ""
	// when none was stored.
	TraceContext string
}

// DispatchClaimParams claims due dispatch records.
type DispatchClaimParams struct {
	Owner     string
	Limit     int
	ClaimFor  time.Duration // claim expiry from now (database clock)
	Lookahead time.Duration // records due within this window count as due
}

// DispatchClaim claims up to Limit dispatch records that are due (due_at ≤
// now() + Lookahead) and not under an unexpired claim, oldest first, with
// FOR UPDATE SKIP LOCKED so several dispatchers never claim the same row.
// It returns the claim token that DispatchDelete needs. A claim that is
// never deleted (the dispatcher died or the publish failed) expires and the
// record is claimed again: at-least-once publication.
func (s *Store) DispatchClaim(ctx context.Context, p DispatchClaimParams) ([]DispatchRecord, uuid.UUID, error) {
	token := uuid.New()
	rows, err := s.pool.Query(ctx, `
UPDATE dispatch_records d
   SET claim_token = $1, claimed_by = $2, claimed_until = now() + make_interval(secs => $3)
 WHERE d.id IN (
        SELECT id FROM dispatch_records
         WHERE due_at <= now() + make_interval(secs => $4)
           AND (claimed_until IS NULL OR claimed_until < now())
         ORDER BY due_at
         LIMIT $5
           FOR UPDATE SKIP LOCKED)
RETURNING d.id, d.execution_id, d.attempt, d.due_at, coalesce(d.trace_context, '')`,
		token, p.Owner, p.ClaimFor.Seconds(), p.Lookahead.Seconds(), p.Limit)
	if err != nil {
		return nil, uuid.Nil, translate(fmt.Errorf("claim dispatch records: %w", err))
	}
	recs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (DispatchRecord, error) {
		var d DispatchRecord
		err := r.Scan(&d.ID, &d.ExecutionID, &d.Attempt, &d.DueAt, &d.TraceContext)
		return d, err
	})
	if err != nil {
		return nil, uuid.Nil, translate(fmt.Errorf("claim dispatch records: %w", err))
	}
	return recs, token, nil
}

// DispatchDelete deletes published dispatch records. Guard: claim_token =
// token, so a dispatcher whose claim expired and was re-claimed deletes
// nothing of the new claim. It returns how many rows it deleted; fewer than
// len(ids) means another dispatcher re-claimed some (they may be published
// twice, which the consumer's guarded attempt start absorbs).
func (s *Store) DispatchDelete(ctx context.Context, ids []uuid.UUID, token uuid.UUID) (int64, error) {
	tag, err := s.pool.Exec(ctx, `DELETE FROM dispatch_records WHERE id = ANY($1) AND claim_token = $2`, ids, token)
	if err != nil {
		return 0, translate(fmt.Errorf("delete dispatch records: %w", err))
	}
	return tag.RowsAffected(), nil
}

// DispatchNextDue returns the due time of the earliest unclaimed dispatch
// record, or the zero time when there is none; the dispatcher sleeps until
// then (bounded by its pass interval).
func (s *Store) DispatchNextDue(ctx context.Context) (time.Time, time.Time, error) {
	var due *time.Time
	var now time.Time
	err := s.pool.QueryRow(ctx, `
SELECT min(due_at), now() FROM dispatch_records WHERE claimed_until IS NULL OR claimed_until < now()`).Scan(&due, &now)
	if err != nil {
		return time.Time{}, time.Time{}, translate(fmt.Errorf("next due dispatch record: %w", err))
	}
	if due == nil {
		return time.Time{}, now, nil
	}
	return *due, now, nil
}

// DispatchRepair is a safety net: it re-creates the dispatch record of every
// QUEUED or RETRY_SCHEDULED ASYNC execution that has none and has not
// changed for olderThan (database clock), due now, and returns how many it
// created. In a healthy system it finds nothing: a record is deleted only
// after its publication, and the consumer then starts the attempt. A record
// lost anyway (a bug, an operator's DELETE) would otherwise leave the
// execution waiting until its budget ends. A repaired record that races a
// slow consumer is a duplicate dispatch, which the guarded attempt start
// absorbs; ON CONFLICT keeps one record per attempt. The record carries
// the execution's trace context.
func (s *Store) DispatchRepair(ctx context.Context, olderThan time.Duration) (int64, error) {
	tag, err := s.pool.Exec(ctx, `
INSERT INTO dispatch_records (id, execution_id, application_id, attempt, due_at, trace_context)
SELECT gen_random_uuid(), e.id, e.application_id, e.attempt + 1, now(), e.trace_context
  FROM executions e
 WHERE e.status IN ('QUEUED', 'RETRY_SCHEDULED') AND e.mode = 'ASYNC'
   AND e.updated_at < now() - make_interval(secs => $1)
   AND NOT EXISTS (SELECT 1 FROM dispatch_records d WHERE d.execution_id = e.id)
ON CONFLICT (execution_id, attempt) DO NOTHING`, olderThan.Seconds())
	if err != nil {
		return 0, translate(fmt.Errorf("repair dispatch records: %w", err))
	}
	return tag.RowsAffected(), nil
}
