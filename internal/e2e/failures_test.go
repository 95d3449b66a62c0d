package e2e_test

// Process-level failure tests of the attempt loop, leases and settlement
// (SYSTEM §3-§5): daemons are killed, paused, terminated and their
// database restarted under load, and every test checks that nothing was
// lost and nothing done twice (stack.requireExactlyOnce).

import (
	"context"
	"net/http"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/examples/csv-payments/payment"
	"github.com/capstan-dev/capstan/internal/pgcluster"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
)

// settleTimeout bounds the wait for every execution to settle after a
// failure (leases are 1 s here; the bound is for a loaded 2-core machine).
const settleTimeout = 90 * time.Second

func skipShort(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("failure end-to-end test: starts the daemons as processes and waits for leases and session timeouts")
	}
}

// invokeInBackground invokes payments in a goroutine and returns a function
// that waits for it and fails the test on error.
func invokeInBackground(t *testing.T, s *stack, payments []payment.Payment, concurrency int, into *invokeResult) (wait func()) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	errc := make(chan error, 1)
	go func() { errc <- s.invoke(ctx, payments, concurrency, into) }()
	var once sync.Once
	var err error
	wait = func() {
		t.Helper()
		once.Do(func() { err = <-errc; cancel() })
		require.NoError(t, err, "invocations")
	}
	t.Cleanup(func() { cancel(); once.Do(func() { err = <-errc }) })
	return wait
}

// attemptKey names one attempt.
type attemptKey struct {
	Execution string
	Attempt   int
}

// holdPaused pauses (SIGSTOP) consumer p at a moment when it holds
// RUNNING attempts and returns them: a paused process writes nothing, so
// the list is exact until it is resumed.
func holdPaused(t *testing.T, s *stack, p *proc) []attemptKey {
	t.Helper()
	ctx := t.Context()
	var held []attemptKey
	require.True(t, pollUntil(ctx, 30*time.Second, 0, func() bool {
		require.True(t, pollUntil(ctx, 30*time.Second, 5*time.Millisecond, func() bool {
			return s.runningAttempts(ctx, p.name) > 0
		}), "%s never ran an attempt: %s", p.name, s.progress(ctx))
		p.pause(t)
		rows, err := s.db.Query(ctx, `SELECT execution_id::text, attempt FROM attempts WHERE worker = $1 AND outcome = 'RUNNING'`, p.name)
		require.NoError(t, err)
		held, err = pgx.CollectRows(rows, pgx.RowToStructByPos[attemptKey])
		require.NoError(t, err)
		if len(held) > 0 {
			return true
		}
		p.resume(t)
		return false
	}), "%s never held an attempt while paused", p.name)
	return held
}

// TestConsumerKilledUnderLoad SIGKILLs one of two consumers while it runs
// attempts, then restarts it: the attempts it held are reaped when their
// leases expire (LEASE_EXPIRED), retried elsewhere, and every execution
// settles exactly once.
func TestConsumerKilledUnderLoad(t *testing.T) {
	skipShort(t)
	s := newStack(t, stackOptions{})
	s.startAll("consumer-1", "consumer-2")
	c1 := s.procsNamed("consumer-1")[0]

	payments := samplePayments(t, 400)
	res := newInvokeResult()
	waitInvoked := invokeInBackground(t, s, payments, 16, res)

	// Pause consumer-1 while it holds attempts, so the set of attempts
	// it orphans is known exactly, then kill it.
	ctx := t.Context()
	orphaned := holdPaused(t, s, c1)
	c1.kill(t)
	killedAt := time.Now()
	t.Logf("killed consumer-1 holding %d running attempts", len(orphaned))

	s.startConsumer("consumer-1") // same worker id, new process
	waitInvoked()
	invoked := res.executions()
	require.Len(t, invoked, len(payments))
	took := s.waitAllSettled(t, len(invoked), settleTimeout)
	t.Logf("all %d executions settled %v after the kill (%v after the last invocation)", len(invoked),
		time.Since(killedAt).Round(time.Millisecond), took.Round(time.Millisecond))

	s.requireExactlyOnce(t, invoked)
	// Every attempt the killed process held was reaped by lease expiry
	// (the reaper did its job), and its execution went on to a next one.
	for _, a := range orphaned {
		var outcome, class string
		require.NoError(t, s.db.QueryRow(ctx, `SELECT outcome, coalesce(failure_class, '') FROM attempts
 WHERE execution_id = $1 AND attempt = $2`, a.Execution, a.Attempt).Scan(&outcome, &class))
		require.Equal(t, []string{"LEASE_EXPIRED", "lease.expired"}, []string{outcome, class},
			"attempt %d of %s, orphaned by the kill", a.Attempt, a.Execution)
		require.Greater(t, s.queryInt(t, `SELECT attempt FROM executions WHERE id = $1`, a.Execution), a.Attempt,
			"execution %s went on after its orphaned attempt", a.Execution)
	}
	reaped := 0
	for _, p := range append(s.procsNamed("consumer-1"), s.procsNamed("consumer-2")...) {
		reaped += len(p.logLines("expired lease reaped"))
	}
	require.GreaterOrEqual(t, reaped, len(orphaned), "the reapers logged each reap")
}

// TestPostgresRestartedDuringLoad stops PostgreSQL for a few seconds in the
// middle of the load and starts it again. The daemons are not touched:
// their /readyz turns 503 during the outage and 200 after, invocations
// answered UNAVAILABLE are retried with the same idempotency key, and
// everything settles exactly once.
func TestPostgresRestartedDuringLoad(t *testing.T) {
	skipShort(t)
	ctx := t.Context()
	// An own cluster: stopping the shared one would disturb other tests.
	cl, err := pgcluster.Start(ctx, pgcluster.Options{})
	if err != nil {
		t.Skipf("cannot start a private PostgreSQL cluster (PostgreSQL binaries needed): %v", err)
	}
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := cl.Stop(sctx); err != nil {
			t.Errorf("stop private cluster: %v", err)
		}
	})
	conn, err := pgx.Connect(ctx, cl.URL("postgres"))
	require.NoError(t, err)
	_, err = conn.Exec(ctx, "CREATE DATABASE capstan")
	conn.Close(ctx)
	require.NoError(t, err)
	dbURL := cl.URL("capstan")
	_, err = pgstore.Migrate(ctx, dbURL, nil)
	require.NoError(t, err)

	s := newStack(t, stackOptions{DatabaseURL: dbURL})
	s.startAll("consumer-1", "consumer-2")
	s.mu.Lock()
	daemons := []*proc{}
	for _, p := range s.procs {
		if p.name != "provider" {
			daemons = append(daemons, p)
		}
	}
	s.mu.Unlock()

	payments := samplePayments(t, 300)
	res := newInvokeResult()
	// The first half before the outage; wait until work is in flight.
	waitFirst := invokeInBackground(t, s, payments[:150], 8, res)
	require.True(t, pollUntil(ctx, 30*time.Second, 10*time.Millisecond, func() bool {
		return s.queryIntNow(ctx, `SELECT count(*) FROM completion_events`) >= 20 &&
			s.queryIntNow(ctx, `SELECT count(*) FROM attempts WHERE outcome = 'RUNNING'`) > 0
	}), "no work in flight: %s", s.progress(ctx))

	require.NoError(t, cl.StopServer(ctx))
	downAt := time.Now()
	t.Log("PostgreSQL stopped")
	// The second half is invoked during the outage: UNAVAILABLE, retried.
	waitSecond := invokeInBackground(t, s, payments[150:], 8, res)
	requireReadiness(t, daemons, http.StatusServiceUnavailable, 20*time.Second)
	if d := 3*time.Second - time.Since(downAt); d > 0 {
		time.Sleep(d) // the outage itself: nothing to wait for
	}
	require.NoError(t, cl.StartServer(ctx))
	t.Logf("PostgreSQL started again after %v", time.Since(downAt).Round(time.Millisecond))
	requireReadiness(t, daemons, http.StatusOK, 30*time.Second)

	waitFirst()
	waitSecond()
	require.Positive(t, res.retried(), "invocations during the outage were answered UNAVAILABLE and retried")
	invoked := res.executions()
	require.Len(t, invoked, len(payments))
	took := s.waitAllSettled(t, len(invoked), settleTimeout)
	t.Logf("all %d executions settled %v after the restart; %d invocations retried",
		len(invoked), took.Round(time.Millisecond), res.retried())
	s.requireExactlyOnce(t, invoked)
	for _, p := range daemons {
		require.False(t, p.exited(), "%s recovered by itself (not restarted)", p.name)
	}
}

// requireReadiness polls /readyz of every process until each has answered
// want at least once.
func requireReadiness(t *testing.T, procs []*proc, want int, timeout time.Duration) {
	t.Helper()
	var wg sync.WaitGroup
	got := make([]int, len(procs))
	for i, p := range procs {
		wg.Go(func() {
			pollUntil(t.Context(), timeout, 100*time.Millisecond, func() bool {
				got[i], _ = httpStatus(p.readyURL)
				return got[i] == want
			})
		})
	}
	wg.Wait()
	for i, p := range procs {
		require.Equal(t, want, got[i], "%s /readyz within %v", p.name, timeout)
	}
}

// TestLeaseExpiresWhileWorkerPaused freezes (SIGSTOP) the only consumer in
// the middle of a slow adapter call. A second consumer's reaper fails the
// expired attempt (LEASE_EXPIRED), Kafka hands it the partitions after the
// frozen member's session timeout, and attempt 2 runs and settles. When the
// first consumer resumes, its late answer changes nothing.
func TestLeaseExpiresWhileWorkerPaused(t *testing.T) {
	skipShort(t)
	s := newStack(t, stackOptions{
		ProviderLatencyMin: 3 * time.Second, ProviderLatencyMax: 3 * time.Second,
		RetryableFraction: -1, AttemptTimeout: 10 * time.Second,
	})
	s.startAll("consumer-1")
	c1 := s.procsNamed("consumer-1")[0]
	ctx := t.Context()

	var p payment.Payment
	for _, c := range samplePayments(t, 20) {
		if payment.Decide(c).Succeeded {
			p = c
			break
		}
	}
	res := newInvokeResult()
	require.NoError(t, s.invoke(ctx, []payment.Payment{p}, 1, res))
	var id string
	for id = range res.executions() {
	}

	// Attempt 1 runs on consumer-1 and its lease has been renewed to the
	// configured second (the first lease is longer; see the report).
	require.True(t, pollUntil(ctx, 30*time.Second, 10*time.Millisecond, func() bool {
		return s.queryIntNow(ctx, `SELECT count(*) FROM executions e JOIN attempts a ON a.execution_id = e.id
 WHERE e.id = $1 AND e.attempt = 1 AND e.status = 'RUNNING' AND a.worker = 'consumer-1' AND a.outcome = 'RUNNING'
   AND e.lease_expires_at < now() + interval '5 seconds'`, id) == 1
	}), "attempt 1 never ran on consumer-1 under a renewed lease: %s", s.progress(ctx))
	c1.pause(t)
	pausedAt := time.Now()
	c2 := s.startConsumer("consumer-2")

	require.True(t, pollUntil(ctx, 30*time.Second, 50*time.Millisecond, func() bool {
		return s.queryIntNow(ctx, `SELECT count(*) FROM attempts WHERE execution_id = $1 AND attempt = 1
   AND outcome = 'LEASE_EXPIRED' AND failure_class = 'lease.expired'`, id) == 1
	}), "attempt 1 was not reaped: %s", s.progress(ctx))
	require.NotEmpty(t, c2.logLines("expired lease reaped"), "consumer-2's reaper reaped it (consumer-1 is frozen)")
	t.Logf("attempt 1 reaped %v after the pause", time.Since(pausedAt).Round(time.Millisecond))

	s.waitAllSettled(t, 1, 60*time.Second)
	t.Logf("settled %v after the pause", time.Since(pausedAt).Round(time.Millisecond))
	var st string
	var attempt int
	var version int64
	require.NoError(t, s.db.QueryRow(ctx, `SELECT status, attempt, version FROM executions WHERE id = $1`, id).
		Scan(&st, &attempt, &version))
	require.Equal(t, "SUCCEEDED", st)
	require.Equal(t, 2, attempt)
	require.Equal(t, 1, s.queryInt(t, `SELECT count(*) FROM attempts WHERE execution_id = $1 AND attempt = 2
   AND worker = 'consumer-2' AND outcome = 'SUCCEEDED'`, id), "attempt 2 ran and settled on consumer-2")

	// The frozen worker wakes up with its answer (or its lease-lost
	// heartbeat): it must notice it lost and write nothing.
	c1.resume(t)
	lost := []string{"lease lost during the adapter call", "settlement lost", "retry not scheduled"}
	var lines []string
	require.True(t, pollUntil(ctx, 30*time.Second, 50*time.Millisecond, func() bool {
		for _, l := range lost {
			lines = append(lines, c1.logLines(l)...)
		}
		return len(lines) > 0
	}), "consumer-1 never said it lost attempt 1; its log:\n%s", tail(c1.logPath, 20))
	t.Logf("consumer-1 after SIGCONT: %s", lines[0])
	var st2 string
	var attempt2 int
	var version2 int64
	require.NoError(t, s.db.QueryRow(ctx, `SELECT status, attempt, version FROM executions WHERE id = $1`, id).
		Scan(&st2, &attempt2, &version2))
	require.Equal(t, []any{st, attempt, version}, []any{st2, attempt2, version2}, "the late answer changed nothing")
	c1.waitReady(t) // and it is a healthy group member again
	s.requireExactlyOnce(t, res.executions())
	require.Equal(t, 1, s.deliveries(t, id), "one delivery of the one event")
}

// TestConsumerSIGTERMDrains terminates one of two consumers while it holds
// attempts: it finishes them (none is left to lease expiry), exits 0 within
// its shutdown grace, and every execution settles exactly once.
func TestConsumerSIGTERMDrains(t *testing.T) {
	skipShort(t)
	// A slower provider, so that attempts are surely in flight.
	s := newStack(t, stackOptions{ProviderLatencyMin: 100 * time.Millisecond, ProviderLatencyMax: 300 * time.Millisecond})
	s.startAll("consumer-1", "consumer-2")
	c1 := s.procsNamed("consumer-1")[0]

	payments := samplePayments(t, 300)
	res := newInvokeResult()
	waitInvoked := invokeInBackground(t, s, payments, 16, res)
	// SIGTERM while paused holding attempts, so the signal certainly
	// arrives with work in flight.
	ctx := t.Context()
	held := len(holdPaused(t, s, c1))
	start := time.Now()
	c1.signal(t, syscall.SIGTERM)
	c1.resume(t)
	select {
	case <-c1.done:
	case <-time.After(stopGrace):
		t.Fatalf("consumer-1 did not exit within %v of SIGTERM", stopGrace)
	}
	took := time.Since(start)
	require.Zero(t, c1.cmd.ProcessState.ExitCode(), "consumer-1 exits 0 on SIGTERM:\n%s", tail(c1.logPath, 20))
	require.Less(t, took, 11*time.Second, "consumer-1 stops within the daemon's shutdown grace (10s)")
	require.NotEmpty(t, c1.logLines(`"consumer stopped"`))
	stoppedAt := time.Now()
	// It drained: every attempt it held finished before it exited.
	require.Zero(t, s.runningAttempts(ctx, "consumer-1"), "consumer-1 left no attempt RUNNING")
	t.Logf("consumer-1 held %d attempts at SIGTERM and stopped in %v", held, took.Round(time.Millisecond))

	waitInvoked()
	invoked := res.executions()
	require.Len(t, invoked, len(payments))
	s.waitAllSettled(t, len(invoked), settleTimeout)
	t.Logf("all %d executions settled %v after the stop", len(invoked), time.Since(stoppedAt).Round(time.Millisecond))
	s.requireExactlyOnce(t, invoked)
	require.Zero(t, s.queryInt(t, `SELECT count(*) FROM attempts WHERE worker = 'consumer-1' AND outcome = 'LEASE_EXPIRED'`),
		"no attempt of the drained consumer was left to lease expiry")
}

// TestConsumerRegressions guards two consumer bugs that the failure tests
// found: the first lease of an attempt was at least 60 s whatever the
// configured lease_duration, and a session timeout under 3 s made the
// consumer exit at start (kgo's default heartbeat interval exceeded it).
func TestConsumerRegressions(t *testing.T) {
	skipShort(t)
	for _, tc := range []struct {
		name string
		run  func(t *testing.T)
	}{{
		// internal/consumer/consumer.go, leaseFor: the lease taken at
		// attempt start was max(execution.DefaultLeaseDuration (60s), every
		// configured lease_duration), so with lease_duration 1s an attempt
		// orphaned before its first heartbeat (at a third of the lease) was
		// reaped only after a minute.
		name: "FirstLeaseIsTheConfiguredOne",
		run: func(t *testing.T) {
			s := newStack(t, stackOptions{ProviderLatencyMin: 2 * time.Second, ProviderLatencyMax: 2 * time.Second,
				RetryableFraction: -1})
			s.startAll("consumer-1")
			res := newInvokeResult()
			require.NoError(t, s.invoke(t.Context(), samplePayments(t, 1), 1, res))
			ctx := t.Context()
			require.True(t, pollUntil(ctx, 30*time.Second, 5*time.Millisecond, func() bool {
				return s.runningAttempts(ctx, "consumer-1") == 1
			}), "attempt 1 never started: %s", s.progress(ctx))
			var lease float64
			require.NoError(t, s.db.QueryRow(ctx, `SELECT extract(epoch FROM e.lease_expires_at - a.started_at)::float8
  FROM executions e JOIN attempts a ON a.execution_id = e.id AND a.attempt = e.attempt`).Scan(&lease))
			require.LessOrEqual(t, lease, (s.opts.LeaseDuration + 2*time.Second).Seconds(),
				"lease taken at attempt start, in seconds, with lease_duration %v", s.opts.LeaseDuration)
		},
	}, {
		// internal/consumer/consumer.go, ClientOpts: kgo.SessionTimeout is
		// set from consumer.session_timeout but the heartbeat interval is
		// left at kgo's 3s, and kgo refuses a session timeout below it;
		// config.Validate accepts 1s..30m, so 1s-3s passes validation and
		// the consumer exits 1 at start ("heartbeat interval 3s is
		// erroneously larger than the session timeout 2s").
		name: "SessionTimeoutOf2s",
		run: func(t *testing.T) {
			s := newStack(t, stackOptions{SessionTimeout: 2 * time.Second})
			s.startProvider()
			s.startConsumer("consumer-1") // fails the test if it exits during start
		},
	}} {
		t.Run(tc.name, tc.run)
	}
}
