package pgstore

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/capstan-dev/capstan/internal/execution"
	eventv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/event/v1"
	executionv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/execution/v1"
)

// Fence identifies the writer of a guarded update. A settlement is guarded
// by Version when it is set (> 0); otherwise by Attempt and LeaseToken (the
// consumer holding the lease). Either way the row must be non-terminal.
type Fence struct {
	Version    int64
	Attempt    int
	LeaseToken uuid.UUID
}

// SettleParams gives an execution its terminal outcome.
type SettleParams struct {
	ExecutionID uuid.UUID
	Fence       Fence
	Status      execution.Status // SUCCEEDED, FAILED, TIMED_OUT or CANCELLED
	Output      []byte
	OutputType  string
	Failure     *execution.Failure // required unless SUCCEEDED
	// AttemptOutcome, when non-empty, closes the fenced attempt's row with
	// this outcome (SUCCEEDED, FAILED, RETRYABLE_FAILURE, LEASE_EXPIRED).
	AttemptOutcome string
	AttemptFailure *execution.Failure
}

// ExecutionSettle is the settlement compare-and-set (SYSTEM §3, §4 hop 5):
// one UPDATE guarded by the fence and "not terminal", and, only when it
// wins, the completion event, the closing of the attempt row, the removal
// of pending dispatch records and the cancellation of open await units and
// interactions, all in one transaction. Zero rows
// means another writer settled or moved the execution first:
// execution.ErrConflict, and nothing was written.
func (s *Store) ExecutionSettle(ctx context.Context, p SettleParams) (execution.Execution, error) {
	var e execution.Execution
	err := s.withTx(ctx, func(tx pgx.Tx) error {
		var err error
		e, err = settleTx(ctx, tx, p)
		return err
	})
	return e, err
}

func settleTx(ctx context.Context, tx pgx.Tx, p SettleParams) (execution.Execution, error) {
	if !p.Status.Terminal() {
		return execution.Execution{}, fmt.Errorf("settle %s: status %s is not terminal", p.ExecutionID, p.Status)
	}
	var f execution.Failure
	if p.Status != execution.StatusSucceeded {
		if p.Failure == nil {
			return execution.Execution{}, fmt.Errorf("settle %s as %s: failure is required", p.ExecutionID, p.Status)
		}
		f = p.Failure.Bounded()
	}
	e, err := scanExecution(tx.QueryRow(ctx, `
UPDATE executions
   SET status = $2, output = $3, output_content_type = $4, failure_class = $5, failure_reason = $6,
       failure_message = $7, settled_at = now(), updated_at = now(), version = version + 1,
       lease_token = NULL, lease_owner = NULL, lease_expires_at = NULL
 WHERE id = $1
   AND status IN ('QUEUED', 'RUNNING', 'WAITING_EXTERNAL', 'RETRY_SCHEDULED')
   AND (CASE WHEN $8::bigint > 0 THEN version = $8 ELSE attempt = $9 AND lease_token = $10 END)
RETURNING `+executionColumns,
		p.ExecutionID, string(p.Status), p.Output, nullable(p.OutputType), nullable(f.Class), nullable(f.Reason),
		nullable(f.Message), p.Fence.Version, p.Fence.Attempt, p.Fence.LeaseToken))
	if errors.Is(err, pgx.ErrNoRows) {
		return execution.Execution{}, fmt.Errorf("settle %s as %s: %w", p.ExecutionID, p.Status, execution.ErrConflict)
	}
	if err != nil {
		return execution.Execution{}, fmt.Errorf("settle: %w", err)
	}
	payload, evID, err := completionEventPayload(e)
	if err != nil {
		return execution.Execution{}, err
	}
	if _, err := tx.Exec(ctx, `
INSERT INTO completion_events (id, execution_id, application_id, type, payload, trace_context)
SELECT $1, $2, $3, $4, $5, trace_context FROM executions WHERE id = $2`,
		evID, e.ID, e.ApplicationID, e.Status.EventType(), payload); err != nil {
		return execution.Execution{}, fmt.Errorf("insert completion event: %w", err)
	}
	if p.AttemptOutcome != "" && p.Fence.Attempt > 0 {
		if err := closeAttempt(ctx, tx, e.ID, p.Fence.Attempt, p.AttemptOutcome, p.AttemptFailure); err != nil {
			return execution.Execution{}, err
		}
	}
	if _, err := tx.Exec(ctx, `DELETE FROM dispatch_records WHERE execution_id = $1`, e.ID); err != nil {
		return execution.Execution{}, fmt.Errorf("delete dispatch records: %w", err)
	}
	if err := cancelOpenAwaitsTx(ctx, tx, e.ID, false); err != nil {
		return execution.Execution{}, err
	}
	return e, nil
}

// closeAttempt ends an attempt row. Guard: outcome is still RUNNING; zero
// rows means it was already closed (by the reaper or a settlement), which is
// not an error for the caller whose main update already won.
func closeAttempt(ctx context.Context, tx pgx.Tx, id uuid.UUID, attempt int, outcome string, f *execution.Failure) error {
	var class, msg *string
	if f != nil {
		b := f.Bounded()
		class, msg = &b.Class, &b.Message
	}
	_, err := tx.Exec(ctx, `
UPDATE attempts SET outcome = $3, failure_class = $4, failure_message = $5, ended_at = now()
 WHERE execution_id = $1 AND attempt = $2 AND outcome = 'RUNNING'`, id, attempt, outcome, class, msg)
	if err != nil {
		return fmt.Errorf("close attempt %d: %w", attempt, err)
	}
	return nil
}

// completionEventPayload renders the protobuf-JSON CompletionEvent of a
// settled execution and its new event id.
func completionEventPayload(e execution.Execution) ([]byte, uuid.UUID, error) {
	id := uuid.New()
	ev := &eventv1.CompletionEvent{
		EventId:           id.String(),
		Type:              e.Status.EventType(),
		ExecutionId:       e.ID.String(),
		Capability:        e.Capability,
		Status:            StatusToProto(e.Status),
		Attempts:          int32(e.Attempt),
		Output:            e.Output,
		OutputContentType: e.OutputType,
		SettledAt:         timestamppb.New(e.SettledAt),
		IdempotencyKey:    e.IdempotencyKey,
		ApplicationId:     e.ApplicationID.String(),
	}
	if e.Failure != nil {
		ev.Failure = &executionv1.Failure{Class: e.Failure.Class, Reason: e.Failure.Reason, Message: e.Failure.Message}
	}
	b, err := protojson.Marshal(ev)
	if err != nil {
		return nil, uuid.Nil, fmt.Errorf("marshal completion event: %w", err)
	}
	return b, id, nil
}

// StatusToProto maps a domain status to its protobuf enum.
func StatusToProto(s execution.Status) executionv1.ExecutionStatus {
	v, ok := executionv1.ExecutionStatus_value["EXECUTION_STATUS_"+string(s)]
	if !ok {
		return executionv1.ExecutionStatus_EXECUTION_STATUS_UNSPECIFIED
	}
	return executionv1.ExecutionStatus(v)
}

// RetryParams reports a retryable failure of the fenced attempt.
type RetryParams struct {
	ExecutionID uuid.UUID
	Fence       Fence // Attempt and LeaseToken of the failed attempt
	Failure     execution.Failure
	Policy      execution.Policy
	// AttemptOutcome closes the attempt row: RETRYABLE_FAILURE by default,
	// LEASE_EXPIRED for the reaper.
	AttemptOutcome string
	Rand           *rand.Rand // jitter source; nil means the global one
	// RequireExpired (the reaper) re-checks under the row lock that the
	// lease is still expired, so a lease renewed after the reaper read it
	// is left alone.
	RequireExpired bool
	// Free hands the execution to its next attempt at once without using
	// up an attempt: no delay, and the attempt ceiling moves up by one with
	// the attempt number (a consumer shutting down releases a file's live
	// session this way; the next attempt replays it).
	Free bool
	// skipHeld is set when the retry itself comes from applying a held
	// completion, which must not be looked for again.
	skipHeld bool
}

// RetryResult says what AttemptRetry did.
type RetryResult struct {
	// Released: a completion recorded before the park was applied instead
	// (the execution settled); Decision is then zero.
	Released  bool
	Decision  execution.RetryDecision
	Execution execution.Execution
	DueAt     time.Time // for RetrySchedule
}

// AttemptRetry handles a retryable failure of attempt N (SYSTEM §4 hop 3):
// under a row lock it re-checks the fence (status RUNNING or
// WAITING_EXTERNAL, attempt = N, lease token), then either schedules
// attempt N+1 (RETRY_SCHEDULED plus its dispatch record, due at
// now()+delay), or settles FAILED / retry_exhausted.attempt_limit past the
// attempt ceiling, or TIMED_OUT / timeout.async_budget when the next attempt
// could not start before the budget ends — all in one transaction. A fence
// that no longer matches returns execution.ErrLeaseLost and writes nothing.
func (s *Store) AttemptRetry(ctx context.Context, p RetryParams) (RetryResult, error) {
	var res RetryResult
	err := s.withTx(ctx, func(tx pgx.Tx) error {
		var err error
		res, err = retryTx(ctx, tx, p)
		return err
	})
	return res, err
}

// retryTx is AttemptRetry inside the caller's transaction.
func retryTx(ctx context.Context, tx pgx.Tx, p RetryParams) (RetryResult, error) {
	var res RetryResult
	outcome := p.AttemptOutcome
	if outcome == "" {
		outcome = "RETRYABLE_FAILURE"
	}
	failure := p.Failure.Bounded()
	var (
		status          string
		attempt, maxAtt int
		token           *uuid.UUID
		version         int64
		budget, now     time.Time
		leaseExpires    *time.Time
	)
	err := tx.QueryRow(ctx, `
SELECT status, attempt, max_attempts, lease_token, version, budget_deadline, now(), lease_expires_at
  FROM executions WHERE id = $1 FOR UPDATE`, p.ExecutionID).
		Scan(&status, &attempt, &maxAtt, &token, &version, &budget, &now, &leaseExpires)
	if err != nil {
		return res, fmt.Errorf("read execution for retry: %w", err)
	}
	if (status != string(execution.StatusRunning) && status != string(execution.StatusWaitingExternal)) ||
		attempt != p.Fence.Attempt || token == nil || *token != p.Fence.LeaseToken {
		return res, fmt.Errorf("retry %s attempt %d: %w", p.ExecutionID, p.Fence.Attempt, execution.ErrLeaseLost)
	}
	if p.RequireExpired && (leaseExpires == nil || !leaseExpires.Before(now)) {
		// Renewed since the reaper read it: the attempt is alive.
		return res, fmt.Errorf("reap %s attempt %d: lease renewed meanwhile: %w", p.ExecutionID, attempt, execution.ErrLeaseLost)
	}
	if !p.skipHeld && status == string(execution.StatusRunning) {
		// A completion recorded before the park (held) is this attempt's
		// outcome: apply it instead of running the adapter again.
		held, err := heldCompletionTx(ctx, tx, p.ExecutionID, attempt)
		if err != nil {
			return res, err
		}
		if held != nil {
			l := lockedExecution{status: execution.Status(status), attempt: attempt, leaseToken: *token, version: version, now: now}
			res.Decision = execution.RetrySchedule
			res.Execution, err = applyCompletionTx(ctx, tx, p.ExecutionID, l, *held, p.Policy)
			if err == nil && res.Execution.Status.Terminal() {
				res.Decision = 0
				res.Released = true
			}
			return res, err
		}
	}
	delay := p.Policy.RetryDelay(attempt, p.Rand)
	if p.Free {
		delay, maxAtt = 0, maxAtt+1
	}
	res.Decision = execution.DecideRetry(attempt, maxAtt, now, delay, budget)
	switch res.Decision {
	case execution.RetryExhausted, execution.RetryBudgetExceeded:
		st, reason := execution.StatusFailed, execution.ReasonAttemptLimit
		if res.Decision == execution.RetryBudgetExceeded {
			st, reason = execution.StatusTimedOut, execution.ReasonAsyncBudget
		}
		final := failure
		final.Reason = reason
		res.Execution, err = settleTx(ctx, tx, SettleParams{
			ExecutionID: p.ExecutionID, Fence: Fence{Version: version, Attempt: attempt}, Status: st,
			Failure: &final, AttemptOutcome: outcome, AttemptFailure: &failure,
		})
		return res, err
	}
	res.Execution, err = scanExecution(tx.QueryRow(ctx, `
UPDATE executions
   SET status = 'RETRY_SCHEDULED', failure_class = $3, failure_message = $4, lease_token = NULL,
       lease_owner = NULL, lease_expires_at = NULL, version = version + 1, updated_at = now(),
       max_attempts = max_attempts + CASE WHEN $5 THEN 1 ELSE 0 END
 WHERE id = $1 AND version = $2 AND status IN ('RUNNING', 'WAITING_EXTERNAL')
RETURNING `+executionColumns, p.ExecutionID, version, failure.Class, failure.Message, p.Free))
	if errors.Is(err, pgx.ErrNoRows) {
		// Unreachable under FOR UPDATE; kept as the guard's contract.
		return res, fmt.Errorf("retry %s: %w", p.ExecutionID, execution.ErrConflict)
	}
	if err != nil {
		return res, fmt.Errorf("schedule retry: %w", err)
	}
	err = tx.QueryRow(ctx, `
INSERT INTO dispatch_records (id, execution_id, application_id, attempt, due_at, trace_context)
SELECT $1, $2, $3, $4, now() + make_interval(secs => $5), trace_context FROM executions WHERE id = $2
RETURNING due_at`,
		uuid.New(), p.ExecutionID, res.Execution.ApplicationID, attempt+1, delay.Seconds()).Scan(&res.DueAt)
	if err != nil {
		return res, fmt.Errorf("insert dispatch record for attempt %d: %w", attempt+1, err)
	}
	if err := cancelOpenAwaitsTx(ctx, tx, p.ExecutionID, true); err != nil {
		return res, err
	}
	return res, closeAttempt(ctx, tx, p.ExecutionID, attempt, outcome, &failure)
}

// LeaseExpired is an attempt whose lease has passed its expiry.
type LeaseExpired struct {
	ExecutionID uuid.UUID
	Capability  string
	Release     string
	Attempt     int
	LeaseToken  uuid.UUID
	Mode        execution.Mode
}

// LeaseExpiredList returns up to limit attempts of RUNNING or
// WAITING_EXTERNAL executions whose lease expired (database clock), oldest
// first. It only reads: the reaper fails each ASYNC attempt through
// AttemptRetry and settles each SYNC one (whose gateway died mid-call)
// FAILED, both fenced by status, attempt and token.
func (s *Store) LeaseExpiredList(ctx context.Context, limit int) ([]LeaseExpired, error) {
	rows, err := s.pool.Query(ctx, `
SELECT id, capability, release, attempt, lease_token, mode FROM executions
 WHERE status IN ('RUNNING', 'WAITING_EXTERNAL') AND lease_expires_at < now()
 ORDER BY lease_expires_at LIMIT $1`, limit)
	if err != nil {
		return nil, translate(fmt.Errorf("list expired leases: %w", err))
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (LeaseExpired, error) {
		var l LeaseExpired
		var mode string
		err := r.Scan(&l.ExecutionID, &l.Capability, &l.Release, &l.Attempt, &l.LeaseToken, &mode)
		l.Mode = execution.Mode(mode)
		return l, err
	})
	return out, translate(err)
}

// BudgetExpired is a non-terminal execution whose async budget has passed.
type BudgetExpired struct {
	ExecutionID uuid.UUID
	Version     int64
	Attempt     int
	LastFailure *execution.Failure
}

// BudgetExpiredList returns up to limit non-terminal ASYNC executions whose
// budget deadline has passed (database clock).
func (s *Store) BudgetExpiredList(ctx context.Context, limit int) ([]BudgetExpired, error) {
	rows, err := s.pool.Query(ctx, `
SELECT id, version, attempt, failure_class, failure_message FROM executions
 WHERE status IN ('QUEUED', 'RUNNING', 'WAITING_EXTERNAL', 'RETRY_SCHEDULED') AND budget_deadline < now()
   AND mode = 'ASYNC'
 ORDER BY budget_deadline LIMIT $1`, limit)
	if err != nil {
		return nil, translate(fmt.Errorf("list expired budgets: %w", err))
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (BudgetExpired, error) {
		var b BudgetExpired
		var class, msg *string
		err := r.Scan(&b.ExecutionID, &b.Version, &b.Attempt, &class, &msg)
		if class != nil {
			b.LastFailure = &execution.Failure{Class: *class, Message: deref(msg)}
		}
		return b, err
	})
	return out, translate(err)
}
