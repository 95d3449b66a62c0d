package pgstore_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
)

func stepOpen(t *testing.T, b bundle, e execution.Execution) pgstore.StepUnit {
	t.Helper()
	u, err := b.store.StepOpen(context.Background(), pgstore.StepOpenParams{ExecutionID: e.ID, ApplicationID: e.ApplicationID,
		Attempt: e.Attempt, LeaseToken: e.LeaseToken, Step: "steps.await", Cardinality: "ONE_TO_ONE",
		Transport: pgstore.TransportKafka, LeaseFor: time.Minute})
	require.NoError(t, err)
	return u
}

func itemsOpen(t *testing.T, b bundle, e execution.Execution, u pgstore.StepUnit, claim uuid.UUID, claimFor, timeout time.Duration, seqs ...int) []pgstore.ItemState {
	t.Helper()
	reqs := make([]pgstore.ItemRequest, len(seqs))
	for k, s := range seqs {
		reqs[k] = pgstore.ItemRequest{Seq: s, Request: []byte(fmt.Sprintf(`{"row":%d}`, s)), ContentType: "application/json"}
	}
	st, err := b.store.ItemsOpen(context.Background(), pgstore.ItemsOpenParams{Unit: u, ExecutionID: e.ID,
		ApplicationID: e.ApplicationID, Attempt: e.Attempt, LeaseToken: e.LeaseToken, Capability: e.Capability, Transport: pgstore.TransportKafka, Items: reqs,
		Timeout: timeout, ClaimToken: claim, ClaimFor: claimFor})
	require.NoError(t, err)
	require.Len(t, st, len(seqs))
	return st
}

func completeItem(b bundle, id uuid.UUID, o execution.Outcome) (pgstore.CompleteResult, error) {
	return b.store.CompleteInteraction(context.Background(), pgstore.CompleteParams{InteractionID: id,
		ApplicationID: b.app.ID, Outcome: o, Policy: execution.DefaultPolicy()})
}

// TestStepUnitSpansAttempts: the items of a release step survive a retry.
// Completions are admitted whatever the parent's state — while it runs,
// while it waits for its next attempt (completion before the park) — a
// duplicate changes nothing, a conflicting one is refused; the next
// attempt adopts the unit, gets completed items back with their outcomes,
// and is asked to send only the items never sent. An item completion is
// never taken for the attempt's own outcome.
func TestStepUnitSpansAttempts(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	e := startAttempt(t, b)

	_, err := b.store.StepOpen(ctx, pgstore.StepOpenParams{ExecutionID: e.ID, ApplicationID: e.ApplicationID,
		Attempt: e.Attempt, LeaseToken: uuid.New(), Step: "steps.await", Cardinality: "ONE_TO_ONE",
		Transport: pgstore.TransportKafka, LeaseFor: time.Minute})
	require.ErrorIs(t, err, execution.ErrLeaseLost, "another lease token cannot open the step")

	u := stepOpen(t, b, e)
	require.False(t, u.Adopted)
	require.Equal(t, pgstore.StepUnitID(e.ID, "steps.await"), u.ID)
	got, err := b.store.ExecutionGet(ctx, uuid.Nil, e.ID)
	require.NoError(t, err)
	require.Equal(t, execution.StatusWaitingExternal, got.Status)
	require.Equal(t, u.ID, got.AwaitUnitID)

	claim := uuid.New()
	first := itemsOpen(t, b, e, u, claim, time.Minute, time.Hour, 0, 1, 2, 3)
	for k, st := range first {
		require.True(t, st.Send, "new item %d is claimed for sending", k)
		require.Equal(t, pgstore.InteractionDispatching, st.Status)
		require.Nil(t, st.Outcome)
	}
	again := itemsOpen(t, b, e, u, uuid.New(), time.Minute, time.Hour, 0, 1, 2, 3)
	for _, st := range again {
		require.False(t, st.Send, "an item under a live claim is not sent by another session")
		require.Equal(t, first[st.Seq].InteractionID, st.InteractionID, "one interaction per item")
	}
	require.NoError(t, b.store.ItemsSent(ctx, []uuid.UUID{first[0].InteractionID, first[1].InteractionID, first[2].InteractionID}, claim))

	// Item 0 completes while the session runs; repeats are duplicates.
	res, err := completeItem(b, first[0].InteractionID, success(`{"n":0}`))
	require.NoError(t, err)
	require.True(t, res.Item)
	require.False(t, res.Duplicate)
	require.Equal(t, execution.StatusWaitingExternal, res.Execution.Status, "an item does not settle its execution")
	res, err = completeItem(b, first[0].InteractionID, success(`{"n":0}`))
	require.NoError(t, err)
	require.True(t, res.Duplicate)
	_, err = completeItem(b, first[0].InteractionID, success(`{"n":"other"}`))
	require.ErrorIs(t, err, execution.ErrCompletionRefused)
	other, err := b.store.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: "app-b", APIKey: "key-b"})
	require.NoError(t, err)
	_, err = b.store.CompleteInteraction(ctx, pgstore.CompleteParams{InteractionID: first[1].InteractionID,
		ApplicationID: other.ID, Outcome: success(`{}`)})
	require.ErrorIs(t, err, execution.ErrPermissionDenied)

	// The session dies; the reaper's retry keeps the unit and its items.
	rr, err := b.store.AttemptRetry(ctx, pgstore.RetryParams{ExecutionID: e.ID,
		Fence: pgstore.Fence{Attempt: 1, LeaseToken: e.LeaseToken}, Failure: execution.Failure{Class: "lease.expired", Retryable: true},
		Policy: execution.DefaultPolicy(), AttemptOutcome: "LEASE_EXPIRED"})
	require.NoError(t, err)
	require.False(t, rr.Released, "a completed item is not the attempt's outcome")
	require.Equal(t, execution.StatusRetryScheduled, rr.Execution.Status)
	require.Zero(t, count(t, b.url, `SELECT count(*) FROM interactions WHERE status = 'CANCELLED'`))

	// Item 1 completes before the next attempt parks; item 2 fails.
	res, err = completeItem(b, first[1].InteractionID, success(`{"n":1}`))
	require.NoError(t, err)
	require.Equal(t, execution.StatusRetryScheduled, res.Execution.Status)
	_, err = completeItem(b, first[2].InteractionID, execution.Outcome{Failure: execution.Failure{Class: "payment.declined", Message: "too much"}})
	require.NoError(t, err)

	e2, err := b.store.AttemptStart(ctx, pgstore.AttemptStartParams{ExecutionID: e.ID, Attempt: 2, Owner: "w2", LeaseFor: time.Minute})
	require.NoError(t, err)
	u2 := stepOpen(t, b, e2)
	require.True(t, u2.Adopted)
	require.Equal(t, u.ID, u2.ID)
	require.Equal(t, 1, u2.Attempt, "resume tokens stay bound to the opening attempt")

	// Item 3 was claimed but never sent; its claim is still live (a dead
	// session's claim expires before anyone sends it again).
	replay := itemsOpen(t, b, e2, u2, uuid.New(), time.Minute, time.Hour, 0, 1, 2, 3, 4)
	require.Equal(t, `{"n":0}`, string(replay[0].Outcome.Output))
	require.Equal(t, `{"n":1}`, string(replay[1].Outcome.Output))
	require.Equal(t, "payment.declined", replay[2].Outcome.Failure.Class)
	for _, st := range replay[:4] {
		require.False(t, st.Send, "item %d was sent before: never again", st.Seq)
	}
	require.True(t, replay[4].Send, "a new item is sent")
	require.Equal(t, 5, count(t, b.url, `SELECT count(*) FROM interactions`))

	// Once the dead session's claim expired, its half-sent item is claimed
	// by the live session and sent again — same interaction.
	require.Equal(t, 1, count(t, b.url, `UPDATE interactions SET claimed_until = now() - interval '1 second' WHERE seq = 3 RETURNING 1`))
	resend := itemsOpen(t, b, e2, u2, uuid.New(), time.Minute, time.Hour, 3)
	require.True(t, resend[0].Send)
	require.Equal(t, first[3].InteractionID, resend[0].InteractionID)

	terminal, err := b.store.ItemsTerminal(ctx, u2.ID, []int32{0, 1, 2, 3, 4})
	require.NoError(t, err)
	require.Len(t, terminal, 3)

	settled, err := b.store.StepSettle(ctx, pgstore.StepSettleParams{UnitID: u2.ID, ItemCount: 5,
		SettleParams: pgstore.SettleParams{ExecutionID: e.ID, Fence: pgstore.Fence{Attempt: 2, LeaseToken: e2.LeaseToken},
			Status: execution.StatusSucceeded, Output: []byte(`{}`), AttemptOutcome: "SUCCEEDED"}})
	require.NoError(t, err)
	require.Equal(t, execution.StatusSucceeded, settled.Status)
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM await_units WHERE status = 'COMPLETED' AND item_count = 5`))
	require.Equal(t, 2, count(t, b.url, `SELECT count(*) FROM interactions WHERE status = 'CANCELLED'`),
		"the settlement cancels what is still open")
	_, err = b.store.ItemsOpen(ctx, pgstore.ItemsOpenParams{Unit: u2, ExecutionID: e.ID, ApplicationID: e.ApplicationID,
		Attempt: 2, LeaseToken: e2.LeaseToken, Capability: e.Capability, Transport: pgstore.TransportKafka,
		ClaimToken: uuid.New(), ClaimFor: time.Minute, Items: []pgstore.ItemRequest{{Seq: 9, Request: []byte(`{}`)}}})
	require.ErrorIs(t, err, execution.ErrLeaseLost, "a session that missed the settlement opens nothing more")
	require.Equal(t, 5, count(t, b.url, `SELECT count(*) FROM interactions`))
	_, err = completeItem(b, first[3].InteractionID, success(`{"late":true}`))
	require.ErrorIs(t, err, execution.ErrCompletionRefused, "after the settlement an item completion is late")
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM completion_events`))
}

// TestItemTimeoutWakesTheSession: an item past its deadline times out
// alone — its unit stays open, its execution keeps waiting — and the
// timeout is announced on ItemsChannel like a completion.
func TestItemTimeoutWakesTheSession(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e := startAttempt(t, b)
	u := stepOpen(t, b, e)

	woken := make(chan uuid.UUID, 16)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = b.store.ListenItems(ctx, func(id uuid.UUID) { woken <- id })
	}()
	require.Equal(t, uuid.Nil, <-woken, "the listener announces that it (re)connected")

	st := itemsOpen(t, b, e, u, uuid.New(), time.Minute, time.Millisecond, 0)
	require.Eventually(t, func() bool {
		n, err := b.store.AwaitSweepDeadlines(ctx, 10)
		require.NoError(t, err)
		return n == 1
	}, 5*time.Second, 10*time.Millisecond)
	select {
	case id := <-woken:
		require.Equal(t, u.ID, id)
	case <-time.After(5 * time.Second):
		t.Fatal("the timeout was not announced")
	}
	terminal, err := b.store.ItemsTerminal(ctx, u.ID, []int32{0})
	require.NoError(t, err)
	require.Len(t, terminal, 1)
	require.Equal(t, st[0].InteractionID, terminal[0].InteractionID)
	require.Equal(t, pgstore.InteractionTimedOut, terminal[0].Status)
	require.Equal(t, pgstore.ClassAwaitTimedOut, terminal[0].Outcome.Failure.Class)
	got, err := b.store.ExecutionGet(ctx, uuid.Nil, e.ID)
	require.NoError(t, err)
	require.Equal(t, execution.StatusWaitingExternal, got.Status, "one item's timeout does not fail the execution")
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM await_units WHERE status = 'WAITING'`))
	cancel()
	<-done
}

// waitLockWaiters waits until n sessions of the test's database wait on a
// lock.
func waitLockWaiters(t *testing.T, b bundle, n int) {
	t.Helper()
	require.Eventually(t, func() bool {
		return count(t, b.url, `SELECT count(*) FROM pg_stat_activity
 WHERE datname = current_database() AND wait_event_type = 'Lock'`) >= n
	}, 10*time.Second, 5*time.Millisecond)
}

// TestStepSettleRacesCancellation: a session settling while the execution
// is cancelled — the cancellation waiting on an item's row lock, the
// session's settlement on the cancellation — ends with the cancellation
// alone and no deadlock: StepSettle takes the execution's row lock before
// the unit's, as every other path does.
func TestStepSettleRacesCancellation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	e := startAttempt(t, b)
	u := stepOpen(t, b, e)
	st := itemsOpen(t, b, e, u, uuid.New(), time.Minute, time.Hour, 0, 1)
	got, err := b.store.ExecutionGet(ctx, uuid.Nil, e.ID)
	require.NoError(t, err)

	// An admission in progress holds item 1's row lock.
	conn, err := pgx.Connect(ctx, b.url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	tx, err := conn.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SELECT 1 FROM interactions WHERE id = $1 FOR UPDATE`, st[1].InteractionID)
	require.NoError(t, err)

	cancelled := make(chan error, 1)
	go func() {
		_, err := b.store.ExecutionSettle(ctx, pgstore.SettleParams{ExecutionID: e.ID,
			Fence:  pgstore.Fence{Version: got.Version, Attempt: got.Attempt},
			Status: execution.StatusCancelled, Failure: &execution.Failure{Class: "execution.cancelled"}})
		cancelled <- err
	}()
	waitLockWaiters(t, b, 1) // the cancellation holds the execution, waits for the item
	settled := make(chan error, 1)
	go func() {
		f := execution.Failure{Class: "source.invalid", Message: "bad row"}
		_, err := b.store.StepSettle(ctx, pgstore.StepSettleParams{UnitID: u.ID, ItemCount: 2, SettleParams: pgstore.SettleParams{
			ExecutionID: e.ID, Fence: pgstore.Fence{Attempt: e.Attempt, LeaseToken: e.LeaseToken}, Status: execution.StatusFailed,
			Failure: &f, AttemptOutcome: "FAILED", AttemptFailure: &f}})
		settled <- err
	}()
	waitLockWaiters(t, b, 2) // the session's settlement waits for the execution
	require.NoError(t, tx.Commit(ctx))
	require.NoError(t, <-cancelled)
	require.ErrorIs(t, <-settled, execution.ErrConflict, "the cancellation won; the session's settlement wrote nothing")
	got, err = b.store.ExecutionGet(ctx, uuid.Nil, e.ID)
	require.NoError(t, err)
	require.Equal(t, execution.StatusCancelled, got.Status)
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM await_units WHERE status = 'CANCELLED'`))
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM completion_events`))
}

// TestIdleInTransactionTimeout: the store's sessions carry a server-side
// limit on idling inside a transaction, so a stopped process cannot hold
// row locks (and with them every lease renewal behind them) indefinitely.
func TestIdleInTransactionTimeout(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var v string
	require.NoError(t, b.store.QueryRowForTest(context.Background(), `SHOW idle_in_transaction_session_timeout`).Scan(&v))
	require.Equal(t, pgstore.DefaultIdleInTransactionTimeout, v)
}

// TestApplicationNames: an application's name is its object-store prefix,
// so one that could nest under another's ("a/b") or escape ("..") is
// refused, naming the field.
func TestApplicationNames(t *testing.T) {
	t.Parallel()
	for name, ok := range map[string]bool{
		"csv-payments-demo": true, "a": true, "App_2.v1": true, "e2e-failures": true,
		"": false, "..": false, ".hidden": false, "-x": false, "a/b": false, "csv-payments-demo/tenant2": false,
		"café": false, "a b": false, strings.Repeat("x", 129): false,
	} {
		err := pgstore.ValidateApplicationName(name)
		if ok {
			require.NoError(t, err, name)
			continue
		}
		var inv *execution.InvalidArgumentError
		require.ErrorAs(t, err, &inv, name)
		require.Equal(t, "name", inv.Field)
	}
	b := setup(t)
	_, err := b.store.ApplicationUpsert(context.Background(), pgstore.ApplicationUpsertParams{Name: "app-a/tenant2", APIKey: "k2"})
	var inv *execution.InvalidArgumentError
	require.ErrorAs(t, err, &inv)
}
