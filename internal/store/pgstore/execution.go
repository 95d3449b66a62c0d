package pgstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/capstan-dev/capstan/internal/execution"
)

const executionColumns = `id, application_id, capability, release, mode, status, attempt, max_attempts, version,
input, content_type, idempotency_key, lease_owner, lease_token, lease_expires_at, budget_deadline,
output, output_content_type, failure_class, failure_reason, failure_message, created_at, updated_at, settled_at,
await_unit_id, progress_percent, progress_message`

func scanExecution(row pgx.Row) (execution.Execution, error) {
	var (
		e                         execution.Execution
		idem, leaseOwner, outType *string
		fClass, fReason, fMessage *string
		leaseToken, awaitUnit     *uuid.UUID
		leaseExpires, settledAt   *time.Time
		mode, status              string
	)
	err := row.Scan(&e.ID, &e.ApplicationID, &e.Capability, &e.Release, &mode, &status, &e.Attempt, &e.MaxAttempts,
		&e.Version, &e.Input, &e.ContentType, &idem, &leaseOwner, &leaseToken, &leaseExpires, &e.BudgetDeadline,
		&e.Output, &outType, &fClass, &fReason, &fMessage, &e.CreatedAt, &e.UpdatedAt, &settledAt,
		&awaitUnit, &e.ProgressPercent, &e.ProgressMessage)
	if err != nil {
		return execution.Execution{}, err
	}
	e.Mode = execution.Mode(mode)
	e.Status = execution.Status(status)
	e.IdempotencyKey = deref(idem)
	e.LeaseOwner = deref(leaseOwner)
	if leaseToken != nil {
		e.LeaseToken = *leaseToken
	}
	if leaseExpires != nil {
		e.LeaseExpiresAt = *leaseExpires
	}
	if settledAt != nil {
		e.SettledAt = *settledAt
	}
	e.OutputType = deref(outType)
	if awaitUnit != nil {
		e.AwaitUnitID = *awaitUnit
	}
	if fClass != nil {
		e.Failure = &execution.Failure{Class: *fClass, Reason: deref(fReason), Message: deref(fMessage)}
	}
	return e, nil
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

func nullable(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// ExecutionInsertParams is an accepted invocation.
type ExecutionInsertParams struct {
	ApplicationID  uuid.UUID
	Capability     string
	Release        string
	Mode           execution.Mode
	MaxAttempts    int
	Input          []byte
	ContentType    string
	IdempotencyKey string // "" for none
	RequestHash    []byte // identifies "the same request" for the idempotency key
	AsyncBudget    time.Duration
	// Status is QUEUED for ASYNC (a dispatch record for attempt 1 is
	// inserted in the same transaction) and RUNNING for SYNC (attempt 1
	// starts at once under the gateway's lease; no dispatch record).
	Status     execution.Status
	LeaseOwner string        // SYNC only
	LeaseFor   time.Duration // SYNC only
	// TraceContext is the W3C traceparent of the accepting span ("" for
	// none), stored with the execution and its attempt-1 dispatch record so
	// that dispatch, attempts and the completion event continue its trace.
	TraceContext string
}

// ExecutionInsert commits a new execution and, for QUEUED, its dispatch
// record for attempt 1, in one transaction. With an idempotency key it
// returns the existing execution instead (created=false) when the same key
// was used with the same request hash, and execution.ErrIdempotencyConflict
// when it was used with a different one. Two concurrent first submissions
// with one key create exactly one execution: the unique index makes the
// second wait for the first's commit and then see its row.
func (s *Store) ExecutionInsert(ctx context.Context, p ExecutionInsertParams) (e execution.Execution, created bool, err error) {
	if p.Input == nil {
		p.Input = []byte{} // an empty input is a value, not NULL
	}
	err = s.withTx(ctx, func(tx pgx.Tx) error {
		id := uuid.New()
		var leaseToken *uuid.UUID
		var leaseOwner *string
		var attempt int
		leaseSeconds := 0.0
		if p.Status == execution.StatusRunning {
			t := uuid.New()
			leaseToken, leaseOwner, attempt = &t, &p.LeaseOwner, 1
			leaseSeconds = p.LeaseFor.Seconds()
		}
		row := tx.QueryRow(ctx, `
INSERT INTO executions (id, application_id, capability, release, mode, status, attempt, max_attempts,
                        input, content_type, idempotency_key, request_hash, budget_deadline,
                        lease_owner, lease_token, lease_expires_at, trace_context)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, now() + make_interval(secs => $13),
        $14, $15, CASE WHEN $15::uuid IS NULL THEN NULL ELSE now() + make_interval(secs => $16) END, $17)
ON CONFLICT (application_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING `+executionColumns,
			id, p.ApplicationID, p.Capability, p.Release, string(p.Mode), string(p.Status), attempt, p.MaxAttempts,
			p.Input, p.ContentType, nullable(p.IdempotencyKey), p.RequestHash, p.AsyncBudget.Seconds(),
			leaseOwner, leaseToken, leaseSeconds, nullable(p.TraceContext))
		e, err = scanExecution(row)
		if errors.Is(err, pgx.ErrNoRows) {
			// The key exists (possibly committed just now by a concurrent
			// first submission): return that execution if it is the same request.
			var hash []byte
			row := tx.QueryRow(ctx, `SELECT request_hash, `+executionColumns+`
  FROM executions WHERE application_id = $1 AND idempotency_key = $2`, p.ApplicationID, p.IdempotencyKey)
			var ex execution.Execution
			ex, err = scanExecution(prefixScanner{row: row, first: &hash})
			if err != nil {
				return fmt.Errorf("read execution for idempotency key: %w", err)
			}
			if !bytes.Equal(hash, p.RequestHash) {
				return fmt.Errorf("%w: execution %s", execution.ErrIdempotencyConflict, ex.ID)
			}
			e, created = ex, false
			return nil
		}
		if err != nil {
			return fmt.Errorf("insert execution: %w", err)
		}
		created = true
		if p.Status == execution.StatusQueued {
			if _, err := tx.Exec(ctx, `
INSERT INTO dispatch_records (id, execution_id, application_id, attempt, due_at, trace_context)
VALUES ($1, $2, $3, 1, now(), $4)`,
				uuid.New(), e.ID, e.ApplicationID, nullable(p.TraceContext)); err != nil {
				return fmt.Errorf("insert dispatch record: %w", err)
			}
		} else {
			if _, err := tx.Exec(ctx, `
INSERT INTO attempts (execution_id, attempt, application_id, worker, lease_token) VALUES ($1, 1, $2, $3, $4)`,
				e.ID, e.ApplicationID, e.LeaseOwner, e.LeaseToken); err != nil {
				return fmt.Errorf("insert attempt: %w", err)
			}
		}
		return nil
	})
	return e, created, err
}

// prefixScanner scans one leading column into first, then the execution.
type prefixScanner struct {
	row   pgx.Row
	first any
}

func (p prefixScanner) Scan(dest ...any) error {
	return p.row.Scan(append([]any{p.first}, dest...)...)
}

// ExecutionGet returns the execution id of application appID. Executions of
// other applications are reported as execution.ErrNotFound (tenancy is
// enforced in the WHERE clause). appID uuid.Nil skips the tenancy filter and
// is only for operators and daemons.
func (s *Store) ExecutionGet(ctx context.Context, appID, id uuid.UUID) (execution.Execution, error) {
	e, err := scanExecution(s.pool.QueryRow(ctx, `SELECT `+executionColumns+` FROM executions
 WHERE id = $1 AND ($2::uuid = '00000000-0000-0000-0000-000000000000' OR application_id = $2)`, id, appID))
	if err != nil {
		return execution.Execution{}, translate(fmt.Errorf("get execution %s: %w", id, err))
	}
	return e, nil
}

// AttemptStartParams starts attempt N of an execution.
type AttemptStartParams struct {
	ExecutionID uuid.UUID
	Attempt     int
	Owner       string        // worker id, stored as lease_owner
	LeaseFor    time.Duration // lease duration from now (database clock)
}

// AttemptStart moves the execution from QUEUED or RETRY_SCHEDULED to RUNNING
// as attempt N with a fresh lease token, and inserts the attempt row, in one
// transaction. Guard: status IN (QUEUED, RETRY_SCHEDULED) AND attempt = N-1
// AND the budget has not passed. Zero rows means the message is obsolete or
// a duplicate (the attempt already started, the execution moved on or
// settled, or its budget passed): execution.ErrConflict.
func (s *Store) AttemptStart(ctx context.Context, p AttemptStartParams) (execution.Execution, error) {
	var e execution.Execution
	err := s.withTx(ctx, func(tx pgx.Tx) error {
		var err error
		e, err = scanExecution(tx.QueryRow(ctx, `
UPDATE executions
   SET status = 'RUNNING', attempt = $2, lease_owner = $3, lease_token = $4,
       lease_expires_at = now() + make_interval(secs => $5), version = version + 1, updated_at = now()
 WHERE id = $1 AND attempt = $2 - 1 AND status IN ('QUEUED', 'RETRY_SCHEDULED') AND budget_deadline > now()
RETURNING `+executionColumns, p.ExecutionID, p.Attempt, p.Owner, uuid.New(), p.LeaseFor.Seconds()))
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("start attempt %d of %s: %w", p.Attempt, p.ExecutionID, execution.ErrConflict)
		}
		if err != nil {
			return fmt.Errorf("start attempt: %w", err)
		}
		_, err = tx.Exec(ctx, `
INSERT INTO attempts (execution_id, attempt, application_id, worker, lease_token) VALUES ($1, $2, $3, $4, $5)`,
			e.ID, e.Attempt, e.ApplicationID, p.Owner, e.LeaseToken)
		if err != nil {
			return fmt.Errorf("insert attempt: %w", err)
		}
		return nil
	})
	return e, err
}

// LeaseRenew extends the lease of attempt N to now()+leaseFor. Guard: status
// RUNNING or WAITING_EXTERNAL AND attempt = N AND lease_token = token AND
// the lease has not expired yet. Zero rows means the lease was lost
// (expired, reaped, superseded or settled): execution.ErrLeaseLost. It
// returns the new expiry.
func (s *Store) LeaseRenew(ctx context.Context, id uuid.UUID, attempt int, token uuid.UUID, leaseFor time.Duration) (time.Time, error) {
	var exp time.Time
	err := s.pool.QueryRow(ctx, `
UPDATE executions SET lease_expires_at = now() + make_interval(secs => $4), version = version + 1, updated_at = now()
 WHERE id = $1 AND attempt = $2 AND lease_token = $3 AND status IN ('RUNNING', 'WAITING_EXTERNAL')
   AND lease_expires_at > now()
RETURNING lease_expires_at`, id, attempt, token, leaseFor.Seconds()).Scan(&exp)
	if errors.Is(err, pgx.ErrNoRows) {
		return time.Time{}, fmt.Errorf("renew lease of %s attempt %d: %w", id, attempt, execution.ErrLeaseLost)
	}
	if err != nil {
		return time.Time{}, translate(fmt.Errorf("renew lease: %w", err))
	}
	return exp, nil
}

// LeaseKeep renews the lease of attempt N with LeaseRenew every third of
// leaseFor until ctx ends (the heartbeat of whoever holds the lease). It
// calls lost once and returns when the lease turns out to be lost; a failed
// renewal is logged and tried again at the next tick.
func (s *Store) LeaseKeep(ctx context.Context, log *slog.Logger, id uuid.UUID, attempt int, token uuid.UUID, leaseFor time.Duration, lost func()) {
	t := time.NewTicker(max(leaseFor/3, 10*time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		_, err := s.LeaseRenew(ctx, id, attempt, token, leaseFor)
		switch {
		case errors.Is(err, execution.ErrLeaseLost):
			lost()
			return
		case err != nil && ctx.Err() == nil:
			log.Warn("lease renewal failed; will try again", "error", err)
		}
	}
}

func isUniqueViolation(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23505"
}
