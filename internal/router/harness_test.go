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
	"github.com/jackc/pgx/v5"
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

func newHarness(t testing.TB) *harness {
	t.Helper()
	url := pgtest.NewDatabase(t, migrate)
	store, err := pgstore.Open(context.Background(), url, nil)
	require.NoError(t, err)
	t.Cleanup(store.Close)
	pool, err := pgxpool.New(context.Background(), url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return &harness{url: url, store: store, pool: pool}
}

// compressedConfig is the default schedule shape (five retry delays, so
// DEAD after six failures) with time compressed to milliseconds.
func compressedConfig() config.Router {
	return config.Router{
		PollInterval:              20 * time.Millisecond,
		BatchSize:                 10,
		Concurrency:               8,
		ClaimTTL:                  10 * time.Second,
		Timeout:                   2 * time.Second,
		RetryDelays:               []time.Duration{50 * time.Millisecond, 50 * time.Millisecond, 50 * time.Millisecond, 50 * time.Millisecond, 50 * time.Millisecond},
		Jitter:                    0.1,
		AllowPrivateAddresses:     true,
		PerApplicationConcurrency: 8,
	}
}

// app registers an application with a webhook consumer (none when
// webhookURL is empty).
func (h *harness) app(t testing.TB, webhookURL, secret string) pgstore.Application {
	t.Helper()
	a, err := h.store.ApplicationUpsert(context.Background(), pgstore.ApplicationUpsertParams{
		Name: "app-" + uuid.NewString(), APIKey: uuid.NewString(), WebhookURL: webhookURL, WebhookSecret: secret,
	})
	require.NoError(t, err)
	return a
}

// consumer registers (or replaces) app's consumer through the store.
func (h *harness) consumer(t testing.TB, app uuid.UUID, kind pgstore.ConsumerKind, target string, secrets ...string) pgstore.Consumer {
	t.Helper()
	c, err := h.store.ConsumerSet(context.Background(), pgstore.ConsumerSetParams{
		ApplicationID: app, Kind: kind, Target: target, Secrets: secrets,
	})
	require.NoError(t, err)
	return c
}

// rawConsumer writes a consumer row as is, bypassing validation, to test
// how the router copes with rows it would never accept on registration.
func (h *harness) rawConsumer(t testing.TB, app uuid.UUID, kind pgstore.ConsumerKind, target string, secrets ...string) {
	t.Helper()
	ctx := context.Background()
	_, err := h.pool.Exec(ctx, `INSERT INTO event_consumers (application_id, kind, target) VALUES ($1, $2, $3)`, app, kind, target)
	require.NoError(t, err)
	for _, s := range secrets {
		_, err := h.pool.Exec(ctx, `
INSERT INTO event_consumer_secrets (id, application_id, sealed, fingerprint) VALUES ($1, $2, $3, 'raw')`, uuid.New(), app, s)
		require.NoError(t, err)
	}
}

// event runs one execution of app through insert, attempt start and
// settlement, which writes its completion event, and returns the event id.
func (h *harness) event(t testing.TB, appID uuid.UUID) uuid.UUID {
	t.Helper()
	ctx := context.Background()
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
	Status        string
	Attempts      int
	RoundAttempts int
	Replays       int
	StatusCode    *int
	Error         *string
	Payload       []byte
}

func (h *harness) eventRow(t testing.TB, id uuid.UUID) eventRow {
	t.Helper()
	var r eventRow
	require.NoError(t, h.pool.QueryRow(context.Background(), `
SELECT status, delivery_attempts, round_attempts, replays, last_status_code, last_error, payload
  FROM completion_events WHERE id = $1`, id).
		Scan(&r.Status, &r.Attempts, &r.RoundAttempts, &r.Replays, &r.StatusCode, &r.Error, &r.Payload))
	return r
}

// attemptRow is one delivery_attempts row.
type attemptRow struct {
	Attempt         int
	StatusCode      *int
	Error           *string
	Replay          int
	ConsumerKind    string
	ConsumerVersion *int64
	StartedAt       time.Time
	EndedAt         time.Time
}

func (h *harness) attempts(t testing.TB, id uuid.UUID) []attemptRow {
	t.Helper()
	rows, err := h.pool.Query(context.Background(), `
SELECT attempt, status_code, error, replay, consumer_kind, consumer_version, started_at, ended_at
  FROM delivery_attempts WHERE event_id = $1 ORDER BY attempt`, id)
	require.NoError(t, err)
	defer rows.Close()
	var out []attemptRow
	for rows.Next() {
		var a attemptRow
		require.NoError(t, rows.Scan(&a.Attempt, &a.StatusCode, &a.Error, &a.Replay, &a.ConsumerKind,
			&a.ConsumerVersion, &a.StartedAt, &a.EndedAt))
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
func (h *harness) start(t testing.TB, cfg config.Router, out chan<- outcome, logger *slog.Logger, opts ...Option) *running {
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
func (r *running) stop(t testing.TB) {
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
func await(t testing.TB, out <-chan outcome, until func(outcome) bool) {
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

func newReceiver(t testing.TB, respond func(n int, w http.ResponseWriter, r *http.Request)) *receiver {
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
func newGatedReceiver(t testing.TB) (rc *receiver, arrived <-chan struct{}, open func()) {
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
func wait[T any](t testing.TB, ch <-chan T, what string) T {
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
func teeLogger(t testing.TB, buf *logBuffer) *slog.Logger {
	return slog.New(slog.NewTextHandler(io.MultiWriter(t.Output(), buf), &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// bulkEvents inserts n settled executions of app with their PENDING
// completion events in two statements (much faster than event, for
// backlogs and benchmarks) and returns the event ids, oldest first.
func (h *harness) bulkEvents(t testing.TB, app uuid.UUID, n int) []uuid.UUID {
	t.Helper()
	ctx := context.Background()
	tx, err := h.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	rows, err := tx.Query(ctx, `
WITH ex AS (
  INSERT INTO executions (id, application_id, capability, release, mode, status, attempt, max_attempts, input,
                          content_type, request_hash, budget_deadline, settled_at)
  SELECT gen_random_uuid(), $1, 'test.echo', 'v1', 'ASYNC', 'SUCCEEDED', 1, 1, '\x7b7d', 'application/json',
         sha256(gen_random_uuid()::text::bytea), now() + interval '1 hour', now()
    FROM generate_series(1, $2)
  RETURNING id)
INSERT INTO completion_events (id, execution_id, application_id, type, payload, next_attempt_at)
SELECT x.id2, x.exid, $1, 'execution.succeeded',
       convert_to(json_build_object('eventId', x.id2, 'executionId', x.exid, 'type', 'execution.succeeded')::text, 'UTF8'),
       clock_timestamp()
  FROM (SELECT gen_random_uuid() AS id2, ex.id AS exid FROM ex) x
RETURNING id`, app, n)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.Len(t, ids, n)
	return ids
}

// countStatus counts app's events in status.
func (h *harness) countStatus(t testing.TB, app uuid.UUID, status string) int {
	t.Helper()
	var n int
	require.NoError(t, h.pool.QueryRow(context.Background(),
		`SELECT count(*) FROM completion_events WHERE application_id = $1 AND status = $2`, app, status).Scan(&n))
	return n
}
