package execution

import (
	"time"

	"github.com/google/uuid"
)

// Execution is one invocation of a capability, as stored.
type Execution struct {
	ID             uuid.UUID
	ApplicationID  uuid.UUID
	Capability     string
	Release        string
	Mode           Mode
	Status         Status
	Attempt        int // latest attempt started; 0 before the first
	MaxAttempts    int
	Version        int64
	Input          []byte
	ContentType    string
	IdempotencyKey string // "" when none was given
	LeaseOwner     string
	LeaseToken     uuid.UUID // uuid.Nil when no lease is held
	LeaseExpiresAt time.Time
	BudgetDeadline time.Time
	Output         []byte
	OutputType     string
	Failure        *Failure // set for FAILED, TIMED_OUT, CANCELLED
	CreatedAt      time.Time
	UpdatedAt      time.Time
	SettledAt      time.Time // zero until terminal
	// AwaitUnitID is the await unit the execution is (or was last) parked
	// on; uuid.Nil when it never parked.
	AwaitUnitID uuid.UUID
	// ProgressPercent (0-100) and ProgressMessage are the adapter's last
	// progress report.
	ProgressPercent int
	ProgressMessage string
}

// Outcome is how an attempt ended, as the consumer reports it to the store.
type Outcome struct {
	// Succeeded: Output and OutputType hold the result.
	Succeeded  bool
	Output     []byte
	OutputType string
	// Failure is set when Succeeded and Accepted are false.
	Failure Failure
	// Accepted: the adapter took the work and completes it later through
	// its callback contract; the attempt parks on an await unit.
	Accepted          bool
	ExternalReference string
}

// RetryDecision is what happens after a retryable failure of attempt N.
type RetryDecision int

const (
	// RetrySchedule: attempt N+1 is due after the delay.
	RetrySchedule RetryDecision = iota + 1
	// RetryExhausted: the attempt ceiling is reached; settle FAILED with
	// ReasonAttemptLimit.
	RetryExhausted
	// RetryBudgetExceeded: the next attempt could not start before the
	// budget ends; settle TIMED_OUT with ReasonAsyncBudget.
	RetryBudgetExceeded
)

// DecideRetry decides what follows a retryable failure of attempt `attempt`
// (SYSTEM §4): exhausted when attempt ≥ maxAttempts, budget exceeded when
// the next attempt's due time (now + delay, database clock) is after the
// budget deadline, otherwise schedule.
func DecideRetry(attempt, maxAttempts int, now time.Time, delay time.Duration, budgetDeadline time.Time) RetryDecision {
	if attempt >= maxAttempts {
		return RetryExhausted
	}
	if now.Add(delay).After(budgetDeadline) {
		return RetryBudgetExceeded
	}
	return RetrySchedule
}
