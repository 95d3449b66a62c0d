package steps

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"log/slog"
	"time"

	"github.com/google/uuid"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/objectstore"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
)

// Failure classes of releases with steps.
const (
	// ClassInputInvalid: the execution's input or source object is not
	// usable (not retryable).
	ClassInputInvalid = "input.invalid"
	// ClassSourceInvalid: a source item is malformed (not retryable).
	ClassSourceInvalid = "source.invalid"
	// ClassSourceUnavailable: the source could not be read (retryable).
	ClassSourceUnavailable = "source.unavailable"
	// ClassTooManyItems: a collecting cardinality's input, or a list
	// result, exceeds await.max_items (not retryable).
	ClassTooManyItems = "limits.too_many_items"
	// ClassPublishFailed: the output object could not be published
	// (retryable: the next attempt replays and publishes again).
	ClassPublishFailed = "publish.failed"
	// ClassInvalidResult: a list cardinality's completion is not a JSON
	// array (not retryable).
	ClassInvalidResult = "await.invalid_result"
	// ClassMapUnavailable: the map adapter kept failing transiently
	// (retryable).
	ClassMapUnavailable = "map.unavailable"
	// ClassShutdown: the consumer running the session shut down; the next
	// attempt replays, and this one does not count towards max_attempts.
	ClassShutdown = "consumer.shutdown"
)

// releaseTimeout bounds the write that hands an interrupted session's
// execution to its next attempt.
const releaseTimeout = 5 * time.Second

// Sender sends claimed item interactions over a pushed transport
// (consumer.InteractionSender). It returns one error per interaction.
type Sender interface {
	SendBatch(ctx context.Context, a *config.AwaitStep, ds []pgstore.InteractionDispatch) []error
}

// Mapper calls a map adapter (adapterclient.Pool).
type Mapper interface {
	Execute(ctx context.Context, addr string, req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error)
}

// Runner runs the attempts of releases with steps. It is safe for
// concurrent use; each Run is one live session.
type Runner struct {
	store   *pgstore.Store
	objects objectstore.Store
	sender  Sender
	mapper  Mapper
	hub     *Hub
	logger  *slog.Logger
	m       metrics
	// Poll is how often a waiting session re-reads its items when no
	// notification arrives (a missed notification costs at most this).
	Poll time.Duration
	// SendRetry is when the background sender retries a failed send.
	SendRetry time.Duration
	// ClaimFor is how long a session's claim on items it sends lasts; a
	// dead session's half-sent items are sent again after it.
	ClaimFor time.Duration
}

// NewRunner returns a runner. sender may be nil when no release uses a
// pushed transport, mapper when none has a map step.
func NewRunner(store *pgstore.Store, objects objectstore.Store, sender Sender, mapper Mapper, hub *Hub, logger *slog.Logger) *Runner {
	return &Runner{store: store, objects: objects, sender: sender, mapper: mapper, hub: hub, logger: logger, m: noopMetrics(),
		Poll: time.Second, SendRetry: time.Second, ClaimFor: 30 * time.Second}
}

// Result is how a Run ended.
type Result int

// Results of Run.
const (
	// Succeeded: the output was published and the execution settled
	// SUCCEEDED.
	Succeeded Result = iota + 1
	// Failed: the execution settled FAILED (or TIMED_OUT past its budget).
	Failed
	// Retried: a retryable failure scheduled the next attempt.
	Retried
	// Lost: the lease was lost (expired, cancelled or superseded); nothing
	// was written.
	Lost
	// Interrupted: ctx ended; the attempt is left to its lease and the next
	// attempt replays.
	Interrupted
)

// Summary is the output of a succeeded execution (JSON), and what a session
// did.
type Summary struct {
	// Object is the published output's key; Format csv or jsonl.
	Object      string `json:"object"`
	Format      string `json:"format"`
	Cardinality string `json:"cardinality"`
	// Items is the number of source items; Rows the number of output rows.
	Items     int `json:"items"`
	Rows      int `json:"rows"`
	Succeeded int `json:"succeeded"`
	Failed    int `json:"failed"`
	// Bytes and SHA256 describe the published object.
	Bytes  int64  `json:"bytes"`
	SHA256 string `json:"sha256"`
	// Window is the configured window; MaxInFlight the most items that were
	// open and not yet consumed at once in the last attempt (≤ Window).
	Window      int `json:"window"`
	MaxInFlight int `json:"max_in_flight"`
	// Sent counts the items the last attempt sent; Replayed the items it
	// fed from completions stored before it started.
	Sent     int `json:"sent"`
	Replayed int `json:"replayed"`
	// FailureClass is the class of the failure that ended the session
	// (Failed, Retried); not part of the output.
	FailureClass string `json:"-"`
}

// stepFailure is a failure that ends the session: settled FAILED, or the
// next attempt when Retryable.
type stepFailure struct{ f execution.Failure }

func (e *stepFailure) Error() string { return e.f.Class + ": " + e.f.Message }

func fail(class string, retryable bool, format string, args ...any) error {
	return &stepFailure{execution.Failure{Class: class, Message: fmt.Sprintf(format, args...), Retryable: retryable}}
}

// stepName is the step name of a release's await unit.
const stepName = "steps.await"

// Run runs one attempt of a release with steps for e, which the caller
// started (RUNNING under e.LeaseToken), and writes its outcome: a
// settlement, the next attempt, or nothing when the lease was lost or ctx
// ended.
func (r *Runner) Run(ctx context.Context, e execution.Execution, cp config.Capability) (Result, Summary) {
	log := r.logger.With("execution_id", e.ID, "attempt", e.Attempt)
	policy := cp.Policy()
	fence := pgstore.Fence{Attempt: e.Attempt, LeaseToken: e.LeaseToken}
	in, err := ParseInput(e.Input)
	if err != nil {
		return r.settleFailed(ctx, log, e, fence, uuid.Nil, 0, execution.Failure{Class: ClassInputInvalid, Message: err.Error()}),
			Summary{FailureClass: ClassInputInvalid}
	}
	a := cp.Steps.Await
	var unit pgstore.StepUnit
	err = pgstore.Retry(ctx, log, func() error {
		var err error
		unit, err = r.store.StepOpen(ctx, pgstore.StepOpenParams{ExecutionID: e.ID, ApplicationID: e.ApplicationID,
			Attempt: e.Attempt, LeaseToken: e.LeaseToken, Step: stepName, Cardinality: a.Cardinality,
			Transport: a.Transport, LeaseFor: policy.LeaseDuration})
		return err
	})
	switch {
	case errors.Is(err, execution.ErrLeaseLost), errors.Is(err, execution.ErrConflict):
		return Lost, Summary{}
	case err != nil:
		return Interrupted, Summary{}
	}
	log = log.With("await_unit_id", unit.ID)
	if unit.Adopted {
		log.Info("adopted the step unit of an earlier attempt; replaying", "opened_by_attempt", unit.Attempt)
	}

	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	lost := make(chan struct{})
	hbDone := make(chan struct{})
	go func() {
		defer close(hbDone)
		r.store.LeaseKeep(sctx, log, e.ID, e.Attempt, e.LeaseToken, policy.LeaseDuration, func() { close(lost); cancel() })
	}()
	s := &session{r: r, e: e, cp: cp, a: a, in: in, unit: unit, log: log}
	sum, runErr := s.run(sctx)
	cancel()
	<-hbDone
	select {
	case <-lost:
		log.Info("session lost its lease; the next attempt replays")
		return Lost, sum
	default:
	}
	if ctx.Err() != nil {
		// The consumer is shutting down: hand the file to the next attempt
		// now, without using up an attempt; if even that cannot be written,
		// the lease expires and the reaper does it (as lease.expired).
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
		defer cancel()
		_, err := r.store.AttemptRetry(rctx, pgstore.RetryParams{ExecutionID: e.ID, Fence: fence, Policy: policy, Free: true,
			Failure: execution.Failure{Class: ClassShutdown, Message: "the consumer running the session shut down", Retryable: true}})
		if err != nil {
			log.Info("session interrupted; left to its lease, the next attempt replays", "error", err)
		} else {
			log.Info("session interrupted by shutdown; handed to the next attempt, which replays")
		}
		return Interrupted, sum
	}
	var sf *stepFailure
	switch {
	case runErr == nil:
		out, _ := json.Marshal(sum)
		return r.settle(ctx, log, e, unit.ID, sum.Items, pgstore.SettleParams{ExecutionID: e.ID, Fence: fence,
			Status: execution.StatusSucceeded, Output: out, OutputType: "application/json", AttemptOutcome: "SUCCEEDED"}), sum
	case errors.As(runErr, &sf) && sf.f.Retryable:
		sum.FailureClass = sf.f.Class
		log.Warn("step failed; retrying", "class", sf.f.Class, "error", sf.f.Message)
		return r.retry(ctx, log, e, fence, sf.f, policy), sum
	case errors.As(runErr, &sf):
		sum.FailureClass = sf.f.Class
		return r.settleFailed(ctx, log, e, fence, unit.ID, sum.Items, sf.f), sum
	case errors.Is(runErr, execution.ErrLeaseLost), errors.Is(runErr, execution.ErrConflict):
		return Lost, sum
	default:
		// A store error that Retry gave up on (shutdown) or an unexpected
		// one: leave the attempt to its lease.
		log.Warn("session ended without an outcome; left to its lease", "error", runErr)
		return Interrupted, sum
	}
}

func (r *Runner) settle(ctx context.Context, log *slog.Logger, e execution.Execution, unitID uuid.UUID, items int, p pgstore.SettleParams) Result {
	err := pgstore.Retry(ctx, log, func() error {
		var err error
		if unitID == uuid.Nil {
			_, err = r.store.ExecutionSettle(ctx, p)
		} else {
			_, err = r.store.StepSettle(ctx, pgstore.StepSettleParams{SettleParams: p, UnitID: unitID, ItemCount: items})
		}
		return err
	})
	switch {
	case errors.Is(err, execution.ErrConflict), errors.Is(err, execution.ErrLeaseLost):
		log.Info("settlement lost: the execution moved on meanwhile")
		return Lost
	case err != nil:
		log.Warn("settlement not written before shutdown; the lease will expire", "error", err)
		return Interrupted
	case p.Status == execution.StatusSucceeded:
		return Succeeded
	}
	return Failed
}

func (r *Runner) settleFailed(ctx context.Context, log *slog.Logger, e execution.Execution, fence pgstore.Fence, unitID uuid.UUID, items int, f execution.Failure) Result {
	log.Info("step failed", "class", f.Class, "error", f.Message)
	return r.settle(ctx, log, e, unitID, items, pgstore.SettleParams{ExecutionID: e.ID, Fence: fence,
		Status: execution.StatusFailed, Failure: &f, AttemptOutcome: "FAILED", AttemptFailure: &f})
}

func (r *Runner) retry(ctx context.Context, log *slog.Logger, e execution.Execution, fence pgstore.Fence, f execution.Failure, policy execution.Policy) Result {
	var res pgstore.RetryResult
	err := pgstore.Retry(ctx, log, func() error {
		var err error
		res, err = r.store.AttemptRetry(ctx, pgstore.RetryParams{ExecutionID: e.ID, Fence: fence, Failure: f, Policy: policy})
		return err
	})
	switch {
	case errors.Is(err, execution.ErrLeaseLost), errors.Is(err, execution.ErrConflict):
		return Lost
	case err != nil:
		return Interrupted
	case res.Decision == execution.RetrySchedule:
		return Retried
	}
	return Failed
}

// countingWriter counts and hashes what goes through it.
type countingWriter struct {
	w io.Writer
	n int64
	h hash.Hash
}

func newCountingWriter(w io.Writer) *countingWriter {
	return &countingWriter{w: w, h: sha256.New()}
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	c.h.Write(p[:n])
	return n, err
}

func (c *countingWriter) sum() string { return hex.EncodeToString(c.h.Sum(nil)) }
