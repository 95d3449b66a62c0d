package router

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/testutil/pgtest"
)

// waitTimeout bounds every wait for a signal in these tests; it is a
// safety net, not a timing assertion.
const waitTimeout = 30 * time.Second

func migrate(ctx context.Context, url string) error {
	_, err := pgstore.Migrate(ctx, url, nil)
	return err
}

// harness is a fresh, migrated database with a store and a pool for
// inspecting rows the store has no reader for.
type harness struct {
	url   string
	store *pgstore.Store
	pool  *pgxpool.Pool
}

func newHarness(t *testing.T) *harness {
	t.Helper()
	url := pgtest.NewDatabase(t, migrate)
	store, err := pgstore.Open(t.Context(), url, nil)
	require.NoError(t, err)
	t.Cleanup(store.Close)
	pool, err := pgxpool.New(t.Context(), url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return &harness{url: url, store: store, pool: pool}
}

// compressedConfig is the default schedule shape (five retry delays, so
// DEAD after six failures) with time compressed to milliseconds.
func compressedConfig() config.Router {
	return config.Router{
		PollInterval:          20 * time.Millisecond,
		BatchSize:             10,
		Concurrency:           8,
		ClaimTTL:              10 * time.Second,
		Timeout:               2 * time.Second,
		RetryDelays:           []time.Duration{50 * time.Millisecond, 50 * time.Millisecond, 50 * time.Millisecond, 50 * time.Millisecond, 50 * time.Millisecond},
		Jitter:                0.1,
		AllowPrivateAddresses: true,
	}
}

// app registers an application with a webhook consumer.
func (h *harness) app(t *testing.T, webhookURL, secret string) pgstore.Application {
	t.Helper()
	a, err := h.store.ApplicationUpsert(t.Context(), pgstore.ApplicationUpsertParams{
		Name: "app-" + uuid.NewString(), APIKey: uuid.NewString(), WebhookURL: webhookURL, WebhookSecret: secret,
	})
	require.NoError(t, err)
	return a
}

// event runs one execution of app through insert, attempt start and
// settlement, which writes its completion event, and returns the event id.
func (h *harness) event(t *testing.T, appID uuid.UUID) uuid.UUID {
	t.Helper()
	ctx := t.Context()
	hash := sha256.Sum256([]byte(rand.Text()))
	e, _, err := h.store.ExecutionInsert(ctx, pgstore.ExecutionInsertParams{
		ApplicationID: appID, Capability: "test.echo", Release: "v1", Mode: execution.ModeAsync, MaxAttempts: 1,
		Input: []byte(`{"n":1}`), ContentType: "application/json", RequestHash: hash[:],
		AsyncBudget: time.Hour, Status: execution.StatusQueued,
	})
	require.NoError(t, err)
	e, err = h.store.AttemptStart(ctx, pgstore.AttemptStartParams{
		ExecutionID: e.ID, Attempt: 1, Owner: "test", LeaseFor: time.Minute,
	})
	require.NoError(t, err)
	_, err = h.store.ExecutionSettle(ctx, pgstore.SettleParams{
		ExecutionID: e.ID, Fence: pgstore.Fence{Attempt: 1, LeaseToken: e.LeaseToken},
		Status: execution.StatusSucceeded, Output: []byte(`{"ok":true}`), OutputType: "application/json",
		AttemptOutcome: "SUCCEEDED",
	})
	require.NoError(t, err)
	var id uuid.UUID
	require.NoError(t, h.pool.QueryRow(ctx, `SELECT id FROM completion_events WHERE execution_id = $1`, e.ID).Scan(&id))
	return id
}

// eventRow is a completion event as stored.
type eventRow struct {
	Status     string
	Attempts   int
	StatusCode *int
	Error      *string
	Payload    []byte
}

func (h *harness) eventRow(t *testing.T, id uuid.UUID) eventRow {
	t.Helper()
	var r eventRow
	require.NoError(t, h.pool.QueryRow(t.Context(), `
SELECT status, delivery_attempts, last_status_code, last_error, payload FROM completion_events WHERE id = $1`, id).
		Scan(&r.Status, &r.Attempts, &r.StatusCode, &r.Error, &r.Payload))
	return r
}

// attemptRow is one delivery_attempts row.
type attemptRow struct {
	Attempt    int
	StatusCode *int
	Error      *string
}

func (h *harness) attempts(t *testing.T, id uuid.UUID) []attemptRow {
	t.Helper()
	rows, err := h.pool.Query(t.Context(), `
SELECT attempt, status_code, error FROM delivery_attempts WHERE event_id = $1 ORDER BY attempt`, id)
	require.NoError(t, err)
	defer rows.Close()
	var out []attemptRow
	for rows.Next() {
		var a attemptRow
		require.NoError(t, rows.Scan(&a.Attempt, &a.StatusCode, &a.Error))
		out = append(out, a)
	}
	require.NoError(t, rows.Err())
	return out
}

// outcome is what a router recorded for one attempt (the test signal).
type outcome struct {
	P   pgstore.EventResultParams
	Err error
}

// running is a Router whose Run is in progress.
type running struct {
	*Router
	cancel context.CancelFunc
	done   chan struct{} // closed when Run has returned
	err    error         // Run's result, set before done is closed
}

// start runs a router on h's store until the test ends (or stop is
// called). Every finished attempt is sent to out, which must be drained.
func (h *harness) start(t *testing.T, cfg config.Router, out chan<- outcome, logger *slog.Logger, opts ...Option) *running {
	t.Helper()
	if logger == nil {
		logger = slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	r := New(h.store, cfg, logger, opts...)
	r.recorded = func(p pgstore.EventResultParams, err error) { out <- outcome{P: p, Err: err} }
	ctx, cancel := context.WithCancel(context.Background())
	run := &running{Router: r, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(run.done)
		run.err = r.Run(ctx)
	}()
	t.Cleanup(func() { run.stop(t) })
	return run
}

// stop cancels Run and waits for it to return nil.
func (r *running) stop(t *testing.T) {
	t.Helper()
	r.cancel()
	select {
	case <-r.done:
		require.NoError(t, r.err)
	case <-time.After(waitTimeout):
		t.Fatal("Run did not return after its context was cancelled")
	}
}

// await reads outcomes until until returns true.
func await(t *testing.T, out <-chan outcome, until func(outcome) bool) {
	t.Helper()
	timer := time.NewTimer(waitTimeout)
	defer timer.Stop()
	for {
		select {
		case o := <-out:
			if until(o) {
				return
			}
		case <-timer.C:
			t.Fatal("timed out waiting for a delivery outcome")
		}
	}
}

// finished reports outcomes that leave event id DELIVERED or DEAD.
func finished(id uuid.UUID) func(outcome) bool {
	return func(o outcome) bool { return o.Err == nil && o.P.ID == id && (o.P.Delivered || o.P.Dead) }
}

// request is one webhook request a receiver saw.
type request struct {
	Path   string
	Header http.Header
	Body   []byte
}

// receiver is a webhook endpoint on loopback that records every request and
// answers with respond (n is the 1-based request number).
type receiver struct {
	*httptest.Server
	mu   sync.Mutex
	reqs []request
}

func newReceiver(t *testing.T, respond func(n int, w http.ResponseWriter, r *http.Request)) *receiver {
	t.Helper()
	rc := &receiver{}
	rc.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		rc.mu.Lock()
		rc.reqs = append(rc.reqs, request{Path: r.URL.Path, Header: r.Header.Clone(), Body: body})
		n := len(rc.reqs)
		rc.mu.Unlock()
		respond(n, w, r)
	}))
	t.Cleanup(rc.Close)
	return rc
}

// newGatedReceiver returns a receiver that signals every request's arrival
// on arrived and holds it until open is called (or the client gives up),
// then answers 200. open is idempotent and also runs at cleanup.
func newGatedReceiver(t *testing.T) (rc *receiver, arrived <-chan struct{}, open func()) {
	t.Helper()
	arrivals := make(chan struct{}, 16)
	release := make(chan struct{})
	rc = newReceiver(t, func(_ int, _ http.ResponseWriter, r *http.Request) {
		arrivals <- struct{}{}
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	open = sync.OnceFunc(func() { close(release) })
	t.Cleanup(open)
	return rc, arrivals, open
}

// wait returns the next value from ch, failing the test after waitTimeout.
func wait[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(waitTimeout):
		t.Fatalf("timed out waiting for %s", what)
		var zero T
		return zero
	}
}

func (rc *receiver) requests() []request {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return append([]request(nil), rc.reqs...)
}

// logBuffer is a concurrency-safe sink for log output.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// teeLogger logs at debug level to the test output and to buf.
func teeLogger(t *testing.T, buf *logBuffer) *slog.Logger {
	return slog.New(slog.NewTextHandler(io.MultiWriter(t.Output(), buf), &slog.HandlerOptions{Level: slog.LevelDebug}))
}
