package telemetry_test

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric"
	"go.uber.org/goleak"

	"github.com/capstan-dev/capstan/internal/telemetry"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func env(kv map[string]string) func(string) string {
	return func(k string) string { return kv[k] }
}

// scrape GETs /metrics from h and returns the body.
func scrape(t *testing.T, h http.Handler) string {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	require.Equal(t, http.StatusOK, rec.Code)
	return rec.Body.String()
}

// TestPrometheusNames pins the translation of OpenTelemetry names and units
// that deploy/k8s/base/prometheusrule.yaml relies on.
func TestPrometheusNames(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tel, err := telemetry.New(ctx, "capstan-test", telemetry.Options{Getenv: env(nil)})
	require.NoError(t, err)
	defer func() { require.NoError(t, tel.Shutdown(ctx)) }()
	m := tel.Meter("test")
	c, err := m.Int64Counter("capstan.test.events.dead", metric.WithUnit("{event}"))
	require.NoError(t, err)
	c.Add(ctx, 2)
	_, err = m.Float64ObservableGauge("capstan.test.last_pass.timestamp", metric.WithUnit("s"),
		metric.WithFloat64Callback(func(_ context.Context, o metric.Float64Observer) error { o.Observe(42); return nil }))
	require.NoError(t, err)
	g, err := m.Int64Gauge("capstan.test.lag.records", metric.WithUnit("{record}"))
	require.NoError(t, err)
	g.Record(ctx, 7)
	h, err := m.Float64Histogram("capstan.test.dispatch.lag", metric.WithUnit("s"))
	require.NoError(t, err)
	h.Record(ctx, 0.5)

	body := scrape(t, tel.Handler())
	for _, want := range []string{
		"capstan_test_events_dead_total{",
		"capstan_test_last_pass_timestamp_seconds{",
		"capstan_test_lag_records{",
		"capstan_test_dispatch_lag_seconds_bucket{",
		"go_goroutines",
	} {
		require.Contains(t, body, want)
	}
}

func TestTracerFromEnv(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		env     map[string]string
		wantErr bool
		record  bool // whether spans are recorded
	}{
		{name: "default none", env: nil},
		{name: "explicit none", env: map[string]string{"OTEL_TRACES_EXPORTER": "none"}},
		{name: "console", env: map[string]string{"OTEL_TRACES_EXPORTER": "console"}, record: true},
		{name: "otlp http", env: map[string]string{"OTEL_TRACES_EXPORTER": "otlp"}, record: true},
		{name: "otlp grpc", env: map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, record: true},
		{name: "bad protocol", env: map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "carrier-pigeon"}, wantErr: true},
		{name: "unknown exporter", env: map[string]string{"OTEL_TRACES_EXPORTER": "zipkin"}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			var out bytes.Buffer
			tel, err := telemetry.New(ctx, "capstan-test", telemetry.Options{Getenv: env(tt.env), Console: &out})
			if tt.wantErr {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			_, span := tel.TracerProvider.Tracer("test").Start(ctx, "op")
			require.Equal(t, tt.record, span.IsRecording())
			if tt.name != "console" {
				// Nothing listens for OTLP here: an unended span is never
				// queued for export, so Shutdown has nothing to send.
				require.NoError(t, tel.Shutdown(ctx))
				return
			}
			span.End()
			require.NoError(t, tel.Shutdown(ctx))
			require.Contains(t, out.String(), `"Name":"op"`)
		})
	}
}

func TestMetricsHandlerNotInstalled(t *testing.T) {
	// Not parallel-sensitive: no test in this package calls Install.
	rec := httptest.NewRecorder()
	telemetry.MetricsHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	require.Equal(t, http.StatusNotFound, rec.Code)
}
