package router

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/internal/config"
)

// benchConfig is the production shape with short polling, so that the
// figures measure delivery, not idle waits.
func benchConfig() config.Router {
	return config.Router{
		PollInterval:              20 * time.Millisecond,
		BatchSize:                 200,
		Concurrency:               64,
		PerApplicationConcurrency: 8,
		ClaimTTL:                  30 * time.Second,
		Timeout:                   5 * time.Second,
		RetryDelays:               []time.Duration{50 * time.Millisecond, 50 * time.Millisecond, 50 * time.Millisecond, 50 * time.Millisecond, 50 * time.Millisecond},
		Jitter:                    0.1,
		AllowPrivateAddresses:     true,
	}
}

var discard = slog.New(slog.DiscardHandler)

// drainDelivered reads outcomes until every id in want was delivered,
// ignoring every other outcome.
func drainDelivered(b *testing.B, out <-chan outcome, want []uuid.UUID) {
	b.Helper()
	left := make(map[uuid.UUID]bool, len(want))
	for _, id := range want {
		left[id] = true
	}
	await(b, out, func(o outcome) bool {
		if o.Err == nil && o.P.Delivered {
			delete(left, o.P.ID)
		}
		return len(left) == 0
	})
}

// BenchmarkRouterThroughput measures deliveries per second to a local
// receiver that answers 200 at once, with the events spread over 1 or 8
// applications (one application is bounded by PerApplicationConcurrency).
// Run with a fixed count, e.g. -benchtime=2000x: the events are inserted
// before the timer starts.
func BenchmarkRouterThroughput(b *testing.B) {
	for _, apps := range []int{1, 8} {
		b.Run(fmt.Sprintf("apps=%d", apps), func(b *testing.B) {
			h := newHarness(b)
			rc := newReceiver(b, func(int, http.ResponseWriter, *http.Request) {})
			var ids []uuid.UUID
			for i := range apps {
				app := h.app(b, rc.URL, newSecret(b))
				n := b.N / apps
				if i < b.N%apps {
					n++
				}
				if n > 0 {
					ids = append(ids, h.bulkEvents(b, app.ID, n)...)
				}
			}
			out := make(chan outcome, b.N+64)
			b.ResetTimer()
			start := time.Now()
			r := h.start(b, benchConfig(), out, discard)
			drainDelivered(b, out, ids)
			elapsed := time.Since(start)
			b.StopTimer()
			r.stop(b)
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "deliveries/s")
		})
	}
}

// BenchmarkRouterIsolation measures how long application B's events take
// from settlement to delivery (database clock), first alone, then while
// application A has a 1000-event backlog on an endpoint that hangs until
// the delivery timeout. Each iteration settles 20 of B's events and waits
// for all of them. It reports both means (B-ms-alone,
// B-ms-with-A-backlog). The sub-benchmark per_app=off lifts the
// per-application bound to the whole pool, for contrast.
func BenchmarkRouterIsolation(b *testing.B) {
	const batch = 20
	for _, bound := range []struct {
		name   string
		perApp int
	}{{"per_app=4", 4}, {"per_app=off", 16}} {
		b.Run(bound.name, func(b *testing.B) {
			h := newHarness(b)
			fast := newReceiver(b, func(int, http.ResponseWriter, *http.Request) {})
			hung := make(chan struct{}, 64)
			slow := newReceiver(b, func(_ int, _ http.ResponseWriter, r *http.Request) {
				select {
				case hung <- struct{}{}:
				default:
				}
				<-r.Context().Done() // hang until the router gives up
			})
			appA, appB := h.app(b, slow.URL, newSecret(b)), h.app(b, fast.URL, newSecret(b))
			cfg := benchConfig()
			cfg.Concurrency, cfg.PerApplicationConcurrency, cfg.BatchSize = 16, bound.perApp, 16
			cfg.Timeout, cfg.ClaimTTL = 2*time.Second, 10*time.Second
			out := make(chan outcome, 1<<16)
			h.start(b, cfg, out, discard)

			latency := func() time.Duration {
				ids := h.bulkEvents(b, appB.ID, batch)
				drainDelivered(b, out, ids)
				var mean time.Duration
				require.NoError(b, h.pool.QueryRow(context.Background(), `
SELECT avg(a.ended_at - e.created_at) FROM completion_events e
  JOIN delivery_attempts a ON a.event_id = e.id AND a.status_code BETWEEN 200 AND 299
 WHERE e.id = ANY($1)`, ids).Scan(&mean))
				return mean
			}

			b.ResetTimer()
			var alone time.Duration
			for range b.N {
				alone += latency()
			}
			b.StopTimer()
			h.bulkEvents(b, appA.ID, 1000)
			for range min(bound.perApp, cfg.Concurrency) {
				wait(b, hung, "A's deliveries to hang")
			}
			b.StartTimer()
			var withA time.Duration
			for range b.N {
				withA += latency()
			}
			b.StopTimer()
			ms := func(d time.Duration) float64 { return float64(d) / float64(b.N) / float64(time.Millisecond) }
			b.ReportMetric(ms(alone), "B-ms-alone")
			b.ReportMetric(ms(withA), "B-ms-with-A-backlog")
			b.ReportMetric(float64(h.countStatus(b, appA.ID, "PENDING")), "A-pending")
		})
	}
}
