package pgstore

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/capstan-dev/capstan/internal/execution"
)

// Await unit and interaction statuses (SYSTEM §6).
const (
	UnitWaiting   = "WAITING"
	UnitCompleted = "COMPLETED"
	UnitFailed    = "FAILED"
	UnitTimedOut  = "TIMED_OUT"
	UnitCancelled = "CANCELLED"

	InteractionWaiting     = "WAITING"
	InteractionDispatching = "DISPATCHING"
	InteractionDispatched  = "DISPATCHED"
	InteractionCompleted   = "COMPLETED"
	InteractionFailed      = "FAILED"
	InteractionTimedOut    = "TIMED_OUT"
	InteractionCancelled   = "CANCELLED"
)

// Transports.
const (
	TransportInteractionAPI = "interaction-api"
	TransportWebhook        = "webhook"
	TransportKafka          = "kafka"
)

// Failure classes of await units.
const (
	ClassAwaitTimedOut  = "await.timed_out"
	ClassAwaitCancelled = "await.cancelled"
)

// StepAdapter is the step name of the unit an attempt opens when its
// adapter answers "accepted".
const StepAdapter = "adapter"

var awaitNamespace = uuid.MustParse("6f1c3c0e-8d0b-4b55-9d3c-2f9a3d7e0c11")

// AwaitUnitID is the deterministic id of the unit that attempt `attempt` of
// an execution opens at step: a replay of the same attempt finds the same
// unit instead of opening another.
func AwaitUnitID(executionID uuid.UUID, attempt int, step string) uuid.UUID {
	return uuid.NewSHA1(awaitNamespace, []byte(executionID.String()+"/"+strconv.Itoa(attempt)+"/"+step))
}

// InteractionID is the deterministic id of item seq of a unit.
func InteractionID(unitID uuid.UUID, seq int) uuid.UUID {
	return uuid.NewSHA1(unitID, []byte(strconv.Itoa(seq)))
}

func isTerminalInteraction(s string) bool {
	switch s {
	case InteractionCompleted, InteractionFailed, InteractionTimedOut, InteractionCancelled:
		return true
	}
	return false
}

// AwaitOpen describes the ONE_TO_ONE unit (and its one interaction) that an
// attempt opens.
type AwaitOpen struct {
	ExecutionID       uuid.UUID
	ApplicationID     uuid.UUID
	Attempt           int
	Step              string // StepAdapter for the adapter-accepted path
	Capability        string
	Transport         string
	Timeout           time.Duration // the interaction's deadline is now() + Timeout
	Request           []byte
	ContentType       string
	ExternalReference string
}

// ensureUnitTx creates the unit and its interaction unless they exist
// (ON CONFLICT DO NOTHING on the deterministic ids) and returns their ids.
func ensureUnitTx(ctx context.Context, tx pgx.Tx, o AwaitOpen) (unitID, interactionID uuid.UUID, err error) {
	unitID = AwaitUnitID(o.ExecutionID, o.Attempt, o.Step)
	interactionID = InteractionID(unitID, 0)
	if o.Request == nil {
		o.Request = []byte{}
	}
	_, err = tx.Exec(ctx, `
INSERT INTO await_units (id, execution_id, application_id, attempt, step, cardinality, transport, deadline)
VALUES ($1, $2, $3, $4, $5, 'ONE_TO_ONE', $6, now() + make_interval(secs => $7))
ON CONFLICT (id) DO NOTHING`, unitID, o.ExecutionID, o.ApplicationID, o.Attempt, o.Step, o.Transport, o.Timeout.Seconds())
	if err != nil {
		return uuid.Nil, uuid.Nil, fmt.Errorf("open await unit: %w", err)
	}
	_, err = tx.Exec(ctx, `
INSERT INTO interactions (id, await_unit_id, execution_id, application_id, capability, seq, idempotency_key,
                          correlation_id, transport, request, content_type, external_reference, deadline, next_dispatch_at)
VALUES ($1, $2, $3, $4, $5, 0, $6, $7, $8, $9, $10, $11, now() + make_interval(secs => $12),
        CASE WHEN $8 = 'interaction-api' THEN NULL ELSE now() END)
ON CONFLICT (id) DO NOTHING`, interactionID, unitID, o.ExecutionID, o.ApplicationID, o.Capability,
		unitID.String()+"/0", interactionID.String(), o.Transport, o.Request, o.ContentType,
		nullable(o.ExternalReference), o.Timeout.Seconds())
	if err != nil {
		return uuid.Nil, uuid.Nil, fmt.Errorf("open interaction: %w", err)
	}
	return unitID, interactionID, nil
}

// cancelOpenAwaitsTx cancels the non-terminal units and interactions of an
// execution that settled (keepSteps false) or moved to another attempt
// (keepSteps true: the units of release steps belong to the execution and
// the next attempt adopts them with their interactions). Guard: status not
// terminal; zero rows means there was nothing open.
func cancelOpenAwaitsTx(ctx context.Context, tx pgx.Tx, executionID uuid.UUID, keepSteps bool) error {
	if _, err := tx.Exec(ctx, `
UPDATE interactions i SET status = 'CANCELLED', version = i.version + 1, updated_at = now(), claim_token = NULL
  FROM await_units u
 WHERE u.id = i.await_unit_id AND i.execution_id = $1 AND i.status IN ('WAITING', 'DISPATCHING', 'DISPATCHED')
   AND NOT ($2 AND u.release_step)`, executionID, keepSteps); err != nil {
		return fmt.Errorf("cancel interactions: %w", err)
	}
	if _, err := tx.Exec(ctx, `
UPDATE await_units SET status = 'CANCELLED', version = version + 1, updated_at = now()
 WHERE execution_id = $1 AND status = 'WAITING' AND NOT ($2 AND release_step)`, executionID, keepSteps); err != nil {
		return fmt.Errorf("cancel await units: %w", err)
	}
	return nil
}

// lockedExecution is the part of an execution row read under FOR UPDATE.
type lockedExecution struct {
	status         execution.Status
	mode           execution.Mode
	applicationID  uuid.UUID
	attempt        int
	leaseToken     uuid.UUID
	leaseExpiresAt time.Time
	version        int64
	awaitUnitID    uuid.UUID
	now            time.Time
}

func lockExecutionTx(ctx context.Context, tx pgx.Tx, id uuid.UUID) (lockedExecution, error) {
	var (
		l            lockedExecution
		status, mode string
		token, unit  *uuid.UUID
		leaseExpires *time.Time
	)
	err := tx.QueryRow(ctx, `
SELECT status, mode, application_id, attempt, lease_token, lease_expires_at, version, await_unit_id, now()
  FROM executions WHERE id = $1 FOR UPDATE`, id).
		Scan(&status, &mode, &l.applicationID, &l.attempt, &token, &leaseExpires, &l.version, &unit, &l.now)
	if err != nil {
		return l, fmt.Errorf("lock execution %s: %w", id, err)
	}
	l.status, l.mode = execution.Status(status), execution.Mode(mode)
	if token != nil {
		l.leaseToken = *token
	}
	if unit != nil {
		l.awaitUnitID = *unit
	}
	if leaseExpires != nil {
		l.leaseExpiresAt = *leaseExpires
	}
	return l, nil
}

// interactionRow is an interaction read under FOR UPDATE.
type interactionRow struct {
	id, unitID, executionID, applicationID uuid.UUID
	capability, status                     string
	unitAttempt, seq                       int
	releaseStep                            bool
	deadline                               time.Time
	version                                int64
	completionHash                         []byte
	outcome                                execution.Outcome
}

func lockInteractionTx(ctx context.Context, tx pgx.Tx, id uuid.UUID) (interactionRow, error) {
	return lockInteractionRowsTx(ctx, tx, id, "i, u")
}

// lockItemTx locks an item interaction of a release step's unit without
// its unit, so the completions of one unit's items are admitted in
// parallel; the unit's status is not touched by item admission.
func lockItemTx(ctx context.Context, tx pgx.Tx, id uuid.UUID) (interactionRow, error) {
	return lockInteractionRowsTx(ctx, tx, id, "i")
}

func lockInteractionRowsTx(ctx context.Context, tx pgx.Tx, id uuid.UUID, of string) (interactionRow, error) {
	var (
		r                            interactionRow
		resultType, fClass, fMessage *string
		result                       []byte
		retryable                    bool
	)
	err := tx.QueryRow(ctx, `
SELECT i.id, i.await_unit_id, i.execution_id, i.application_id, i.capability, i.status, u.attempt, i.deadline,
       i.version, i.completion_hash, i.result, i.result_content_type, i.failure_class, i.failure_message,
       i.failure_retryable, i.seq, u.release_step
  FROM interactions i JOIN await_units u ON u.id = i.await_unit_id
 WHERE i.id = $1 FOR UPDATE OF `+of, id).
		Scan(&r.id, &r.unitID, &r.executionID, &r.applicationID, &r.capability, &r.status, &r.unitAttempt,
			&r.deadline, &r.version, &r.completionHash, &result, &resultType, &fClass, &fMessage, &retryable,
			&r.seq, &r.releaseStep)
	if err != nil {
		return r, fmt.Errorf("lock interaction %s: %w", id, err)
	}
	if r.status == InteractionCompleted {
		r.outcome = execution.Outcome{Succeeded: true, Output: result, OutputType: deref(resultType)}
	} else if fClass != nil {
		r.outcome = execution.Outcome{Failure: execution.Failure{Class: *fClass, Message: deref(fMessage), Retryable: retryable}}
	}
	return r, nil
}

// outcomeHash identifies an identical completion, for duplicates.
func outcomeHash(o execution.Outcome) []byte {
	h := sha256.New()
	if o.Succeeded {
		h.Write([]byte("result\x00" + o.OutputType + "\x00"))
		h.Write(o.Output)
	} else {
		f := o.Failure.Bounded()
		h.Write([]byte("failure\x00" + f.Class + "\x00" + f.Message + "\x00" + strconv.FormatBool(f.Retryable)))
	}
	return h.Sum(nil)
}

// applyCompletionTx turns an admitted completion into the execution's next
// state: SUCCEEDED, FAILED, or (retryable failure) the next attempt.
func applyCompletionTx(ctx context.Context, tx pgx.Tx, id uuid.UUID, l lockedExecution, o execution.Outcome, policy execution.Policy) (execution.Execution, error) {
	fence := Fence{Version: l.version, Attempt: l.attempt}
	switch {
	case o.Succeeded:
		return settleTx(ctx, tx, SettleParams{ExecutionID: id, Fence: fence, Status: execution.StatusSucceeded,
			Output: o.Output, OutputType: o.OutputType, AttemptOutcome: "SUCCEEDED"})
	case !o.Failure.Retryable:
		f := o.Failure
		return settleTx(ctx, tx, SettleParams{ExecutionID: id, Fence: fence, Status: execution.StatusFailed,
			Failure: &f, AttemptOutcome: "FAILED", AttemptFailure: &f})
	}
	res, err := retryTx(ctx, tx, RetryParams{ExecutionID: id, Fence: Fence{Attempt: l.attempt, LeaseToken: l.leaseToken},
		Failure: o.Failure, Policy: policy, skipHeld: true})
	return res.Execution, err
}

// heldCompletionTx returns the completion recorded for attempt `attempt`
// before its park (COMPLETED or FAILED interaction of one of its units), or
// nil. The caller holds the execution's row lock.
func heldCompletionTx(ctx context.Context, tx pgx.Tx, executionID uuid.UUID, attempt int) (*execution.Outcome, error) {
	var id uuid.UUID
	err := tx.QueryRow(ctx, `
SELECT i.id FROM interactions i JOIN await_units u ON u.id = i.await_unit_id
 WHERE u.execution_id = $1 AND u.attempt = $2 AND NOT u.release_step AND i.status IN ('COMPLETED', 'FAILED')
 ORDER BY i.completed_at LIMIT 1`, executionID, attempt).Scan(&id)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("find held completion: %w", err)
	}
	i, err := lockInteractionTx(ctx, tx, id)
	if err != nil {
		return nil, err
	}
	return &i.outcome, nil
}

// ParkParams parks a running attempt on its await unit.
type ParkParams struct {
	AwaitOpen
	LeaseToken uuid.UUID
	// LeaseFor is the callback lease from now: the adapter renews it with
	// RenewLease, or the reaper fails the attempt as lease.expired.
	LeaseFor time.Duration
	// Policy decides a retryable held completion.
	Policy execution.Policy
}

// ParkResult says what AwaitPark did.
type ParkResult struct {
	// Parked: the execution is WAITING_EXTERNAL on UnitID.
	Parked bool
	// Released: a completion recorded before the park was applied at once
	// (the execution settled or moved to its next attempt).
	Released      bool
	UnitID        uuid.UUID
	InteractionID uuid.UUID
	Execution     execution.Execution
}

// AwaitPark opens (or finds) the attempt's await unit and parks the
// execution on it in WAITING_EXTERNAL, in one transaction (SYSTEM §6).
// Fence: status RUNNING AND attempt AND lease token, checked under the row
// lock; a mismatch is execution.ErrLeaseLost and writes nothing. If a
// completion was recorded before the park (completion before park), it is
// released here, once: the execution settles or retries instead of parking.
// A unit already timed out or cancelled fails the execution at once.
func (s *Store) AwaitPark(ctx context.Context, p ParkParams) (ParkResult, error) {
	var res ParkResult
	err := s.withTx(ctx, func(tx pgx.Tx) error {
		l, err := lockExecutionTx(ctx, tx, p.ExecutionID)
		if err != nil {
			return err
		}
		if l.status != execution.StatusRunning || l.attempt != p.Attempt || l.leaseToken != p.LeaseToken {
			return fmt.Errorf("park %s attempt %d: %w", p.ExecutionID, p.Attempt, execution.ErrLeaseLost)
		}
		res.UnitID, res.InteractionID, err = ensureUnitTx(ctx, tx, p.AwaitOpen)
		if err != nil {
			return err
		}
		if p.ExternalReference != "" {
			// A completion held before the park opened the interaction
			// without the adapter's reference: fill it in. Guard: only when
			// none is stored; zero rows means it was already there.
			if _, err := tx.Exec(ctx, `
UPDATE interactions SET external_reference = $2, updated_at = now() WHERE id = $1 AND external_reference IS NULL`,
				res.InteractionID, p.ExternalReference); err != nil {
				return fmt.Errorf("store external reference: %w", err)
			}
		}
		i, err := lockInteractionTx(ctx, tx, res.InteractionID)
		if err != nil {
			return err
		}
		switch i.status {
		case InteractionCompleted, InteractionFailed:
			res.Released = true
			res.Execution, err = applyCompletionTx(ctx, tx, p.ExecutionID, l, i.outcome, p.Policy)
			return err
		case InteractionTimedOut, InteractionCancelled:
			res.Released = true
			f := execution.Failure{Class: ClassAwaitTimedOut, Message: "the await unit ended before the execution parked"}
			if i.status == InteractionCancelled {
				f.Class = ClassAwaitCancelled
			}
			res.Execution, err = settleTx(ctx, tx, SettleParams{ExecutionID: p.ExecutionID,
				Fence: Fence{Version: l.version, Attempt: l.attempt}, Status: execution.StatusFailed,
				Failure: &f, AttemptOutcome: "FAILED", AttemptFailure: &f})
			return err
		}
		res.Execution, err = scanExecution(tx.QueryRow(ctx, `
UPDATE executions
   SET status = 'WAITING_EXTERNAL', await_unit_id = $3, lease_expires_at = now() + make_interval(secs => $4),
       version = version + 1, updated_at = now()
 WHERE id = $1 AND version = $2 AND status = 'RUNNING'
RETURNING `+executionColumns, p.ExecutionID, l.version, res.UnitID, p.LeaseFor.Seconds()))
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("park %s: %w", p.ExecutionID, execution.ErrConflict) // unreachable under the lock
		}
		if err != nil {
			return fmt.Errorf("park: %w", err)
		}
		res.Parked = true
		return nil
	})
	return res, err
}

// CompleteParams admits one completion (SYSTEM §6, admission).
type CompleteParams struct {
	// InteractionID resolves the interaction (interaction-api, resume
	// tokens); or Open, for adapter callbacks, resolves the attempt's unit
	// and creates it when the completion arrives before the park.
	InteractionID uuid.UUID
	Open          *AwaitOpen
	// Fence, when set, must match the execution's attempt and lease token
	// (the callback token's binding).
	Fence *Fence
	// ApplicationID, when set, must own the interaction.
	ApplicationID uuid.UUID
	// Capabilities, when set, must include the interaction's capability (the
	// adapter's authorisation).
	Capabilities map[string]bool
	Outcome      execution.Outcome
	Policy       execution.Policy
	// PolicyFor, when set, gives the policy by the interaction's capability
	// and takes precedence over Policy.
	PolicyFor func(capability string) execution.Policy
}

// CompleteResult says what CompleteInteraction did.
type CompleteResult struct {
	// Duplicate: an identical completion was already admitted; nothing changed.
	Duplicate bool
	// Held: recorded before the execution parked; the park releases it.
	Held bool
	// Item: the interaction is an item of a release step; the completion
	// was recorded and signalled to the step's live session.
	Item              bool
	InteractionID     uuid.UUID
	InteractionStatus string
	Execution         execution.Execution
}

// CompleteInteraction admits a completion, first writer wins: under row
// locks (execution, then unit and interaction) it checks ownership and
// applicability, records the outcome on the interaction and its unit, and
// applies it to the parked execution — all in one transaction. An identical
// repeat returns the stored result (Duplicate). Refusals write nothing but
// a row in completion_refusals: execution.ErrPermissionDenied (another
// application or capability), execution.ErrLeaseLost (the attempt was
// superseded or its lease expired), execution.ErrCompletionRefused
// (already terminal with another outcome, past the deadline, or SYNC),
// execution.ErrNotFound.
func (s *Store) CompleteInteraction(ctx context.Context, p CompleteParams) (CompleteResult, error) {
	var res CompleteResult
	err := s.withTx(ctx, func(tx pgx.Tx) error {
		var execID uuid.UUID
		if p.Open != nil {
			execID = p.Open.ExecutionID
		} else {
			var item bool
			if err := tx.QueryRow(ctx, `
SELECT i.execution_id, u.release_step FROM interactions i JOIN await_units u ON u.id = i.await_unit_id
 WHERE i.id = $1`, p.InteractionID).Scan(&execID, &item); err != nil {
				return fmt.Errorf("interaction %s: %w", p.InteractionID, err)
			}
			if item {
				var err error
				res, err = completeItemTx(ctx, tx, p)
				return err
			}
		}
		l, err := lockExecutionTx(ctx, tx, execID)
		if err != nil {
			return err
		}
		if p.ApplicationID != uuid.Nil && p.ApplicationID != l.applicationID {
			return fmt.Errorf("execution %s belongs to another application: %w", execID, execution.ErrPermissionDenied)
		}
		if l.mode == execution.ModeSync {
			return fmt.Errorf("execution %s is SYNC; only the gateway settles it: %w", execID, execution.ErrCompletionRefused)
		}
		interactionID := p.InteractionID
		if p.Open != nil {
			interactionID = InteractionID(AwaitUnitID(p.Open.ExecutionID, p.Open.Attempt, p.Open.Step), 0)
			var exists bool
			if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM interactions WHERE id = $1)`, interactionID).Scan(&exists); err != nil {
				return fmt.Errorf("find interaction: %w", err)
			}
			if !exists { // completion before park: open the unit, but only for the current attempt
				if p.Fence != nil && (l.attempt != p.Fence.Attempt || l.leaseToken != p.Fence.LeaseToken) {
					return fmt.Errorf("attempt %d of %s was superseded or settled: %w", p.Open.Attempt, execID, execution.ErrLeaseLost)
				}
				if l.attempt != p.Open.Attempt || l.status != execution.StatusRunning {
					return fmt.Errorf("attempt %d of %s is not running: %w", p.Open.Attempt, execID, execution.ErrLeaseLost)
				}
				if _, _, err = ensureUnitTx(ctx, tx, *p.Open); err != nil {
					return err
				}
			}
		}
		i, err := lockInteractionTx(ctx, tx, interactionID)
		if err != nil {
			return err
		}
		res.InteractionID, res.InteractionStatus = i.id, i.status
		if p.PolicyFor != nil {
			p.Policy = p.PolicyFor(i.capability)
		}
		if p.Capabilities != nil && !p.Capabilities[i.capability] {
			return fmt.Errorf("capability %q is not served by this adapter: %w", i.capability, execution.ErrPermissionDenied)
		}
		hash := outcomeHash(p.Outcome)
		if isTerminalInteraction(i.status) {
			if string(i.completionHash) == string(hash) {
				res.Duplicate = true
				res.Execution, err = scanExecution(tx.QueryRow(ctx, `SELECT `+executionColumns+` FROM executions WHERE id = $1`, execID))
				return err
			}
			return fmt.Errorf("interaction %s is already %s: %w", i.id, i.status, execution.ErrCompletionRefused)
		}
		if p.Fence != nil && (l.attempt != p.Fence.Attempt || l.leaseToken != p.Fence.LeaseToken) {
			return fmt.Errorf("attempt %d of %s was superseded or settled: %w", p.Fence.Attempt, execID, execution.ErrLeaseLost)
		}
		if l.attempt != i.unitAttempt || l.status.Terminal() {
			return fmt.Errorf("interaction %s belongs to a superseded attempt: %w", i.id, execution.ErrLeaseLost)
		}
		if !l.now.Before(i.deadline) {
			return fmt.Errorf("interaction %s is past its deadline: %w", i.id, execution.ErrCompletionRefused)
		}
		if l.status == execution.StatusWaitingExternal && !l.leaseExpiresAt.IsZero() && !l.now.Before(l.leaseExpiresAt) {
			return fmt.Errorf("the lease of %s expired: %w", execID, execution.ErrLeaseLost)
		}
		status, err := recordOutcomeTx(ctx, tx, i, p.Outcome, hash)
		if err != nil {
			return err
		}
		unitStatus := UnitCompleted
		if status == InteractionFailed {
			unitStatus = UnitFailed
		}
		if _, err := tx.Exec(ctx, `
UPDATE await_units SET status = $2, version = version + 1, updated_at = now() WHERE id = $1 AND status = 'WAITING'`,
			i.unitID, unitStatus); err != nil {
			return fmt.Errorf("complete await unit: %w", err)
		}
		res.InteractionStatus = status
		if l.status == execution.StatusWaitingExternal && l.awaitUnitID == i.unitID {
			res.Execution, err = applyCompletionTx(ctx, tx, execID, l, p.Outcome, p.Policy)
			return err
		}
		// Not parked yet: held until AwaitPark commits and releases it.
		res.Held = true
		res.Execution, err = scanExecution(tx.QueryRow(ctx, `SELECT `+executionColumns+` FROM executions WHERE id = $1`, execID))
		return err
	})
	if err != nil && !errors.Is(err, execution.ErrUnavailable) && !errors.Is(err, execution.ErrConflict) {
		s.countRefusal(ctx, p.InteractionID, err)
	}
	return res, err
}

// completeItemTx admits the completion of an item of a release step's unit
// (SYSTEM §6, live session): it records the outcome on the interaction
// only — the unit and the execution are the session's — and notifies
// ItemsChannel so that the live session feeding the next step wakes up.
// The execution row is not locked: a settlement cancels the item under its
// own row lock, so the two serialise on the interaction. Refusals as in
// CompleteInteraction; a retryable failure is recorded like any other (the
// item's row shows it).
func completeItemTx(ctx context.Context, tx pgx.Tx, p CompleteParams) (CompleteResult, error) {
	var res CompleteResult
	i, err := lockItemTx(ctx, tx, p.InteractionID)
	if err != nil {
		return res, err
	}
	res.InteractionID, res.InteractionStatus, res.Item = i.id, i.status, true
	if p.ApplicationID != uuid.Nil && p.ApplicationID != i.applicationID {
		return res, fmt.Errorf("interaction %s belongs to another application: %w", i.id, execution.ErrPermissionDenied)
	}
	if p.Capabilities != nil && !p.Capabilities[i.capability] {
		return res, fmt.Errorf("capability %q is not served by this adapter: %w", i.capability, execution.ErrPermissionDenied)
	}
	hash := outcomeHash(p.Outcome)
	if isTerminalInteraction(i.status) {
		if string(i.completionHash) != string(hash) {
			return res, fmt.Errorf("interaction %s is already %s: %w", i.id, i.status, execution.ErrCompletionRefused)
		}
		res.Duplicate = true
	} else {
		var now time.Time
		if err := tx.QueryRow(ctx, `SELECT now()`).Scan(&now); err != nil {
			return res, fmt.Errorf("read the clock: %w", err)
		}
		if !now.Before(i.deadline) {
			return res, fmt.Errorf("interaction %s is past its deadline: %w", i.id, execution.ErrCompletionRefused)
		}
		if res.InteractionStatus, err = recordOutcomeTx(ctx, tx, i, p.Outcome, hash); err != nil {
			return res, err
		}
		if _, err := tx.Exec(ctx, `SELECT pg_notify($1, $2)`, ItemsChannel, i.unitID.String()); err != nil {
			return res, fmt.Errorf("notify the live session: %w", err)
		}
	}
	res.Execution, err = scanExecution(tx.QueryRow(ctx, `SELECT `+executionColumns+` FROM executions WHERE id = $1`, i.executionID))
	return res, err
}

// recordOutcomeTx writes an admitted outcome on a locked, non-terminal
// interaction and returns its new status. Guard: version and status not
// terminal; zero rows is execution.ErrConflict (unreachable under the lock).
func recordOutcomeTx(ctx context.Context, tx pgx.Tx, i interactionRow, o execution.Outcome, hash []byte) (string, error) {
	status := InteractionCompleted
	var result []byte
	var resultType, fClass, fMessage *string
	retryable := false
	if o.Succeeded {
		result, resultType = o.Output, nullable(o.OutputType)
		if result == nil {
			result = []byte{}
		}
	} else {
		f := o.Failure.Bounded()
		status, fClass, fMessage, retryable = InteractionFailed, &f.Class, &f.Message, f.Retryable
	}
	tag, err := tx.Exec(ctx, `
UPDATE interactions
   SET status = $3, result = $4, result_content_type = $5, failure_class = $6, failure_message = $7,
       failure_retryable = $8, completion_hash = $9, completed_at = now(), claim_token = NULL,
       version = version + 1, updated_at = now()
 WHERE id = $1 AND version = $2 AND status IN ('WAITING', 'DISPATCHING', 'DISPATCHED')`,
		i.id, i.version, status, result, resultType, fClass, fMessage, retryable, hash)
	if err != nil {
		return "", fmt.Errorf("admit completion: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return "", fmt.Errorf("interaction %s changed meanwhile: %w", i.id, execution.ErrConflict)
	}
	return status, nil
}

// countRefusal records a refused completion so that late and foreign
// completions are visible; its own failure is only logged.
func (s *Store) countRefusal(ctx context.Context, interactionID uuid.UUID, reason error) {
	var id *uuid.UUID
	if interactionID != uuid.Nil {
		id = &interactionID
	}
	msg := reason.Error()
	if len(msg) > 512 {
		msg = msg[:512]
	}
	if _, err := s.pool.Exec(context.WithoutCancel(ctx), `INSERT INTO completion_refusals (interaction_id, reason) VALUES ($1, $2)`, id, msg); err != nil {
		s.logger.Warn("could not count a refused completion", "error", err)
	}
}

// AwaitSweepDeadlines times out up to limit non-terminal interactions whose
// deadline passed (database clock): the interaction and its unit become
// TIMED_OUT and a parked execution settles FAILED / await.timed_out — each
// in its own transaction, under the same locks as admission, so a racing
// completion and the timeout leave exactly one terminal status. It returns
// how many it timed out.
func (s *Store) AwaitSweepDeadlines(ctx context.Context, limit int) (int, error) {
	rows, err := s.pool.Query(ctx, `
SELECT id, execution_id FROM interactions
 WHERE status IN ('WAITING', 'DISPATCHING', 'DISPATCHED') AND deadline < now()
 ORDER BY deadline LIMIT $1`, limit)
	if err != nil {
		return 0, translate(fmt.Errorf("list expired interactions: %w", err))
	}
	type pair struct{ interaction, execution uuid.UUID }
	due, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (pair, error) {
		var p pair
		err := r.Scan(&p.interaction, &p.execution)
		return p, err
	})
	if err != nil {
		return 0, translate(err)
	}
	n := 0
	for _, d := range due {
		err := s.withTx(ctx, func(tx pgx.Tx) error {
			l, err := lockExecutionTx(ctx, tx, d.execution)
			if err != nil {
				return err
			}
			i, err := lockInteractionTx(ctx, tx, d.interaction)
			if err != nil {
				return err
			}
			if isTerminalInteraction(i.status) || l.now.Before(i.deadline) {
				return nil // completed or moved meanwhile
			}
			if i.releaseStep {
				// An item times out alone: its row says so, and the live
				// session is woken instead of waiting for a completion that
				// would now be refused.
				if _, err := tx.Exec(ctx, `
UPDATE interactions SET status = 'TIMED_OUT', failure_class = $3, failure_message = $4, version = version + 1,
       updated_at = now(), claim_token = NULL
 WHERE id = $1 AND version = $2`, i.id, i.version, ClassAwaitTimedOut, "the item's deadline passed before it completed"); err != nil {
					return err
				}
				n++
				_, err := tx.Exec(ctx, `SELECT pg_notify($1, $2)`, ItemsChannel, i.unitID.String())
				return err
			}
			if _, err := tx.Exec(ctx, `
UPDATE interactions SET status = 'TIMED_OUT', version = version + 1, updated_at = now(), claim_token = NULL
 WHERE id = $1 AND version = $2`, i.id, i.version); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `
UPDATE await_units SET status = 'TIMED_OUT', version = version + 1, updated_at = now() WHERE id = $1 AND status = 'WAITING'`,
				i.unitID); err != nil {
				return err
			}
			n++
			if l.status == execution.StatusWaitingExternal && l.awaitUnitID == i.unitID {
				f := execution.Failure{Class: ClassAwaitTimedOut, Message: "the interaction's deadline passed before it completed"}
				_, err = settleTx(ctx, tx, SettleParams{ExecutionID: d.execution, Fence: Fence{Version: l.version, Attempt: l.attempt},
					Status: execution.StatusFailed, Failure: &f, AttemptOutcome: "FAILED", AttemptFailure: &f})
			}
			return err
		})
		if err != nil {
			// One bad row must not stop the sweep of the others.
			s.logger.Warn("timing out an interaction failed; the next sweep retries", "interaction_id", d.interaction, "error", err)
			if errors.Is(err, execution.ErrUnavailable) {
				return n, err
			}
		}
	}
	return n, nil
}

// ExecutionProgress stores the adapter's progress report. Guard: attempt,
// lease token and status RUNNING or WAITING_EXTERNAL; zero rows is
// execution.ErrLeaseLost.
func (s *Store) ExecutionProgress(ctx context.Context, id uuid.UUID, attempt int, token uuid.UUID, percent int, msg string) error {
	tag, err := s.pool.Exec(ctx, `
UPDATE executions SET progress_percent = $4, progress_message = $5, version = version + 1, updated_at = now()
 WHERE id = $1 AND attempt = $2 AND lease_token = $3 AND status IN ('RUNNING', 'WAITING_EXTERNAL')`,
		id, attempt, token, percent, msg)
	if err != nil {
		return translate(fmt.Errorf("report progress: %w", err))
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("progress of %s attempt %d: %w", id, attempt, execution.ErrLeaseLost)
	}
	return nil
}

// Interaction is an interaction as listed for the interaction-api transport.
type Interaction struct {
	ID                uuid.UUID
	CorrelationID     string
	ExecutionID       uuid.UUID
	ApplicationID     uuid.UUID
	Capability        string
	Status            string
	Transport         string
	Request           []byte
	ContentType       string
	ExternalReference string
	Deadline          time.Time
	CreatedAt         time.Time
}

// InteractionListPending returns up to limit non-terminal interactions of a
// capability ordered by (deadline, id), after the cursor (zero values: from
// the start).
func (s *Store) InteractionListPending(ctx context.Context, capability string, afterDeadline time.Time, afterID uuid.UUID, limit int) ([]Interaction, error) {
	rows, err := s.pool.Query(ctx, `
SELECT id, correlation_id, execution_id, application_id, capability, status, transport, request, content_type,
       external_reference, deadline, created_at
  FROM interactions
 WHERE capability = $1 AND status IN ('WAITING', 'DISPATCHING', 'DISPATCHED')
   AND (deadline, id) > ($2, $3)
 ORDER BY deadline, id LIMIT $4`, capability, afterDeadline, afterID, limit)
	if err != nil {
		return nil, translate(fmt.Errorf("list pending interactions: %w", err))
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Interaction, error) {
		var i Interaction
		var ref *string
		err := r.Scan(&i.ID, &i.CorrelationID, &i.ExecutionID, &i.ApplicationID, &i.Capability, &i.Status, &i.Transport,
			&i.Request, &i.ContentType, &ref, &i.Deadline, &i.CreatedAt)
		i.ExternalReference = deref(ref)
		return i, err
	})
	return out, translate(err)
}

// AwaitUnit is an await unit as shown with its execution.
type AwaitUnit struct {
	ID        uuid.UUID
	Transport string
	Status    string
	Deadline  time.Time
}

// AwaitUnitGet returns one await unit.
func (s *Store) AwaitUnitGet(ctx context.Context, id uuid.UUID) (AwaitUnit, error) {
	var u AwaitUnit
	err := s.pool.QueryRow(ctx, `SELECT id, transport, status, deadline FROM await_units WHERE id = $1`, id).
		Scan(&u.ID, &u.Transport, &u.Status, &u.Deadline)
	if err != nil {
		return u, translate(fmt.Errorf("await unit %s: %w", id, err))
	}
	return u, nil
}
