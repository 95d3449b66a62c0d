package router

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
)

func TestRouterRetriesUntilDelivered(t *testing.T) {
	t.Parallel()
	for _, failures := range []int{0, 1, 3} {
		t.Run(fmt.Sprintf("%d failures", failures), func(t *testing.T) {
			t.Parallel()
			h := newHarness(t)
			secret := newSecret(t)
			clock := time.Now().Add(-time.Minute).Truncate(time.Second)
			rc := newReceiver(t, func(n int, w http.ResponseWriter, _ *http.Request) {
				if n <= failures {
					w.WriteHeader(http.StatusInternalServerError)
				}
			})
			app := h.app(t, rc.URL+"/hook", secret)
			id := h.event(t, app.ID)
			out := make(chan outcome, 64)

			r := h.start(t, compressedConfig(), out, nil, WithClock(func() time.Time { return clock }), WithWorkerID("r1"))
			await(t, out, finished(id))

			row := h.eventRow(t, id)
			require.Equal(t, pgstore.EventDelivered, row.Status)
			require.Equal(t, failures+1, row.Attempts)
			atts := h.attempts(t, id)
			require.Len(t, atts, failures+1)
			for i, a := range atts {
				require.Equal(t, i+1, a.Attempt)
				require.NotNil(t, a.StatusCode)
				if i < failures {
					require.Equal(t, 500, *a.StatusCode)
					require.NotNil(t, a.Error)
					require.Equal(t, "HTTP 500", *a.Error)
				} else {
					require.Equal(t, 200, *a.StatusCode)
					require.Nil(t, a.Error)
				}
			}
			reqs := rc.requests()
			require.Len(t, reqs, failures+1)
			for _, req := range reqs {
				require.Equal(t, id.String(), req.Header.Get("webhook-id"), "the same webhook-id on every try")
				require.Equal(t, strconv.FormatInt(clock.Unix(), 10), req.Header.Get("webhook-timestamp"))
				require.Equal(t, "application/json", req.Header.Get("Content-Type"))
				require.Equal(t, row.Payload, req.Body)
				verifySignature(t, secret, req.Header, req.Body)
			}
			require.Equal(t, Stats{Delivered: 1, Failed: int64(failures)}, r.Stats())
		})
	}
}

func TestRouterFailedDeliveriesGoDead(t *testing.T) {
	t.Parallel()
	const attempts = 6 // len(compressedConfig().RetryDelays) + 1
	tests := []struct {
		name     string
		respond  func(n int, w http.ResponseWriter, r *http.Request)
		url      func(srv string) string // default srv + "/hook?token=…"
		guard    bool                    // AllowPrivateAddresses false
		timeout  time.Duration
		wantCode int    // 0: no HTTP response (NULL)
		wantErr  string // the recorded error, or a prefix of it when wantPrefix
		prefix   bool
		reached  bool // whether requests reach the receiver
	}{
		{name: "always 500", respond: func(_ int, w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(http.StatusInternalServerError)
			_, _ = w.Write([]byte("oops: response-body-marker"))
		}, wantCode: 500, wantErr: "HTTP 500: oops: response-body-marker", reached: true},
		{name: "404 is a normal failure", respond: func(_ int, w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(http.StatusNotFound)
		}, wantCode: 404, wantErr: "HTTP 404", reached: true},
		{name: "429 without Retry-After", respond: func(_ int, w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(http.StatusTooManyRequests)
		}, wantCode: 429, wantErr: "HTTP 429", reached: true},
		{name: "redirect is not followed", respond: func(_ int, w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/elsewhere" {
				panic("redirect followed")
			}
			http.Redirect(w, r, "/elsewhere", http.StatusTemporaryRedirect)
		}, wantCode: 307, wantErr: "HTTP 307: redirect not followed", reached: true},
		{name: "hanging receiver past the timeout", respond: func(_ int, _ http.ResponseWriter, r *http.Request) {
			<-r.Context().Done()
		}, timeout: 100 * time.Millisecond, wantErr: "timeout after 100ms", reached: true},
		{name: "no consumer registered", url: func(string) string { return "" }, wantErr: "no consumer registered"},
		{name: "non-http scheme", url: func(string) string { return "gopher://example.com/hook" }, wantErr: errBadScheme},
		{name: "loopback refused", guard: true,
			wantErr: "refused: webhook address not allowed: 127.0.0.1 is loopback"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t)
			secret := newSecret(t)
			respond := tt.respond
			if respond == nil {
				respond = func(int, http.ResponseWriter, *http.Request) {}
			}
			rc := newReceiver(t, respond)
			token := "tok-" + uuid.NewString()
			url := rc.URL + "/hook?token=" + token
			if tt.url != nil {
				url = tt.url(rc.URL)
			}
			var app pgstore.Application
			if tt.url != nil && url != "" {
				// A row registration would refuse (written before validation existed).
				app = h.app(t, "", "")
				h.rawConsumer(t, app.ID, pgstore.ConsumerWebhook, url, secret)
			} else {
				app = h.app(t, url, secret)
			}
			id := h.event(t, app.ID)
			cfg := compressedConfig()
			cfg.AllowPrivateAddresses = !tt.guard
			if tt.timeout > 0 {
				cfg.Timeout = tt.timeout
			}
			var logs logBuffer
			out := make(chan outcome, 64)

			r := h.start(t, cfg, out, teeLogger(t, &logs))
			await(t, out, finished(id))

			row := h.eventRow(t, id)
			require.Equal(t, pgstore.EventDead, row.Status)
			require.Equal(t, attempts, row.Attempts)
			atts := h.attempts(t, id)
			require.Len(t, atts, attempts)
			for i, a := range atts {
				require.Equal(t, i+1, a.Attempt)
				if tt.wantCode == 0 {
					require.Nil(t, a.StatusCode)
				} else {
					require.NotNil(t, a.StatusCode)
					require.Equal(t, tt.wantCode, *a.StatusCode)
				}
				require.NotNil(t, a.Error)
				require.Equal(t, tt.wantErr, *a.Error)
			}
			reqs := rc.requests()
			if tt.reached {
				require.Len(t, reqs, attempts)
				for _, req := range reqs {
					require.Equal(t, "/hook", req.Path, "redirects are not followed")
					require.Equal(t, id.String(), req.Header.Get("webhook-id"))
				}
			} else {
				require.Empty(t, reqs)
			}
			require.Equal(t, Stats{Failed: attempts, Dead: 1}, r.Stats())
			r.stop(t)
			for _, secretish := range []string{secret, token, string(row.Payload), "response-body-marker"} {
				require.NotContains(t, logs.String(), secretish, "logs must hold no secret, URL, payload or response body")
			}
		})
	}
}

func TestRouterTwoInstancesDeliverEachEventOnce(t *testing.T) {
	t.Parallel()
	const events = 40
	h := newHarness(t)
	var (
		mu   sync.Mutex
		seen = map[string]int{}
	)
	rc := newReceiver(t, func(_ int, _ http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen[r.Header.Get("webhook-id")]++
		mu.Unlock()
	})
	app := h.app(t, rc.URL, newSecret(t))
	want := map[string]int{}
	for range events {
		want[h.event(t, app.ID).String()] = 1
	}
	cfg := compressedConfig()
	cfg.BatchSize, cfg.Concurrency = 3, 4
	out := make(chan outcome, 2*events)

	r1 := h.start(t, cfg, out, nil, WithWorkerID("r1"))
	r2 := h.start(t, cfg, out, nil, WithWorkerID("r2"))
	delivered := map[uuid.UUID]bool{}
	await(t, out, func(o outcome) bool {
		require.NoError(t, o.Err)
		require.True(t, o.P.Delivered, "attempt %d of %s failed: %s", o.P.Attempt, o.P.ID, o.P.Error)
		delivered[o.P.ID] = true
		return len(delivered) == events
	})
	r1.stop(t)
	r2.stop(t)

	mu.Lock()
	require.Equal(t, want, seen, "every event delivered exactly once, counted by webhook-id")
	mu.Unlock()
	require.Equal(t, int64(events), r1.Stats().Delivered+r2.Stats().Delivered)
	require.Zero(t, r1.Stats().Conflicts+r2.Stats().Conflicts)
	var pending int
	require.NoError(t, h.pool.QueryRow(t.Context(),
		`SELECT count(*) FROM completion_events WHERE status <> 'DELIVERED' OR delivery_attempts <> 1`).Scan(&pending))
	require.Zero(t, pending)
}

// TestRouterKeepsClaimingWhileDeliveriesHang checks that the concurrency
// limit is a semaphore shared across batches: with one delivery hanging,
// the free slot keeps delivering newer events, and no more than Concurrency
// deliveries are ever in flight.
func TestRouterKeepsClaimingWhileDeliveriesHang(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	slow, arrived, open := newGatedReceiver(t)
	var inFlight, maxInFlight atomic.Int64
	fast := newReceiver(t, func(int, http.ResponseWriter, *http.Request) {
		n := inFlight.Add(1)
		defer inFlight.Add(-1)
		for m := maxInFlight.Load(); n > m && !maxInFlight.CompareAndSwap(m, n); m = maxInFlight.Load() {
		}
	})
	slowApp, fastApp := h.app(t, slow.URL, newSecret(t)), h.app(t, fast.URL, newSecret(t))
	hanging := h.event(t, slowApp.ID)
	cfg := compressedConfig()
	cfg.Concurrency, cfg.BatchSize, cfg.Timeout, cfg.ClaimTTL = 2, 10, time.Minute, 2*time.Minute
	out := make(chan outcome, 16)

	r := h.start(t, cfg, out, nil)
	wait(t, arrived, "the hanging delivery")
	later := map[uuid.UUID]bool{}
	for range 3 {
		later[h.event(t, fastApp.ID)] = true
	}
	await(t, out, func(o outcome) bool {
		require.NoError(t, o.Err)
		require.True(t, later[o.P.ID] && o.P.Delivered, "unexpected outcome %+v", o.P)
		delete(later, o.P.ID)
		return len(later) == 0
	})
	require.Equal(t, pgstore.EventPending, h.eventRow(t, hanging).Status, "still in flight")

	open()
	await(t, out, finished(hanging))
	require.Equal(t, pgstore.EventDelivered, h.eventRow(t, hanging).Status)
	require.Equal(t, int64(cfg.Concurrency-1), maxInFlight.Load(), "one slot hangs, the other serves")
	require.Equal(t, Stats{Delivered: 4}, r.Stats())
}

func TestRouterLostClaimIsCountedNotRetried(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	rc, arrived, open := newGatedReceiver(t)
	app := h.app(t, rc.URL, newSecret(t))
	id := h.event(t, app.ID)
	out := make(chan outcome, 4)

	r := h.start(t, compressedConfig(), out, nil)
	wait(t, arrived, "the delivery")
	// Another router takes the event over while this one delivers it.
	_, err := h.pool.Exec(t.Context(), `UPDATE completion_events SET claim_token = gen_random_uuid() WHERE id = $1`, id)
	require.NoError(t, err)
	open()
	lost := wait(t, out, "the attempt's outcome")

	require.ErrorIs(t, lost.Err, execution.ErrConflict)
	require.Equal(t, Stats{Conflicts: 1}, r.Stats())
	row := h.eventRow(t, id)
	require.Equal(t, pgstore.EventPending, row.Status)
	require.Zero(t, row.Attempts)
	require.Empty(t, h.attempts(t, id))
	require.Len(t, rc.requests(), 1)
}

func TestRouterDrainsDeliveriesOnShutdown(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	rc, arrived, open := newGatedReceiver(t)
	app := h.app(t, rc.URL, newSecret(t))
	id := h.event(t, app.ID)
	out := make(chan outcome, 4)

	r := h.start(t, compressedConfig(), out, nil)
	wait(t, arrived, "the delivery")
	r.cancel()
	select {
	case <-r.done:
		t.Fatal("Run returned with a delivery in flight")
	default:
	}
	open()
	r.stop(t)

	require.Equal(t, pgstore.EventDelivered, h.eventRow(t, id).Status)
	require.Equal(t, Stats{Delivered: 1}, r.Stats())
}

// signalHandler signals on ch whenever a record with message msg is logged.
type signalHandler struct {
	slog.Handler
	msg string
	ch  chan<- struct{}
}

func (h signalHandler) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == h.msg {
		select {
		case h.ch <- struct{}{}:
		default:
		}
	}
	return h.Handler.Handle(ctx, r)
}

func TestRouterRidesOutDatabaseErrors(t *testing.T) {
	t.Parallel()
	// Nothing listens on port 1: every claim fails to connect.
	store, err := pgstore.Open(t.Context(), "postgres://postgres@127.0.0.1:1/none?connect_timeout=1", nil)
	require.NoError(t, err)
	t.Cleanup(store.Close)
	failures := make(chan struct{}, 1)
	logger := slog.New(signalHandler{
		Handler: slog.NewTextHandler(t.Output(), nil), msg: "claim events failed; backing off", ch: failures,
	})
	r := New(store, compressedConfig(), logger)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()

	for range 3 {
		wait(t, failures, "a failed claim to be logged")
	}
	select {
	case err := <-done:
		t.Fatalf("Run returned on database errors: %v", err)
	default:
	}
	cancel()
	require.NoError(t, wait(t, done, "Run to return after cancel"))
	require.Equal(t, Stats{}, r.Stats())
}
