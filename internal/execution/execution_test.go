package execution_test

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/capstan-dev/capstan/internal/execution"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestTransitions(t *testing.T) {
	t.Parallel()
	tests := []struct {
		from, to execution.Status
		ok       bool
	}{
		{execution.StatusQueued, execution.StatusRunning, true},
		{execution.StatusRetryScheduled, execution.StatusRunning, true},
		{execution.StatusRunning, execution.StatusRunning, false},
		{execution.StatusRunning, execution.StatusWaitingExternal, true},
		{execution.StatusQueued, execution.StatusWaitingExternal, false},
		{execution.StatusWaitingExternal, execution.StatusRetryScheduled, true},
		{execution.StatusQueued, execution.StatusRetryScheduled, false},
		{execution.StatusQueued, execution.StatusCancelled, true},
		{execution.StatusRunning, execution.StatusSucceeded, true},
		{execution.StatusSucceeded, execution.StatusFailed, false},
		{execution.StatusFailed, execution.StatusRunning, false},
		{execution.StatusTimedOut, execution.StatusQueued, false},
	}
	for _, tc := range tests {
		require.Equal(t, tc.ok, execution.CanTransition(tc.from, tc.to), "%s → %s", tc.from, tc.to)
	}
	for _, s := range execution.Statuses {
		p, err := execution.ParseStatus(string(s))
		require.NoError(t, err)
		require.Equal(t, s, p)
		require.Equal(t, s.Terminal(), s.EventType() != "")
	}
	_, err := execution.ParseStatus("DONE")
	require.ErrorContains(t, err, `"DONE"`)
}

func TestPolicyValidateNamesTheField(t *testing.T) {
	t.Parallel()
	tests := []struct {
		field  string
		mutate func(p *execution.Policy)
	}{
		{"mode", func(p *execution.Policy) { p.Mode = "LATER" }},
		{"max_attempts", func(p *execution.Policy) { p.MaxAttempts = 0 }},
		{"retry_delays", func(p *execution.Policy) { p.RetryDelays = nil }},
		{"retry_delays[1]", func(p *execution.Policy) { p.RetryDelays = []time.Duration{time.Second, -1} }},
		{"jitter", func(p *execution.Policy) { p.Jitter = 0.9 }},
		{"attempt_timeout", func(p *execution.Policy) { p.AttemptTimeout = 0 }},
		{"lease_duration", func(p *execution.Policy) { p.LeaseDuration = 0 }},
		{"async_budget", func(p *execution.Policy) { p.AsyncBudget = 48 * time.Hour }},
	}
	for _, tc := range tests {
		p := execution.DefaultPolicy()
		tc.mutate(&p)
		err := p.Validate(24 * time.Hour)
		require.ErrorIs(t, err, execution.ErrInvalidPolicy, tc.field)
		require.Contains(t, err.Error(), tc.field)
	}
	require.NoError(t, execution.DefaultPolicy().Validate(24*time.Hour))
}

func TestDefaultRetrySchedule(t *testing.T) {
	t.Parallel()
	p := execution.DefaultPolicy()
	p.Jitter = 0
	want := []time.Duration{time.Minute, 5 * time.Minute, 30 * time.Minute, 2 * time.Hour, 6 * time.Hour, 6 * time.Hour, 6 * time.Hour}
	for i, w := range want {
		require.Equal(t, w, p.RetryDelay(i+1, nil), "after failure %d", i+1)
	}
	p.Jitter = 0.1
	r := rand.New(rand.NewPCG(1, 2))
	for range 1000 {
		d := p.RetryDelay(1, r)
		require.GreaterOrEqual(t, d, 54*time.Second)
		require.LessOrEqual(t, d, 66*time.Second)
	}
	require.True(t, p.Exhausted(10))
	require.False(t, p.Exhausted(9))
}

// FuzzRetryDelay checks the delay arithmetic for any attempt number,
// delay and jitter: never negative, never past MaxDelay plus its jitter,
// and the decision never schedules in the past.
func FuzzRetryDelay(f *testing.F) {
	f.Add(1, int64(time.Minute), 0.1, uint64(1))
	f.Add(math.MaxInt, int64(math.MaxInt64), 0.5, uint64(7))
	f.Add(-5, int64(-1), 0.0, uint64(0))
	f.Fuzz(func(t *testing.T, failed int, delay int64, jitter float64, seed uint64) {
		if math.IsNaN(jitter) || jitter < 0 || jitter > 0.5 {
			jitter = 0.1
		}
		p := execution.DefaultPolicy()
		p.RetryDelays = []time.Duration{time.Second, time.Duration(delay)}
		p.Jitter = jitter
		d := p.RetryDelay(failed, rand.New(rand.NewPCG(seed, seed)))
		require.GreaterOrEqual(t, d, time.Duration(0))
		require.LessOrEqual(t, d, execution.MaxDelay+time.Duration(float64(execution.MaxDelay)*jitter)+time.Second)
		now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
		dec := execution.DecideRetry(max(failed, 1), 10, now, d, now.Add(24*time.Hour))
		require.Contains(t, []execution.RetryDecision{execution.RetrySchedule, execution.RetryExhausted, execution.RetryBudgetExceeded}, dec)
		require.False(t, now.Add(d).Before(now), "never schedules in the past")
	})
}

func TestFailureBounded(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("é", 1000) // 2000 bytes
	f := execution.Failure{Class: "", Message: long + "\x00\xff"}.Bounded()
	require.Equal(t, "adapter.unspecified", f.Class)
	require.LessOrEqual(t, len(f.Message), execution.MaxMessageBytes)
	require.True(t, utf8.ValidString(f.Message))
	require.NotContains(t, f.Message, "\x00")
}

func TestDecideRetry(t *testing.T) {
	t.Parallel()
	now := time.Now()
	tests := []struct {
		name     string
		attempt  int
		delay    time.Duration
		deadline time.Time
		want     execution.RetryDecision
	}{
		{"schedules", 1, time.Minute, now.Add(time.Hour), execution.RetrySchedule},
		{"ceiling", 10, time.Minute, now.Add(time.Hour), execution.RetryExhausted},
		{"budget", 3, 2 * time.Hour, now.Add(time.Hour), execution.RetryBudgetExceeded},
	}
	for _, tc := range tests {
		require.Equal(t, tc.want, execution.DecideRetry(tc.attempt, 10, now, tc.delay, tc.deadline), tc.name)
	}
}
