package pgstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
)

// TestTraceContextFollowsTheExecution checks that the trace context stored
// at accept reaches the attempt-1 dispatch record, the retry's and a
// repaired record, and the completion event, and that an execution without
// one reads as "".
func TestTraceContextFollowsTheExecution(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	claim := func() pgstore.DispatchRecord {
		t.Helper()
		recs, token, err := b.store.DispatchClaim(ctx, pgstore.DispatchClaimParams{
			Owner: "t", Limit: 10, ClaimFor: time.Minute, Lookahead: time.Hour})
		require.NoError(t, err)
		require.Len(t, recs, 1)
		_, err = b.store.DispatchDelete(ctx, []uuid.UUID{recs[0].ID}, token)
		require.NoError(t, err)
		return recs[0]
	}

	p := insertParams(b.app.ID, "", `{}`)
	p.TraceContext = tp
	e, _, err := b.store.ExecutionInsert(ctx, p)
	require.NoError(t, err)
	rec := claim()
	require.Equal(t, 1, rec.Attempt)
	require.Equal(t, tp, rec.TraceContext, "attempt 1's dispatch record")

	// A retry's dispatch record.
	started, err := b.store.AttemptStart(ctx, pgstore.AttemptStartParams{ExecutionID: e.ID, Attempt: 1, Owner: "w", LeaseFor: time.Minute})
	require.NoError(t, err)
	policy := execution.DefaultPolicy()
	policy.RetryDelays = []time.Duration{time.Millisecond}
	_, err = b.store.AttemptRetry(ctx, pgstore.RetryParams{ExecutionID: e.ID,
		Fence:   pgstore.Fence{Attempt: 1, LeaseToken: started.LeaseToken},
		Failure: execution.Failure{Class: "provider.unavailable", Retryable: true}, Policy: policy})
	require.NoError(t, err)
	rec = claim()
	require.Equal(t, 2, rec.Attempt)
	require.Equal(t, tp, rec.TraceContext, "the retry's dispatch record")

	// A repaired dispatch record (the claimed one was deleted above).
	n, err := b.store.DispatchRepair(ctx, 0)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	rec = claim()
	require.Equal(t, 2, rec.Attempt)
	require.Equal(t, tp, rec.TraceContext, "the repaired dispatch record")

	// The completion event.
	started, err = b.store.AttemptStart(ctx, pgstore.AttemptStartParams{ExecutionID: e.ID, Attempt: 2, Owner: "w", LeaseFor: time.Minute})
	require.NoError(t, err)
	_, err = b.store.ExecutionSettle(ctx, pgstore.SettleParams{ExecutionID: e.ID,
		Fence: pgstore.Fence{Attempt: 2, LeaseToken: started.LeaseToken}, Status: execution.StatusSucceeded,
		Output: []byte(`{}`), OutputType: "application/json", AttemptOutcome: "SUCCEEDED"})
	require.NoError(t, err)

	// Without a trace context: "" everywhere.
	_, _, err = b.store.ExecutionInsert(ctx, insertParams(b.app.ID, "", `{"b":1}`))
	require.NoError(t, err)
	require.Empty(t, claim().TraceContext)

	evs, err := b.store.EventClaim(ctx, pgstore.EventClaimParams{Owner: "t", Limit: 10, ClaimFor: time.Minute, PerApplication: 10})
	require.NoError(t, err)
	require.Len(t, evs, 1)
	require.Equal(t, e.ID, evs[0].ExecutionID)
	require.Equal(t, tp, evs[0].TraceContext, "the completion event")
}
