package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/testutil/pgtest"
)

type bundle struct {
	store *pgstore.Store
	url   string
	app   pgstore.Application
}

func setup(t *testing.T) bundle {
	t.Helper()
	ctx := context.Background()
	url := pgtest.NewDatabase(t, migrate)
	st, err := pgstore.Open(ctx, url, nil)
	require.NoError(t, err)
	t.Cleanup(st.Close)
	app, err := st.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: "app-a", APIKey: "key-a"})
	require.NoError(t, err)
	return bundle{store: st, url: url, app: app}
}

func insertParams(app uuid.UUID, key string, input string) pgstore.ExecutionInsertParams {
	return pgstore.ExecutionInsertParams{
		ApplicationID: app, Capability: "payments.send", Release: "v1", Mode: execution.ModeAsync,
		MaxAttempts: 10, Input: []byte(input), ContentType: "application/json", IdempotencyKey: key,
		RequestHash: []byte("hash:" + input), AsyncBudget: time.Hour, Status: execution.StatusQueued,
	}
}

func count(t *testing.T, url, query string, args ...any) int {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), url)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	var n int
	require.NoError(t, conn.QueryRow(context.Background(), query, args...).Scan(&n))
	return n
}

func TestExecutionInsertIdempotency(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()

	first, created, err := b.store.ExecutionInsert(ctx, insertParams(b.app.ID, "k1", `{"a":1}`))
	require.NoError(t, err)
	require.True(t, created)
	require.Equal(t, execution.StatusQueued, first.Status)

	again, created, err := b.store.ExecutionInsert(ctx, insertParams(b.app.ID, "k1", `{"a":1}`))
	require.NoError(t, err)
	require.False(t, created, "same key, same request must not create new work")
	require.Equal(t, first.ID, again.ID)

	_, _, err = b.store.ExecutionInsert(ctx, insertParams(b.app.ID, "k1", `{"a":2}`))
	require.ErrorIs(t, err, execution.ErrIdempotencyConflict)

	// Without a key every call is new work.
	_, created, err = b.store.ExecutionInsert(ctx, insertParams(b.app.ID, "", `{"a":1}`))
	require.NoError(t, err)
	require.True(t, created)

	require.Equal(t, 2, count(t, b.url, `SELECT count(*) FROM executions`))
	require.Equal(t, 2, count(t, b.url, `SELECT count(*) FROM dispatch_records WHERE attempt = 1`))
}

func TestExecutionInsertConcurrentFirstSubmissions(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	const n = 16
	ids := make([]uuid.UUID, n)
	createdCount := 0
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e, created, err := b.store.ExecutionInsert(ctx, insertParams(b.app.ID, "same-key", `{}`))
			require.NoError(t, err)
			mu.Lock()
			ids[i] = e.ID
			if created {
				createdCount++
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	require.Equal(t, 1, createdCount)
	for _, id := range ids {
		require.Equal(t, ids[0], id)
	}
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM executions`))
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM dispatch_records`))
}

func TestExecutionGetTenancy(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	other, err := b.store.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: "app-b", APIKey: "key-b"})
	require.NoError(t, err)
	e, _, err := b.store.ExecutionInsert(ctx, insertParams(b.app.ID, "", `{}`))
	require.NoError(t, err)

	_, err = b.store.ExecutionGet(ctx, b.app.ID, e.ID)
	require.NoError(t, err)
	_, err = b.store.ExecutionGet(ctx, other.ID, e.ID)
	require.ErrorIs(t, err, execution.ErrNotFound, "another application must not see the execution")
	// The same idempotency key in another application is independent.
	_, created, err := b.store.ExecutionInsert(ctx, insertParams(other.ID, "k", `{}`))
	require.NoError(t, err)
	require.True(t, created)
	_, created, err = b.store.ExecutionInsert(ctx, insertParams(b.app.ID, "k", `{"x":1}`))
	require.NoError(t, err)
	require.True(t, created)
}

func TestAttemptStartDuplicateDispatch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	e, _, err := b.store.ExecutionInsert(ctx, insertParams(b.app.ID, "", `{}`))
	require.NoError(t, err)

	const n = 8
	var wg sync.WaitGroup
	results := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, results[i] = b.store.AttemptStart(ctx, pgstore.AttemptStartParams{
				ExecutionID: e.ID, Attempt: 1, Owner: fmt.Sprintf("w%d", i), LeaseFor: time.Minute})
		}()
	}
	wg.Wait()
	won := 0
	for _, err := range results {
		if err == nil {
			won++
		} else {
			require.ErrorIs(t, err, execution.ErrConflict)
		}
	}
	require.Equal(t, 1, won, "exactly one duplicate dispatch starts the attempt")
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM attempts WHERE execution_id = $1`, e.ID))

	// An obsolete dispatch (attempt 3 while attempt 1 runs) is skipped too.
	_, err = b.store.AttemptStart(ctx, pgstore.AttemptStartParams{ExecutionID: e.ID, Attempt: 3, Owner: "w", LeaseFor: time.Minute})
	require.ErrorIs(t, err, execution.ErrConflict)
}

func startAttempt(t *testing.T, b bundle) execution.Execution {
	t.Helper()
	ctx := context.Background()
	e, _, err := b.store.ExecutionInsert(ctx, insertParams(b.app.ID, "", `{}`))
	require.NoError(t, err)
	e, err = b.store.AttemptStart(ctx, pgstore.AttemptStartParams{ExecutionID: e.ID, Attempt: 1, Owner: "w", LeaseFor: time.Minute})
	require.NoError(t, err)
	return e
}

func TestSettlementRace(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		fence func(e execution.Execution) pgstore.Fence
	}{
		{"by version from the same read", func(e execution.Execution) pgstore.Fence { return pgstore.Fence{Version: e.Version} }},
		{"by attempt and lease token", func(e execution.Execution) pgstore.Fence {
			return pgstore.Fence{Attempt: e.Attempt, LeaseToken: e.LeaseToken}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			ctx := context.Background()
			e := startAttempt(t, b)
			read, err := b.store.ExecutionGet(ctx, uuid.Nil, e.ID)
			require.NoError(t, err)
			require.Equal(t, execution.StatusRunning, read.Status)

			statuses := []execution.Status{execution.StatusSucceeded, execution.StatusFailed, execution.StatusSucceeded, execution.StatusCancelled}
			var wg sync.WaitGroup
			errs := make([]error, len(statuses))
			for i, st := range statuses {
				wg.Add(1)
				go func() {
					defer wg.Done()
					p := pgstore.SettleParams{ExecutionID: e.ID, Fence: tc.fence(read), Status: st, Output: []byte(`{}`)}
					if st != execution.StatusSucceeded {
						p.Failure = &execution.Failure{Class: "x.y", Message: "m"}
					}
					_, errs[i] = b.store.ExecutionSettle(ctx, p)
				}()
			}
			wg.Wait()
			won := 0
			for _, err := range errs {
				if err == nil {
					won++
				} else {
					require.ErrorIs(t, err, execution.ErrConflict)
				}
			}
			require.Equal(t, 1, won)
			require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM completion_events WHERE execution_id = $1`, e.ID))
		})
	}
}

func TestLeaseFencing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	e := startAttempt(t, b)

	_, err := b.store.LeaseRenew(ctx, e.ID, e.Attempt, e.LeaseToken, time.Minute)
	require.NoError(t, err)
	_, err = b.store.LeaseRenew(ctx, e.ID, e.Attempt, uuid.New(), time.Minute)
	require.ErrorIs(t, err, execution.ErrLeaseLost, "a foreign token cannot renew")
	_, err = b.store.AttemptRetry(ctx, pgstore.RetryParams{ExecutionID: e.ID,
		Fence: pgstore.Fence{Attempt: e.Attempt, LeaseToken: uuid.New()}, Failure: execution.Failure{Class: "a.b"},
		Policy: execution.DefaultPolicy()})
	require.ErrorIs(t, err, execution.ErrLeaseLost, "a foreign token cannot schedule")
	_, err = b.store.ExecutionSettle(ctx, pgstore.SettleParams{ExecutionID: e.ID,
		Fence: pgstore.Fence{Attempt: e.Attempt, LeaseToken: uuid.New()}, Status: execution.StatusSucceeded})
	require.ErrorIs(t, err, execution.ErrConflict, "a foreign token cannot settle")
	require.Equal(t, 0, count(t, b.url, `SELECT count(*) FROM completion_events`))
}

func TestRetryUntilAttemptLimit(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	e, _, err := b.store.ExecutionInsert(ctx, insertParams(b.app.ID, "", `{}`))
	require.NoError(t, err)
	policy := execution.DefaultPolicy()
	policy.RetryDelays = []time.Duration{time.Millisecond}
	for n := 1; n <= 10; n++ {
		started, err := b.store.AttemptStart(ctx, pgstore.AttemptStartParams{ExecutionID: e.ID, Attempt: n, Owner: "w", LeaseFor: time.Minute})
		require.NoError(t, err, "attempt %d", n)
		res, err := b.store.AttemptRetry(ctx, pgstore.RetryParams{ExecutionID: e.ID,
			Fence:   pgstore.Fence{Attempt: n, LeaseToken: started.LeaseToken},
			Failure: execution.Failure{Class: fmt.Sprintf("provider.unavailable.%d", n), Retryable: true}, Policy: policy})
		require.NoError(t, err)
		if n < 10 {
			require.Equal(t, execution.RetrySchedule, res.Decision)
			require.Equal(t, execution.StatusRetryScheduled, res.Execution.Status)
			require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM dispatch_records WHERE execution_id = $1 AND attempt = $2`, e.ID, n+1))
		} else {
			require.Equal(t, execution.RetryExhausted, res.Decision)
		}
	}
	got, err := b.store.ExecutionGet(ctx, b.app.ID, e.ID)
	require.NoError(t, err)
	require.Equal(t, execution.StatusFailed, got.Status)
	require.Equal(t, "provider.unavailable.10", got.Failure.Class)
	require.Equal(t, execution.ReasonAttemptLimit, got.Failure.Reason)
	require.Equal(t, 10, count(t, b.url, `SELECT count(*) FROM attempts WHERE execution_id = $1`, e.ID))
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM completion_events WHERE execution_id = $1`, e.ID))
	require.Equal(t, 0, count(t, b.url, `SELECT count(*) FROM dispatch_records WHERE execution_id = $1`, e.ID))
}

func TestRetryPastBudgetTimesOut(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	e := startAttempt(t, b) // budget: 1 h
	policy := execution.DefaultPolicy()
	policy.RetryDelays = []time.Duration{2 * time.Hour}
	res, err := b.store.AttemptRetry(ctx, pgstore.RetryParams{ExecutionID: e.ID,
		Fence: pgstore.Fence{Attempt: 1, LeaseToken: e.LeaseToken}, Failure: execution.Failure{Class: "provider.unavailable"}, Policy: policy})
	require.NoError(t, err)
	require.Equal(t, execution.RetryBudgetExceeded, res.Decision)
	require.Equal(t, execution.StatusTimedOut, res.Execution.Status)
	require.Equal(t, execution.ReasonAsyncBudget, res.Execution.Failure.Reason)
	require.Equal(t, "provider.unavailable", res.Execution.Failure.Class, "the last failure class is kept")
	require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM completion_events`))
}

func TestReaperAfterSettlementChangesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	e, _, err := b.store.ExecutionInsert(ctx, insertParams(b.app.ID, "", `{}`))
	require.NoError(t, err)
	e, err = b.store.AttemptStart(ctx, pgstore.AttemptStartParams{ExecutionID: e.ID, Attempt: 1, Owner: "w", LeaseFor: time.Millisecond})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		l, err := b.store.LeaseExpiredList(ctx, 10)
		return err == nil && len(l) == 1
	}, 5*time.Second, 5*time.Millisecond)
	expired, err := b.store.LeaseExpiredList(ctx, 10) // the reaper's read
	require.NoError(t, err)

	// The worker settles after the reaper read the expired lease…
	_, err = b.store.ExecutionSettle(ctx, pgstore.SettleParams{ExecutionID: e.ID,
		Fence: pgstore.Fence{Attempt: 1, LeaseToken: e.LeaseToken}, Status: execution.StatusSucceeded, AttemptOutcome: "SUCCEEDED"})
	require.NoError(t, err)
	// …then the reaper writes: nothing changes.
	_, err = b.store.AttemptRetry(ctx, pgstore.RetryParams{ExecutionID: e.ID,
		Fence:   pgstore.Fence{Attempt: expired[0].Attempt, LeaseToken: expired[0].LeaseToken},
		Failure: execution.Failure{Class: execution.ClassLeaseExpired}, Policy: execution.DefaultPolicy(), AttemptOutcome: "LEASE_EXPIRED"})
	require.True(t, errors.Is(err, execution.ErrLeaseLost), "got %v", err)
	got, err := b.store.ExecutionGet(ctx, uuid.Nil, e.ID)
	require.NoError(t, err)
	require.Equal(t, execution.StatusSucceeded, got.Status)
	require.Equal(t, 0, count(t, b.url, `SELECT count(*) FROM dispatch_records`))
	require.Equal(t, "SUCCEEDED", func() string {
		conn, _ := pgx.Connect(ctx, b.url)
		defer conn.Close(ctx)
		var o string
		_ = conn.QueryRow(ctx, `SELECT outcome FROM attempts WHERE execution_id = $1`, e.ID).Scan(&o)
		return o
	}())
}

func TestDispatchClaimIsExclusiveAndDeleteIsFenced(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	for i := range 30 {
		_, _, err := b.store.ExecutionInsert(ctx, insertParams(b.app.ID, fmt.Sprint(i), `{}`))
		require.NoError(t, err)
	}
	var mu sync.Mutex
	seen := map[uuid.UUID]int{}
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			recs, _, err := b.store.DispatchClaim(ctx, pgstore.DispatchClaimParams{Owner: fmt.Sprint(w), Limit: 10, ClaimFor: time.Minute})
			require.NoError(t, err)
			mu.Lock()
			for _, r := range recs {
				seen[r.ID]++
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	require.Len(t, seen, 30)
	for id, n := range seen {
		require.Equal(t, 1, n, "record %s claimed twice", id)
	}
	// Nothing is claimable while claims are live; a wrong token deletes nothing.
	recs, _, err := b.store.DispatchClaim(ctx, pgstore.DispatchClaimParams{Owner: "x", Limit: 100, ClaimFor: time.Minute})
	require.NoError(t, err)
	require.Empty(t, recs)
	ids := make([]uuid.UUID, 0, len(seen))
	for id := range seen {
		ids = append(ids, id)
	}
	n, err := b.store.DispatchDelete(ctx, ids, uuid.New())
	require.NoError(t, err)
	require.Zero(t, n)
}

func TestDispatchNotPublishedBeforeDue(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	e := startAttempt(t, b)
	first, token, err := b.store.DispatchClaim(ctx, pgstore.DispatchClaimParams{Owner: "x", Limit: 10, ClaimFor: time.Minute})
	require.NoError(t, err)
	require.Len(t, first, 1)
	_, err = b.store.DispatchDelete(ctx, []uuid.UUID{first[0].ID}, token)
	require.NoError(t, err)
	policy := execution.DefaultPolicy()
	policy.RetryDelays, policy.Jitter = []time.Duration{time.Minute}, 0
	_, err = b.store.AttemptRetry(ctx, pgstore.RetryParams{ExecutionID: e.ID,
		Fence: pgstore.Fence{Attempt: 1, LeaseToken: e.LeaseToken}, Failure: execution.Failure{Class: "a.b"}, Policy: policy})
	require.NoError(t, err)
	recs, _, err := b.store.DispatchClaim(ctx, pgstore.DispatchClaimParams{Owner: "x", Limit: 10, ClaimFor: time.Minute})
	require.NoError(t, err)
	require.Empty(t, recs, "a record due in a minute is not published now")
	recs, _, err = b.store.DispatchClaim(ctx, pgstore.DispatchClaimParams{Owner: "x", Limit: 10, ClaimFor: time.Minute, Lookahead: 2 * time.Minute})
	require.NoError(t, err)
	require.Len(t, recs, 1, "within the look-ahead it is")
}

func TestSessionTimeZoneDoesNotChangeDueTimes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	// A store whose sessions run in a far-off zone computes the same instants.
	st, err := pgstore.Open(ctx, b.url+"&timezone=Pacific%2FKiritimati", nil)
	require.NoError(t, err)
	defer st.Close()
	var zone string
	require.NoError(t, st.QueryRowForTest(ctx, `SHOW timezone`).Scan(&zone))
	require.Equal(t, "Pacific/Kiritimati", zone)
	e, _, err := st.ExecutionInsert(ctx, insertParams(b.app.ID, "", `{}`))
	require.NoError(t, err)
	now, err := b.store.Now(ctx)
	require.NoError(t, err)
	require.WithinDuration(t, now.Add(time.Hour), e.BudgetDeadline, 5*time.Second)
	recs, _, err := st.DispatchClaim(ctx, pgstore.DispatchClaimParams{Owner: "x", Limit: 10, ClaimFor: time.Minute})
	require.NoError(t, err)
	require.Len(t, recs, 1, "due now in UTC is due now in any zone")
}

// TestSuccessRacesBudgetTimeout: the worker settles SUCCEEDED by its lease
// while the budget sweeper settles TIMED_OUT by the version it read.
// Whichever commits first stands; the other changes nothing.
func TestSuccessRacesBudgetTimeout(t *testing.T) {
	t.Parallel()
	for i := range 10 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			ctx := context.Background()
			e := startAttempt(t, b)
			var wg sync.WaitGroup
			var success, timeout error
			wg.Add(2)
			go func() {
				defer wg.Done()
				_, success = b.store.ExecutionSettle(ctx, pgstore.SettleParams{ExecutionID: e.ID,
					Fence: pgstore.Fence{Attempt: 1, LeaseToken: e.LeaseToken}, Status: execution.StatusSucceeded, AttemptOutcome: "SUCCEEDED"})
			}()
			go func() {
				defer wg.Done()
				_, timeout = b.store.ExecutionSettle(ctx, pgstore.SettleParams{ExecutionID: e.ID,
					Fence: pgstore.Fence{Version: e.Version, Attempt: 1}, Status: execution.StatusTimedOut, AttemptOutcome: "ABANDONED",
					Failure: &execution.Failure{Class: execution.ReasonAsyncBudget, Reason: execution.ReasonAsyncBudget}})
			}()
			wg.Wait()
			require.True(t, (success == nil) != (timeout == nil), "exactly one wins: success=%v timeout=%v", success, timeout)
			got, err := b.store.ExecutionGet(ctx, uuid.Nil, e.ID)
			require.NoError(t, err)
			if success == nil {
				require.Equal(t, execution.StatusSucceeded, got.Status)
				require.ErrorIs(t, timeout, execution.ErrConflict)
			} else {
				require.Equal(t, execution.StatusTimedOut, got.Status)
				require.ErrorIs(t, success, execution.ErrConflict)
			}
			require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM completion_events`))
			require.Equal(t, 1, count(t, b.url, `SELECT count(*) FROM attempts WHERE outcome <> 'RUNNING'`))
		})
	}
}

func TestBudgetExpiredList(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	p := insertParams(b.app.ID, "", `{}`)
	p.AsyncBudget = time.Millisecond
	e, _, err := b.store.ExecutionInsert(ctx, p)
	require.NoError(t, err)
	_, _, err = b.store.ExecutionInsert(ctx, insertParams(b.app.ID, "", `{"later":1}`))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		l, err := b.store.BudgetExpiredList(ctx, 10)
		require.NoError(t, err)
		return len(l) == 1 && l[0].ExecutionID == e.ID
	}, 5*time.Second, 10*time.Millisecond)
	// An execution past its budget cannot start an attempt.
	_, err = b.store.AttemptStart(ctx, pgstore.AttemptStartParams{ExecutionID: e.ID, Attempt: 1, Owner: "w", LeaseFor: time.Minute})
	require.ErrorIs(t, err, execution.ErrConflict)
}
