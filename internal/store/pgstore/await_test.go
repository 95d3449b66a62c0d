package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
)

func openFor(e execution.Execution, timeout time.Duration) pgstore.AwaitOpen {
	return pgstore.AwaitOpen{ExecutionID: e.ID, ApplicationID: e.ApplicationID, Attempt: e.Attempt, Step: pgstore.StepAdapter,
		Capability: e.Capability, Transport: pgstore.TransportInteractionAPI, Timeout: timeout, Request: e.Input,
		ContentType: e.ContentType}
}

func park(t *testing.T, b bundle, e execution.Execution, timeout time.Duration) pgstore.ParkResult {
	t.Helper()
	res, err := b.store.AwaitPark(context.Background(), pgstore.ParkParams{AwaitOpen: openFor(e, timeout),
		LeaseToken: e.LeaseToken, LeaseFor: time.Minute, Policy: execution.DefaultPolicy()})
	require.NoError(t, err)
	return res
}

func success(body string) execution.Outcome {
	return execution.Outcome{Succeeded: true, Output: []byte(body), OutputType: "application/json"}
}

func TestAwaitParkThenComplete(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	e := startAttempt(t, b)
	res := park(t, b, e, time.Hour)
	require.True(t, res.Parked)
	require.Equal(t, execution.StatusWaitingExternal, res.Execution.Status)
	require.Equal(t, res.UnitID, res.Execution.AwaitUnitID)
	require.Empty(t, res.Execution.Output, "the execution row holds no response payload")

	got, err := b.store.CompleteInteraction(ctx, pgstore.CompleteParams{InteractionID: res.InteractionID,
		ApplicationID: b.app.ID, Outcome: success(`{"ref":1}`), Policy: execution.DefaultPolicy()})
	require.NoError(t, err)
	require.False(t, got.Duplicate)
	require.Equal(t, execution.StatusSucceeded, got.Execution.Status)
	require.Equal(t, `{"ref":1}`, string(got.Execution.Output))
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM completion_events`))
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM await_units WHERE status = 'COMPLETED'`))

	again, err := b.store.CompleteInteraction(ctx, pgstore.CompleteParams{InteractionID: res.InteractionID,
		ApplicationID: b.app.ID, Outcome: success(`{"ref":1}`), Policy: execution.DefaultPolicy()})
	require.NoError(t, err)
	require.True(t, again.Duplicate, "an identical repeat returns the stored result")
	require.Equal(t, execution.StatusSucceeded, again.Execution.Status)
	_, err = b.store.CompleteInteraction(ctx, pgstore.CompleteParams{InteractionID: res.InteractionID,
		ApplicationID: b.app.ID, Outcome: success(`{"ref":2}`), Policy: execution.DefaultPolicy()})
	require.ErrorIs(t, err, execution.ErrCompletionRefused, "a different completion after the first is late")
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM completion_refusals`), "refusals are counted")
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM completion_events`))
}

func TestAwaitCompletionBeforePark(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	e := startAttempt(t, b)
	open := openFor(e, time.Hour)
	fence := pgstore.Fence{Attempt: e.Attempt, LeaseToken: e.LeaseToken}
	held, err := b.store.CompleteInteraction(ctx, pgstore.CompleteParams{Open: &open, Fence: &fence,
		ApplicationID: b.app.ID, Outcome: success(`{"early":true}`), Policy: execution.DefaultPolicy()})
	require.NoError(t, err)
	require.True(t, held.Held)
	require.Equal(t, execution.StatusRunning, held.Execution.Status, "held, not applied, until the park commits")
	require.Zero(t, count(t, b.url, `SELECT count(*) FROM completion_events`))

	res := park(t, b, e, time.Hour)
	require.False(t, res.Parked)
	require.True(t, res.Released)
	require.Equal(t, execution.StatusSucceeded, res.Execution.Status)
	require.Equal(t, `{"early":true}`, string(res.Execution.Output))

	_, err = b.store.AwaitPark(ctx, pgstore.ParkParams{AwaitOpen: open, LeaseToken: e.LeaseToken, LeaseFor: time.Minute,
		Policy: execution.DefaultPolicy()})
	require.ErrorIs(t, err, execution.ErrLeaseLost, "released once: a second park finds the execution settled")
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM completion_events`))
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM interactions`), "one interaction, not two")
}

func TestAwaitRefusals(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	other, err := b.store.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: "app-b", APIKey: "key-b"})
	require.NoError(t, err)
	e := startAttempt(t, b)
	res := park(t, b, e, time.Hour)
	open := openFor(e, time.Hour)
	tests := []struct {
		name string
		p    pgstore.CompleteParams
		err  error
	}{
		{"another application", pgstore.CompleteParams{InteractionID: res.InteractionID, ApplicationID: other.ID}, execution.ErrPermissionDenied},
		{"a capability the adapter does not serve", pgstore.CompleteParams{InteractionID: res.InteractionID,
			Capabilities: map[string]bool{"payments.refund": true}}, execution.ErrPermissionDenied},
		{"superseded lease token", pgstore.CompleteParams{Open: &open, Fence: &pgstore.Fence{Attempt: 1, LeaseToken: uuid.New()}}, execution.ErrLeaseLost},
		{"an attempt that is not the current one", pgstore.CompleteParams{Open: &pgstore.AwaitOpen{ExecutionID: e.ID,
			ApplicationID: e.ApplicationID, Attempt: 2, Step: pgstore.StepAdapter, Capability: e.Capability,
			Transport: pgstore.TransportInteractionAPI, Timeout: time.Hour}}, execution.ErrLeaseLost},
		{"unknown interaction", pgstore.CompleteParams{InteractionID: uuid.New()}, execution.ErrNotFound},
	}
	for _, tc := range tests {
		tc.p.Outcome, tc.p.Policy = success(`{}`), execution.DefaultPolicy()
		_, err := b.store.CompleteInteraction(ctx, tc.p)
		require.ErrorIs(t, err, tc.err, tc.name)
	}
	got, err := b.store.ExecutionGet(ctx, uuid.Nil, e.ID)
	require.NoError(t, err)
	require.Equal(t, execution.StatusWaitingExternal, got.Status, "refusals change nothing")
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM interactions`), "a refused completion opens no unit")
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM interactions WHERE status = 'WAITING'`))
}

func TestAwaitConflictingCompletionsRace(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	e := startAttempt(t, b)
	res := park(t, b, e, time.Hour)
	const n = 8
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = b.store.CompleteInteraction(ctx, pgstore.CompleteParams{InteractionID: res.InteractionID,
				Outcome: success(fmt.Sprintf(`{"writer":%d}`, i)), Policy: execution.DefaultPolicy()})
		}()
	}
	wg.Wait()
	won := 0
	for _, err := range errs {
		if err == nil {
			won++
		} else {
			require.ErrorIs(t, err, execution.ErrCompletionRefused)
		}
	}
	require.Equal(t, 1, won, "first writer wins")
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM completion_events`))
}

func TestAwaitCompletionRacesTimeout(t *testing.T) {
	t.Parallel()
	for i := range 6 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			ctx := context.Background()
			e := startAttempt(t, b)
			res := park(t, b, e, 300*time.Millisecond)
			time.Sleep(time.Duration(250+i*20) * time.Millisecond) // around the deadline, on purpose
			var wg sync.WaitGroup
			var completeErr, sweepErr error
			wg.Add(2)
			go func() {
				defer wg.Done()
				_, completeErr = b.store.CompleteInteraction(ctx, pgstore.CompleteParams{InteractionID: res.InteractionID,
					Outcome: success(`{}`), Policy: execution.DefaultPolicy()})
			}()
			go func() {
				defer wg.Done()
				require.Eventually(t, func() bool {
					var n int
					n, sweepErr = b.store.AwaitSweepDeadlines(ctx, 10)
					return sweepErr != nil || n > 0 || count(t, b.url, `SELECT count(*) FROM interactions WHERE status = 'COMPLETED'`) == 1
				}, 5*time.Second, 20*time.Millisecond)
			}()
			wg.Wait()
			require.NoError(t, sweepErr)
			got, err := b.store.ExecutionGet(ctx, uuid.Nil, e.ID)
			require.NoError(t, err)
			switch {
			case completeErr == nil:
				require.Equal(t, execution.StatusSucceeded, got.Status)
				require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM interactions WHERE status = 'COMPLETED'`))
			default:
				require.True(t, errors.Is(completeErr, execution.ErrCompletionRefused), "late completion: %v", completeErr)
				require.Equal(t, execution.StatusFailed, got.Status)
				require.Equal(t, pgstore.ClassAwaitTimedOut, got.Failure.Class)
				require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM interactions WHERE status = 'TIMED_OUT'`))
			}
			require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM completion_events`))
		})
	}
}

func TestAwaitParkOnTimedOutUnitFails(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	e := startAttempt(t, b)
	open := openFor(e, time.Millisecond)
	require.NoError(t, b.store.EnsureUnitForTest(ctx, open))
	require.Eventually(t, func() bool {
		n, err := b.store.AwaitSweepDeadlines(ctx, 10)
		require.NoError(t, err)
		return n == 1
	}, 5*time.Second, 10*time.Millisecond)
	res, err := b.store.AwaitPark(ctx, pgstore.ParkParams{AwaitOpen: open, LeaseToken: e.LeaseToken, LeaseFor: time.Minute,
		Policy: execution.DefaultPolicy()})
	require.NoError(t, err)
	require.True(t, res.Released)
	require.Equal(t, execution.StatusFailed, res.Execution.Status, "parking on a timed-out unit fails at once")
	require.Equal(t, pgstore.ClassAwaitTimedOut, res.Execution.Failure.Class)
}

func TestAwaitRetryableFailureAndCancel(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	e := startAttempt(t, b)
	res := park(t, b, e, time.Hour)
	got, err := b.store.CompleteInteraction(ctx, pgstore.CompleteParams{InteractionID: res.InteractionID,
		Outcome: execution.Outcome{Failure: execution.Failure{Class: "provider.busy", Retryable: true}},
		Policy:  execution.DefaultPolicy()})
	require.NoError(t, err)
	require.Equal(t, execution.StatusRetryScheduled, got.Execution.Status)
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM dispatch_records WHERE attempt = 2`))

	// Attempt 2 parks again; cancelling the execution cancels its pending interaction.
	e2, err := b.store.AttemptStart(ctx, pgstore.AttemptStartParams{ExecutionID: e.ID, Attempt: 2, Owner: "w", LeaseFor: time.Minute})
	require.NoError(t, err)
	res2 := park(t, b, e2, time.Hour)
	require.NotEqual(t, res.UnitID, res2.UnitID, "each attempt has its own unit")
	_, err = b.store.ExecutionSettle(ctx, pgstore.SettleParams{ExecutionID: e.ID, Fence: pgstore.Fence{Version: res2.Execution.Version},
		Status: execution.StatusCancelled, Failure: &execution.Failure{Class: "execution.cancelled", Reason: execution.ReasonByCaller}})
	require.NoError(t, err)
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM interactions WHERE status = 'CANCELLED'`))
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM await_units WHERE status = 'CANCELLED'`))
	_, err = b.store.CompleteInteraction(ctx, pgstore.CompleteParams{InteractionID: res2.InteractionID,
		Outcome: success(`{}`), Policy: execution.DefaultPolicy()})
	require.ErrorIs(t, err, execution.ErrCompletionRefused)
}

func TestInteractionClaimDispatchClaimsParkedInteraction(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	e := startAttempt(t, b)
	o := openFor(e, time.Hour)
	o.Step, o.Transport = "await", pgstore.TransportWebhook
	res, err := b.store.AwaitPark(ctx, pgstore.ParkParams{AwaitOpen: o, LeaseToken: e.LeaseToken, LeaseFor: time.Hour,
		Policy: execution.DefaultPolicy()})
	require.NoError(t, err)
	batch, err := b.store.InteractionClaimDispatch(ctx, 10, time.Minute)
	require.NoError(t, err) // was: column reference "version" is ambiguous
	require.Len(t, batch, 1)
	require.Equal(t, res.InteractionID, batch[0].ID)
	require.Equal(t, pgstore.InteractionDispatching, batch[0].Status)
	again, err := b.store.InteractionClaimDispatch(ctx, 10, time.Minute)
	require.NoError(t, err)
	require.Empty(t, again, "a live claim is not claimed twice")
	require.NoError(t, b.store.InteractionDispatched(ctx, batch[0].ID, batch[0].ClaimToken, true, 0))
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM interactions WHERE status = 'DISPATCHED'`))
	_, err = b.store.CompleteInteraction(ctx, pgstore.CompleteParams{InteractionID: res.InteractionID, Outcome: success(`{}`),
		Policy: execution.DefaultPolicy()})
	require.NoError(t, err)
	after, err := b.store.InteractionClaimDispatch(ctx, 10, 0)
	require.NoError(t, err)
	require.Empty(t, after, "a completed interaction is never sent again")
}

// TestRetryAppliesHeldCompletion: the adapter completed through its callback
// during Execute, then the attempt failed before parking (Execute errored,
// or its worker died and the reaper retried it): the held completion is the
// attempt's outcome, not a reason to run the adapter again.
func TestRetryAppliesHeldCompletion(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	e := startAttempt(t, b)
	open := openFor(e, time.Hour)
	fence := pgstore.Fence{Attempt: e.Attempt, LeaseToken: e.LeaseToken}
	held, err := b.store.CompleteInteraction(ctx, pgstore.CompleteParams{Open: &open, Fence: &fence,
		Outcome: success(`{"done":1}`), Policy: execution.DefaultPolicy()})
	require.NoError(t, err)
	require.True(t, held.Held)
	res, err := b.store.AttemptRetry(ctx, pgstore.RetryParams{ExecutionID: e.ID, Fence: fence,
		Failure: execution.Failure{Class: execution.ClassAdapterUnavailable, Retryable: true}, Policy: execution.DefaultPolicy()})
	require.NoError(t, err)
	require.True(t, res.Released)
	require.Equal(t, execution.StatusSucceeded, res.Execution.Status)
	require.Equal(t, `{"done":1}`, string(res.Execution.Output))
	require.Zero(t, count(t, b.url, `SELECT count(*) FROM dispatch_records WHERE attempt = 2`), "no second run of the adapter")
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM completion_events`))
}

// TestExpiredLeaseCannotBeRenewedAndRenewedLeaseIsNotReaped covers both
// sides of the reaper race.
func TestExpiredLeaseCannotBeRenewedAndRenewedLeaseIsNotReaped(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	e, _, err := b.store.ExecutionInsert(ctx, insertParams(b.app.ID, "", `{}`))
	require.NoError(t, err)
	e, err = b.store.AttemptStart(ctx, pgstore.AttemptStartParams{ExecutionID: e.ID, Attempt: 1, Owner: "w", LeaseFor: 5 * time.Second})
	require.NoError(t, err)
	reap := pgstore.RetryParams{ExecutionID: e.ID, Fence: pgstore.Fence{Attempt: 1, LeaseToken: e.LeaseToken},
		Failure: execution.Failure{Class: execution.ClassLeaseExpired, Retryable: true}, Policy: execution.DefaultPolicy(),
		AttemptOutcome: "LEASE_EXPIRED", RequireExpired: true}
	_, err = b.store.AttemptRetry(ctx, reap)
	require.ErrorIs(t, err, execution.ErrLeaseLost, "a live lease is not reaped")
	_, err = b.store.LeaseRenew(ctx, e.ID, 1, e.LeaseToken, time.Minute)
	require.NoError(t, err, "renewed while alive")
	_, err = b.store.AttemptRetry(ctx, reap)
	require.ErrorIs(t, err, execution.ErrLeaseLost, "a lease renewed after the reaper read it is left alone")

	e2, _, err := b.store.ExecutionInsert(ctx, insertParams(b.app.ID, "", `{"b":1}`))
	require.NoError(t, err)
	e2, err = b.store.AttemptStart(ctx, pgstore.AttemptStartParams{ExecutionID: e2.ID, Attempt: 1, Owner: "w", LeaseFor: time.Millisecond})
	require.NoError(t, err)
	require.Eventually(t, func() bool { // expired by the database clock
		l, err := b.store.LeaseExpiredList(ctx, 10)
		require.NoError(t, err)
		for _, x := range l {
			if x.ExecutionID == e2.ID {
				return true
			}
		}
		return false
	}, 5*time.Second, 5*time.Millisecond)
	_, err = b.store.LeaseRenew(ctx, e2.ID, 1, e2.LeaseToken, time.Minute)
	require.ErrorIs(t, err, execution.ErrLeaseLost, "an expired lease cannot be renewed")
}
