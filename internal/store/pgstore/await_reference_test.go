package pgstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
)

// An adapter answers "accepted" with an external reference and completes
// through AdapterCallbackService before the consumer's park commits (the
// "held" path). The gateway's CompleteExecution opens the unit and its
// interaction without the reference (it cannot know it); the park's
// ensureUnitTx then finds the interaction and, ON CONFLICT DO NOTHING,
// drops the reference the adapter returned. Expected: the interaction
// keeps the adapter's external_reference whichever writer opened it.
func TestAwaitExternalReferenceKeptWhenCompletionPrecedesPark(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	e := startAttempt(t, b)
	open := openFor(e, time.Hour) // what CallbackService.CompleteExecution opens: no reference
	fence := pgstore.Fence{Attempt: e.Attempt, LeaseToken: e.LeaseToken}
	held, err := b.store.CompleteInteraction(ctx, pgstore.CompleteParams{Open: &open, Fence: &fence,
		ApplicationID: b.app.ID, Outcome: success(`{"early":true}`), Policy: execution.DefaultPolicy()})
	require.NoError(t, err)
	require.True(t, held.Held)

	parked := openFor(e, time.Hour) // what Consumer.park opens after "accepted"
	parked.ExternalReference = "PR-0123456789ab"
	res, err := b.store.AwaitPark(ctx, pgstore.ParkParams{AwaitOpen: parked, LeaseToken: e.LeaseToken,
		LeaseFor: time.Minute, Policy: execution.DefaultPolicy()})
	require.NoError(t, err)
	require.True(t, res.Released)
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM interactions WHERE external_reference = 'PR-0123456789ab'`),
		"the adapter's external reference is stored on the interaction")
}
