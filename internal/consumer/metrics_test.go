package consumer_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/daemon"
	"github.com/capstan-dev/capstan/internal/telemetry/telemetrytest"
	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
)

// TestPipelineMetrics runs the dispatcher and the consumer against a
// private MeterProvider and reads their series from /metrics, served by the
// daemons' admin handler as in production.
func TestPipelineMetrics(t *testing.T) {
	t.Parallel()
	tm := telemetrytest.New(t)
	// Six executions: i%3 == 0 fails its first attempt retryably, i == 1
	// fails for good, the rest succeed at once.
	p := startPipelineMetered(t, func(req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
		var i int
		if _, err := fmt.Sscanf(string(req.GetInput()), `{"i":%d}`, &i); err != nil {
			return nil, err
		}
		switch {
		case i == 1:
			return &adapterv1.ExecuteResponse{Outcome: &adapterv1.ExecuteResponse_Failure{Failure: &adapterv1.Failure{
				Class: "provider.rejected"}}}, nil
		case i%3 == 0 && req.GetAttempt() == 1:
			return &adapterv1.ExecuteResponse{Outcome: &adapterv1.ExecuteResponse_Failure{Failure: &adapterv1.Failure{
				Class: "provider.unavailable", Retryable: true}}}, nil
		}
		return ok(req)
	}, tm.MeterProvider)
	p.waitSettled(t, p.invoke(t, 6))

	health := daemon.NewHealth(func(context.Context) error { return nil })
	stop, err := health.Instrument(tm.MeterProvider, "consumer")
	require.NoError(t, err)
	defer stop()
	health.SetMetrics(tm.Handler)
	require.NoError(t, health.Check(context.Background()))
	admin := health.Handler()

	// The counters are bumped just after each settlement commits: poll
	// until the last one is in, then check every series exactly.
	var s telemetrytest.Samples
	require.Eventually(t, func() bool {
		s = telemetrytest.Scrape(t, admin)
		n, _ := s.Sum("capstan_consumer_settled_total", nil)
		_, lag := s.Sum("capstan_consumer_lag_records", nil)
		return n == 6 && lag
	}, 30*time.Second, 20*time.Millisecond)

	tests := []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"capstan_consumer_settled_total", map[string]string{"status": "SUCCEEDED"}, 5},
		{"capstan_consumer_settled_total", map[string]string{"status": "FAILED"}, 1},
		{"capstan_consumer_attempts_total", map[string]string{"outcome": "succeeded", "failure_class": "none"}, 5},
		{"capstan_consumer_attempts_total", map[string]string{"outcome": "failed", "failure_class": "provider.rejected"}, 1},
		{"capstan_consumer_attempts_total", map[string]string{"outcome": "retryable_failure", "failure_class": "provider.unavailable"}, 2},
		{"capstan_readyz_status", map[string]string{"component": "consumer"}, 1},
	}
	for _, tt := range tests {
		got, found := s.Sum(tt.name, tt.labels)
		require.True(t, found, "%s%v missing", tt.name, tt.labels)
		require.Equal(t, tt.want, got, "%s%v", tt.name, tt.labels)
	}

	dispatched, _ := s.Sum("capstan_dispatcher_dispatched_total", nil)
	require.GreaterOrEqual(t, dispatched, 8.0, "6 first attempts and 2 retries")
	lagCount, found := s.Sum("capstan_dispatcher_dispatch_lag_seconds_count", nil)
	require.True(t, found)
	require.Equal(t, dispatched, lagCount, "one lag observation per published record")

	beat, found := s.Sum("capstan_dispatcher_last_pass_timestamp_seconds", nil)
	require.True(t, found, "dispatcher heartbeat")
	now := float64(time.Now().UnixNano()) / 1e9
	require.InDelta(t, now, beat, 60, "the heartbeat is within the last minute")
	require.LessOrEqual(t, beat, now)

	for _, l := range s.Find("capstan_consumer_lag_records", nil) {
		require.Equal(t, "capstan.executions", l.Labels["topic"])
		require.Equal(t, "g", l.Labels["group"])
		require.GreaterOrEqual(t, l.Value, 0.0)
	}
}

// TestPipelineMetricsLeaseReap: an adapter that accepts and never renews
// loses the attempt to the reaper, which counts the reap.
func TestPipelineMetricsLeaseReap(t *testing.T) {
	t.Parallel()
	tm := telemetrytest.New(t)
	p := startPipelineMetered(t, func(req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
		if req.GetAttempt() == 1 {
			return accepted(), nil
		}
		return ok(req)
	}, tm.MeterProvider, withCallbacks, func(c *config.Config) { c.Capabilities[0].LeaseDuration = 300 * time.Millisecond })
	p.waitSettled(t, p.invoke(t, 1))

	var s telemetrytest.Samples
	require.Eventually(t, func() bool {
		s = telemetrytest.Scrape(t, tm.Handler)
		n, _ := s.Sum("capstan_consumer_settled_total", map[string]string{"status": "SUCCEEDED"})
		return n == 1
	}, 30*time.Second, 20*time.Millisecond)
	for _, tt := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"capstan_consumer_lease_reaps_total", nil, 1},
		{"capstan_consumer_attempts_total", map[string]string{"outcome": "accepted"}, 1},
		{"capstan_consumer_attempts_total", map[string]string{"outcome": "lease_expired", "failure_class": "lease.expired"}, 1},
		{"capstan_consumer_attempts_total", map[string]string{"outcome": "succeeded"}, 1},
	} {
		got, found := s.Sum(tt.name, tt.labels)
		require.True(t, found, "%s%v missing", tt.name, tt.labels)
		require.Equal(t, tt.want, got, "%s%v", tt.name, tt.labels)
	}
}
