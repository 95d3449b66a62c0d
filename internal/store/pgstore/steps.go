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

// ItemsChannel is the PostgreSQL notification channel on which the
// admission of an item's completion (or its timeout) is announced, with the
// unit id as payload, after the recording transaction commits.
const ItemsChannel = "capstan_await_items"

// StepUnitID is the deterministic id of the await unit of release step
// `step` of an execution. Unlike AwaitUnitID it does not depend on the
// attempt: every attempt of the execution adopts the same unit.
func StepUnitID(executionID uuid.UUID, step string) uuid.UUID {
	return AwaitUnitID(executionID, 0, step)
}

// StepOpenParams opens (or adopts) the unit of a release step and parks the
// running attempt on it.
type StepOpenParams struct {
	ExecutionID   uuid.UUID
	ApplicationID uuid.UUID
	Attempt       int
	LeaseToken    uuid.UUID
	Step          string
	Cardinality   string // ONE_TO_ONE, MANY_TO_ONE, ONE_TO_MANY or MANY_TO_MANY
	Transport     string
	// LeaseFor is the session's lease from now; the session renews it with
	// LeaseRenew, or the reaper schedules the next attempt, which adopts
	// the unit.
	LeaseFor time.Duration
}

// StepUnit is the unit of a release step as the live session sees it.
type StepUnit struct {
	ID uuid.UUID
	// Attempt is the attempt that opened the unit; its interactions' resume
	// tokens are bound to it.
	Attempt int
	// Adopted: the unit was opened by an earlier attempt.
	Adopted bool
}

// StepOpen opens the unit of a release step unless it exists, and parks the
// execution on it in WAITING_EXTERNAL with the session's lease (SYSTEM §6,
// live session), in one transaction. Fence: status RUNNING, attempt and
// lease token under the row lock; a mismatch is execution.ErrLeaseLost and
// writes nothing. A unit opened by an earlier attempt is adopted, with its
// interactions.
func (s *Store) StepOpen(ctx context.Context, p StepOpenParams) (StepUnit, error) {
	u := StepUnit{ID: StepUnitID(p.ExecutionID, p.Step)}
	err := s.withTx(ctx, func(tx pgx.Tx) error {
		l, err := lockExecutionTx(ctx, tx, p.ExecutionID)
		if err != nil {
			return err
		}
		if l.status != execution.StatusRunning || l.attempt != p.Attempt || l.leaseToken != p.LeaseToken {
			return fmt.Errorf("open step %s of %s attempt %d: %w", p.Step, p.ExecutionID, p.Attempt, execution.ErrLeaseLost)
		}
		// The unit's deadline is the execution's budget; items have their own.
		if _, err := tx.Exec(ctx, `
INSERT INTO await_units (id, execution_id, application_id, attempt, step, cardinality, transport, deadline, release_step)
SELECT $1, $2, $3, $4, $5, $6, $7, budget_deadline, true FROM executions WHERE id = $2
ON CONFLICT (id) DO NOTHING`, u.ID, p.ExecutionID, p.ApplicationID, p.Attempt, p.Step, p.Cardinality, p.Transport); err != nil {
			return fmt.Errorf("open step unit: %w", err)
		}
		if err := tx.QueryRow(ctx, `SELECT attempt FROM await_units WHERE id = $1`, u.ID).Scan(&u.Attempt); err != nil {
			return fmt.Errorf("read step unit: %w", err)
		}
		u.Adopted = u.Attempt != p.Attempt
		tag, err := tx.Exec(ctx, `
UPDATE executions
   SET status = 'WAITING_EXTERNAL', await_unit_id = $3, lease_expires_at = now() + make_interval(secs => $4),
       version = version + 1, updated_at = now()
 WHERE id = $1 AND version = $2 AND status = 'RUNNING'`, p.ExecutionID, l.version, u.ID, p.LeaseFor.Seconds())
		if err != nil {
			return fmt.Errorf("park on step unit: %w", err)
		}
		if tag.RowsAffected() == 0 {
			return fmt.Errorf("park %s: %w", p.ExecutionID, execution.ErrConflict) // unreachable under the lock
		}
		return nil
	})
	return u, err
}

// ItemRequest is one item to open in a step unit.
type ItemRequest struct {
	Seq         int // position in the unit, 0-based
	Request     []byte
	ContentType string
}

// ItemState is an item interaction as the live session sees it.
type ItemState struct {
	Seq           int
	InteractionID uuid.UUID
	CorrelationID string
	Status        string
	Deadline      time.Time
	// Sends is how many times the item was claimed for sending (each claim
	// is one send tried), this call's claim included. A completion may race
	// its send's recording; counting at the claim keeps Sends exact.
	Sends int
	// Send: this call claimed the item for sending (a new item, or one
	// left unsent or half-sent by a dead session); the caller sends it and
	// records the send with ItemsSent or ItemsSendFailed.
	Send bool
	// Outcome is set when Status is terminal: the admitted result or
	// failure; TIMED_OUT and CANCELLED carry a failure.
	Outcome *execution.Outcome
}

// ItemsOpenParams opens items of a step unit.
type ItemsOpenParams struct {
	Unit                       StepUnit
	ExecutionID, ApplicationID uuid.UUID
	// Attempt and LeaseToken fence the session: the execution must still be
	// WAITING_EXTERNAL on this attempt and lease.
	Attempt    int
	LeaseToken uuid.UUID
	Capability string
	Transport  string
	Items      []ItemRequest
	// Timeout is each new item's deadline from now.
	Timeout time.Duration
	// ClaimToken and ClaimFor claim items to send: while the claim lasts
	// the background sender leaves them alone; if the session dies, it
	// sends them after the claim expires.
	ClaimToken uuid.UUID
	ClaimFor   time.Duration
}

// ItemsOpen creates the interactions of items that have none yet (the id
// is derived from the unit and the seq, so an item never gets a second
// interaction), claims for sending those of a pushed transport that are new
// or were left unsent (WAITING or DISPATCHING with no live claim), and
// returns the state of every requested item in the order given. Items
// already sent are not claimed: they are awaited, never sent again, and
// terminal items come back with their stored outcome. Fence: the execution
// is WAITING_EXTERNAL with the session's attempt and lease token (read FOR
// SHARE, so a settlement waits for the items to be written and then
// cancels them); otherwise execution.ErrLeaseLost and nothing is written —
// a session that has not noticed a cancellation yet opens nothing more.
func (s *Store) ItemsOpen(ctx context.Context, p ItemsOpenParams) ([]ItemState, error) {
	n := len(p.Items)
	seqs := make([]int32, n)
	ids := make([]uuid.UUID, n)
	reqs := make([][]byte, n)
	types := make([]string, n)
	for k, it := range p.Items {
		seqs[k] = int32(it.Seq)
		ids[k] = InteractionID(p.Unit.ID, it.Seq)
		reqs[k] = it.Request
		if reqs[k] == nil {
			reqs[k] = []byte{}
		}
		types[k] = it.ContentType
	}
	var out []ItemState
	err := s.withTx(ctx, func(tx pgx.Tx) error {
		var live bool
		if err := tx.QueryRow(ctx, `
SELECT EXISTS (SELECT 1 FROM executions
                WHERE id = $1 AND attempt = $2 AND lease_token = $3 AND status = 'WAITING_EXTERNAL' FOR SHARE)`,
			p.ExecutionID, p.Attempt, p.LeaseToken).Scan(&live); err != nil {
			return fmt.Errorf("check the session's lease: %w", err)
		}
		if !live {
			return fmt.Errorf("open items of %s attempt %d: %w", p.ExecutionID, p.Attempt, execution.ErrLeaseLost)
		}
		pushed := p.Transport != TransportInteractionAPI
		// New items: created claimed (pushed transports) so the session
		// sends them; the idempotency key and correlation id are unique too.
		if _, err := tx.Exec(ctx, `
INSERT INTO interactions (id, await_unit_id, execution_id, application_id, capability, seq, idempotency_key,
                          correlation_id, transport, status, dispatch_attempts, request, content_type, deadline,
                          next_dispatch_at, claim_token, claimed_until)
SELECT x.id, $1, $2, $3, $4, x.seq, $14 || '/' || x.seq, x.id::text, $5,
       CASE WHEN $6 THEN 'DISPATCHING' ELSE 'WAITING' END, CASE WHEN $6 THEN 1 ELSE 0 END, x.req, x.ct,
       now() + make_interval(secs => $7),
       CASE WHEN $6 THEN now() END, CASE WHEN $6 THEN $8::uuid END,
       CASE WHEN $6 THEN now() + make_interval(secs => $9) END
  FROM unnest($10::uuid[], $11::int[], $12::bytea[], $13::text[]) AS x(id, seq, req, ct)
ON CONFLICT (id) DO NOTHING`,
			p.Unit.ID, p.ExecutionID, p.ApplicationID, p.Capability, p.Transport, pushed, p.Timeout.Seconds(),
			p.ClaimToken, p.ClaimFor.Seconds(), ids, seqs, reqs, types, p.Unit.ID.String()); err != nil {
			return fmt.Errorf("open items: %w", err)
		}
		if pushed {
			// Items left unsent by a dead session: claim them. Guard: not
			// terminal, not sent, no live claim; zero rows means none was.
			if _, err := tx.Exec(ctx, `
UPDATE interactions
   SET status = 'DISPATCHING', claim_token = $3, claimed_until = now() + make_interval(secs => $4),
       dispatch_attempts = dispatch_attempts + 1, version = version + 1, updated_at = now()
 WHERE await_unit_id = $1 AND seq = ANY($2) AND status IN ('WAITING', 'DISPATCHING') AND deadline > now()
   AND (claimed_until IS NULL OR claimed_until < now())`,
				p.Unit.ID, seqs, p.ClaimToken, p.ClaimFor.Seconds()); err != nil {
				return fmt.Errorf("claim unsent items: %w", err)
			}
		}
		rows, err := tx.Query(ctx, itemStateQuery+` AND seq = ANY($2) ORDER BY seq`, p.Unit.ID, seqs, p.ClaimToken)
		if err != nil {
			return fmt.Errorf("read items: %w", err)
		}
		states, err := pgx.CollectRows(rows, scanItemState)
		if err != nil {
			return fmt.Errorf("read items: %w", err)
		}
		if len(states) != n {
			return fmt.Errorf("read items: %d of %d found", len(states), n)
		}
		out = states
		return nil
	})
	return out, err
}

const itemStateQuery = `
SELECT seq, id, correlation_id, status, deadline, dispatch_attempts,
       status = 'DISPATCHING' AND claim_token IS NOT DISTINCT FROM $3::uuid,
       result, result_content_type, failure_class, failure_message, failure_retryable
  FROM interactions WHERE await_unit_id = $1`

func scanItemState(r pgx.CollectableRow) (ItemState, error) {
	var (
		st                           ItemState
		result                       []byte
		resultType, fClass, fMessage *string
		retryable                    bool
	)
	if err := r.Scan(&st.Seq, &st.InteractionID, &st.CorrelationID, &st.Status, &st.Deadline, &st.Sends, &st.Send,
		&result, &resultType, &fClass, &fMessage, &retryable); err != nil {
		return st, err
	}
	switch st.Status {
	case InteractionCompleted:
		st.Outcome = &execution.Outcome{Succeeded: true, Output: result, OutputType: deref(resultType)}
	case InteractionFailed, InteractionTimedOut, InteractionCancelled:
		f := execution.Failure{Class: deref(fClass), Message: deref(fMessage), Retryable: retryable}
		if f.Class == "" {
			f.Class = ClassAwaitCancelled
			if st.Status == InteractionTimedOut {
				f.Class = ClassAwaitTimedOut
			}
		}
		st.Outcome = &execution.Outcome{Failure: f}
	}
	return st, nil
}

// ItemsTerminal returns the items among seqs whose interaction is terminal,
// with their outcomes, in seq order.
func (s *Store) ItemsTerminal(ctx context.Context, unitID uuid.UUID, seqs []int32) ([]ItemState, error) {
	rows, err := s.pool.Query(ctx, itemStateQuery+` AND seq = ANY($2)
   AND status IN ('COMPLETED', 'FAILED', 'TIMED_OUT', 'CANCELLED') ORDER BY seq`, unitID, seqs, uuid.Nil)
	if err != nil {
		return nil, translate(fmt.Errorf("read terminal items: %w", err))
	}
	out, err := pgx.CollectRows(rows, scanItemState)
	return out, translate(err)
}

// ItemsSent records that the claimed items were sent: DISPATCHED. Guard:
// claim token and status DISPATCHING; an item that completed meanwhile (a
// completion may race its own send) is left as it is.
func (s *Store) ItemsSent(ctx context.Context, ids []uuid.UUID, claimToken uuid.UUID) error {
	_, err := s.pool.Exec(ctx, `
UPDATE interactions
   SET status = 'DISPATCHED', claim_token = NULL, claimed_until = NULL,
       next_dispatch_at = NULL, version = version + 1, updated_at = now()
 WHERE id = ANY($1) AND claim_token = $2 AND status = 'DISPATCHING'`, ids, claimToken)
	return translate(wrapIf(err, "record item sends"))
}

// ItemsSendFailed releases the claim of items whose send failed; the
// background sender (InteractionClaimDispatch) retries them from
// now()+retryIn. Guard as ItemsSent.
func (s *Store) ItemsSendFailed(ctx context.Context, ids []uuid.UUID, claimToken uuid.UUID, retryIn time.Duration) error {
	_, err := s.pool.Exec(ctx, `
UPDATE interactions
   SET claim_token = NULL, claimed_until = NULL,
       next_dispatch_at = now() + make_interval(secs => $3), version = version + 1, updated_at = now()
 WHERE id = ANY($1) AND claim_token = $2 AND status = 'DISPATCHING'`, ids, claimToken, retryIn.Seconds())
	return translate(wrapIf(err, "record failed item sends"))
}

func wrapIf(err error, what string) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%s: %w", what, err)
}

// StepSettleParams settles an execution at the end of its release steps.
type StepSettleParams struct {
	SettleParams
	UnitID    uuid.UUID
	ItemCount int
}

// StepSettle completes the step unit (status WAITING → COMPLETED with its
// item count; zero rows means an earlier attempt completed it, which is
// fine) and settles the execution with the fenced settlement of
// ExecutionSettle, in one transaction: either both happen or neither.
func (s *Store) StepSettle(ctx context.Context, p StepSettleParams) (execution.Execution, error) {
	var e execution.Execution
	err := s.withTx(ctx, func(tx pgx.Tx) error {
		// Lock order as everywhere: the execution row first, then the unit
		// (settlement and the sweep reach the unit through the execution).
		if _, err := lockExecutionTx(ctx, tx, p.ExecutionID); err != nil {
			return err
		}
		status := UnitCompleted
		if p.Status != execution.StatusSucceeded {
			status = UnitFailed
		}
		if _, err := tx.Exec(ctx, `
UPDATE await_units SET status = $2, item_count = $3, version = version + 1, updated_at = now()
 WHERE id = $1 AND status = 'WAITING'`, p.UnitID, status, p.ItemCount); err != nil {
			return fmt.Errorf("complete step unit: %w", err)
		}
		var err error
		e, err = settleTx(ctx, tx, p.SettleParams)
		return err
	})
	return e, err
}

// ListenItems listens on ItemsChannel until ctx ends and calls notify with
// the unit id of every notification, from one goroutine. It holds one pool
// connection; when the connection breaks it reconnects with backoff and
// calls notify(uuid.Nil), meaning "notifications may have been missed".
func (s *Store) ListenItems(ctx context.Context, notify func(unitID uuid.UUID)) error {
	wait := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := s.listenOnce(ctx, notify)
		if ctx.Err() != nil {
			return nil
		}
		s.logger.Warn("item notification listener lost its connection; reconnecting", "error", err, "retry_in", wait)
		notify(uuid.Nil)
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
		wait = min(2*wait, 5*time.Second)
	}
	return nil
}

func (s *Store) listenOnce(ctx context.Context, notify func(uuid.UUID)) error {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer func() {
		// A connection left listening must not go back to the pool.
		_ = conn.Conn().Close(context.WithoutCancel(ctx))
		conn.Release()
	}()
	if _, err := conn.Exec(ctx, `LISTEN `+ItemsChannel); err != nil {
		return err
	}
	notify(uuid.Nil) // (re)connected: anything before this may be missed
	for {
		n, err := conn.Conn().WaitForNotification(ctx)
		if err != nil {
			return err
		}
		id, err := uuid.Parse(n.Payload)
		if err != nil {
			if errors.Is(ctx.Err(), context.Canceled) {
				return nil
			}
			s.logger.Warn("malformed item notification ignored", "payload", n.Payload)
			continue
		}
		notify(id)
	}
}
