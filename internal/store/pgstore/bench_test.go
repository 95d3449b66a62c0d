package pgstore_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/testutil/pgtest"
)

func benchStore(b *testing.B) (*pgstore.Store, uuid.UUID) {
	b.Helper()
	ctx := context.Background()
	st, err := pgstore.Open(ctx, pgtest.NewDatabase(b, migrate), nil)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(st.Close)
	app, err := st.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: "bench", APIKey: "k"})
	if err != nil {
		b.Fatal(err)
	}
	return st, app.ID
}

// BenchmarkExecutionInsert measures hop 1's transaction (execution and
// dispatch record) with an idempotency key, from parallel callers.
// Run: go test -run '^$' -bench ExecutionInsert ./internal/store/pgstore/
func BenchmarkExecutionInsert(b *testing.B) {
	st, app := benchStore(b)
	ctx := context.Background()
	b.ReportAllocs()
	b.SetParallelism(4)
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			key := uuid.NewString()
			if _, _, err := st.ExecutionInsert(ctx, insertParams(app, key, key)); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "accepts/s")
}

// BenchmarkAttemptCycle measures one attempt's store work on the healthy
// path: claim and delete its dispatch record, start the attempt, settle
// with the completion event.
// Run: go test -run '^$' -bench AttemptCycle ./internal/store/pgstore/
func BenchmarkAttemptCycle(b *testing.B) {
	st, app := benchStore(b)
	ctx := context.Background()
	ids := make([]uuid.UUID, b.N)
	for i := range b.N {
		e, _, err := st.ExecutionInsert(ctx, insertParams(app, "", fmt.Sprint(i)))
		if err != nil {
			b.Fatal(err)
		}
		ids[i] = e.ID
	}
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	for i := 0; i < b.N; i += 100 {
		recs, token, err := st.DispatchClaim(ctx, pgstore.DispatchClaimParams{Owner: "b", Limit: 100, ClaimFor: time.Minute})
		if err != nil {
			b.Fatal(err)
		}
		claimed := make([]uuid.UUID, len(recs))
		for j, r := range recs {
			claimed[j] = r.ID
		}
		if _, err := st.DispatchDelete(ctx, claimed, token); err != nil {
			b.Fatal(err)
		}
		for _, r := range recs {
			e, err := st.AttemptStart(ctx, pgstore.AttemptStartParams{ExecutionID: r.ExecutionID, Attempt: 1, Owner: "b", LeaseFor: time.Minute})
			if err != nil {
				b.Fatal(err)
			}
			if _, err := st.ExecutionSettle(ctx, pgstore.SettleParams{ExecutionID: e.ID,
				Fence: pgstore.Fence{Attempt: 1, LeaseToken: e.LeaseToken}, Status: execution.StatusSucceeded,
				Output: []byte(`{}`), AttemptOutcome: "SUCCEEDED"}); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "attempts/s")
}
