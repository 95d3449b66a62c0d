package gateway

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/capstan-dev/capstan/internal/adapterclient"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
)

// executeSync runs attempt 1 of a SYNC execution inside the call (SYSTEM
// §7): it calls the adapter within the caller's deadline and the release's
// attempt timeout, then settles, fenced by the attempt's lease token, with
// the completion event in the same transaction. SYNC releases are not
// retried: a retryable failure settles FAILED with its class. If the
// settlement loses (the execution was cancelled meanwhile) or cannot be
// written, it returns the execution as stored; an unwritten settlement is
// finished by the reaper when the lease expires.
func (s *ExecutionService) executeSync(ctx context.Context, e execution.Execution, adapter string, policy execution.Policy) (execution.Execution, error) {
	callCtx, cancel := context.WithTimeout(ctx, policy.AttemptTimeout)
	defer cancel()
	deadline, _ := callCtx.Deadline()
	resp, err := s.adapters.Execute(callCtx, adapter, &adapterv1.ExecuteRequest{
		ExecutionId: e.ID.String(), Attempt: int32(e.Attempt), Capability: e.Capability, Release: e.Release,
		Input: e.Input, ContentType: e.ContentType, ApplicationId: e.ApplicationID.String(),
		Deadline: timestamppb.New(deadline),
	})
	out := adapterclient.Classify(resp, err)
	if out.Accepted {
		out = execution.Outcome{Failure: execution.Failure{Class: execution.ClassAdapterProtocol,
			Message: "the adapter answered accepted to a SYNC release, which cannot complete later"}}
	}
	p := pgstore.SettleParams{ExecutionID: e.ID, Fence: pgstore.Fence{Attempt: e.Attempt, LeaseToken: e.LeaseToken}}
	if out.Succeeded {
		p.Status, p.Output, p.OutputType, p.AttemptOutcome = execution.StatusSucceeded, out.Output, out.OutputType, "SUCCEEDED"
	} else {
		f := out.Failure
		p.Status, p.Failure, p.AttemptOutcome, p.AttemptFailure = execution.StatusFailed, &f, "FAILED", &f
	}
	// Settle even if the caller went away: the adapter may have acted.
	sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer scancel()
	settled, err := s.store.ExecutionSettle(sctx, p)
	if err == nil {
		return settled, nil
	}
	if !errors.Is(err, execution.ErrConflict) {
		// The caller learns the outcome is not recorded (UNAVAILABLE) and
		// may retry with its idempotency key; the reaper settles the
		// execution FAILED / lease.expired after the lease.
		s.logger.Warn("sync settlement not written; the reaper settles it after the lease", "execution_id", e.ID, "error", err)
		return e, fmt.Errorf("%w: the outcome of execution %s could not be recorded: %w", execution.ErrUnavailable, e.ID, err)
	}
	s.logger.Info("sync settlement lost: the execution moved on meanwhile", "execution_id", e.ID)
	return s.store.ExecutionGet(sctx, e.ApplicationID, e.ID)
}
