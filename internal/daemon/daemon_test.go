package daemon_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"

	"github.com/capstan-dev/capstan/internal/daemon"
	"github.com/capstan-dev/capstan/internal/telemetry/telemetrytest"
	dispatchv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/dispatch/v1"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type nudger struct {
	dispatchv1.UnimplementedDispatcherServiceServer
}

// TestReflectionAndHealth is what `grpcurl -plaintext host:port list`
// does: list the services through server reflection.
func TestReflectionAndHealth(t *testing.T) {
	var ready error
	h := daemon.NewHealth(func(context.Context) error { return ready })
	srv := daemon.NewGRPCServer(h)
	dispatchv1.RegisterDispatcherServiceServer(srv, nudger{})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- daemon.ServeGRPC(ctx, srv, lis, time.Second) }()
	defer func() { cancel(); require.NoError(t, <-done) }()

	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer cc.Close()
	stream, err := reflectionpb.NewServerReflectionClient(cc).ServerReflectionInfo(context.Background())
	require.NoError(t, err)
	require.NoError(t, stream.Send(&reflectionpb.ServerReflectionRequest{
		MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{ListServices: "*"}}))
	resp, err := stream.Recv()
	require.NoError(t, err)
	require.NoError(t, stream.CloseSend())
	var names []string
	for _, s := range resp.GetListServicesResponse().GetService() {
		names = append(names, s.GetName())
	}
	require.Contains(t, names, "capstan.dispatch.v1.DispatcherService")
	require.Contains(t, names, "grpc.health.v1.Health")
	require.Contains(t, names, "grpc.reflection.v1.ServerReflection")

	hc := healthpb.NewHealthClient(cc)
	require.NoError(t, h.Check(context.Background()))
	st, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{})
	require.NoError(t, err)
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, st.Status)
	ready = errors.New("database down")
	require.Error(t, h.Check(context.Background()))
	st, err = hc.Check(context.Background(), &healthpb.HealthCheckRequest{})
	require.NoError(t, err)
	require.Equal(t, healthpb.HealthCheckResponse_NOT_SERVING, st.Status)
}

func TestReadyz(t *testing.T) {
	var ready error
	h := daemon.NewHealth(func(context.Context) error { return ready })
	ts := httptest.NewServer(h.Handler())
	defer ts.Close()
	get := func(path string) (int, string) {
		resp, err := http.Get(ts.URL + path)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	code, _ := get("/readyz")
	require.Equal(t, http.StatusOK, code)
	ready = errors.New("schema version 0, want 1")
	code, body := get("/readyz")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Contains(t, body, "schema version")
	code, _ = get("/healthz")
	require.Equal(t, http.StatusOK, code, "alive while not ready")
}

// TestMetricsEndpoint: /metrics on the admin handler serves the given
// registry, including the readiness gauge; without one it is 404.
func TestMetricsEndpoint(t *testing.T) {
	t.Parallel()
	h := daemon.NewHealth(func(context.Context) error { return nil })
	rec := httptest.NewRecorder()
	h.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	require.Equal(t, http.StatusNotFound, rec.Code, "no telemetry installed in this process")

	var ready error
	h = daemon.NewHealth(func(context.Context) error { return ready })
	tm := telemetrytest.New(t)
	stop, err := h.Instrument(tm.MeterProvider, "gateway")
	require.NoError(t, err)
	defer stop()
	h.SetMetrics(tm.Handler)
	tests := []struct {
		name  string
		check bool
		ready error
		want  float64
	}{
		{"before any check", false, nil, 0},
		{"ready", true, nil, 1},
		{"not ready", true, errors.New("database down"), 0},
	}
	for _, tt := range tests { // sequential: each step builds on the last
		ready = tt.ready
		if tt.check {
			_ = h.Check(context.Background())
		}
		s := telemetrytest.Scrape(t, h.Handler())
		got, found := s.Sum("capstan_readyz_status", map[string]string{"component": "gateway"})
		require.True(t, found, tt.name)
		require.Equal(t, tt.want, got, tt.name)
	}
}

func TestDetach(t *testing.T) {
	parent, stop := context.WithCancel(context.Background())
	d, cancel := daemon.Detach(parent, 50*time.Millisecond, time.Minute)
	defer cancel()
	stop()
	require.NoError(t, d.Err(), "the work outlives the signal…")
	select {
	case <-d.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("…but only by the drain")
	}
	d2, cancel2 := daemon.Detach(context.Background(), time.Hour, time.Hour)
	cancel2()
	require.Error(t, d2.Err(), "cancel ends it at once")
}
