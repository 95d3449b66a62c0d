package gateway_test

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/capstan-dev/capstan/internal/daemon"
	"github.com/capstan-dev/capstan/internal/gateway"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/telemetry/telemetrytest"
	"github.com/capstan-dev/capstan/internal/testutil/pgtest"
	executionv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/execution/v1"
)

// TestAcceptedMetric invokes through the gateway's gRPC server with a
// private MeterProvider and reads capstan_gateway_executions_accepted_total
// from the admin handler's /metrics.
func TestAcceptedMetric(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tm := telemetrytest.New(t)
	st, err := pgstore.Open(ctx, pgtest.NewDatabase(t, migrate), nil)
	require.NoError(t, err)
	t.Cleanup(st.Close)
	_, err = st.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: "a", APIKey: "key-a"})
	require.NoError(t, err)
	svc := gateway.NewExecutionService(st, testConfig(), nil, slog.New(slog.DiscardHandler),
		gateway.WithMeterProvider(tm.MeterProvider))
	t.Cleanup(svc.Close)
	srv := gateway.NewServerForTest(svc, st, 1024)
	executionv1.RegisterExecutionServiceServer(srv, svc)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { cc.Close() })
	client := executionv1.NewExecutionServiceClient(cc)

	const n = 3
	for i := range n {
		_, err := client.InvokeCapability(as("key-a"), &executionv1.InvokeCapabilityRequest{
			Capability: "payments.send", Input: []byte(fmt.Sprintf(`{"i":%d}`, i)), IdempotencyKey: fmt.Sprint(i)})
		require.NoError(t, err)
	}
	_, err = client.InvokeCapability(as("key-a"), &executionv1.InvokeCapabilityRequest{
		Capability: "payments.send", Input: []byte(`{"i":0}`), IdempotencyKey: "0"})
	require.NoError(t, err)
	_, err = client.InvokeCapability(as("key-a"), &executionv1.InvokeCapabilityRequest{Capability: "nope"})
	require.Error(t, err, "refused invocations are not counted")

	health := daemon.NewHealth(st.Ping)
	health.SetMetrics(tm.Handler)
	s := telemetrytest.Scrape(t, health.Handler())
	for _, tt := range []struct {
		acceptance string
		want       float64
	}{{"accepted", n}, {"duplicate", 1}} {
		got, found := s.Sum("capstan_gateway_executions_accepted_total", map[string]string{
			"acceptance": tt.acceptance, "capability": "payments.send", "mode": "ASYNC"})
		require.True(t, found, tt.acceptance)
		require.Equal(t, tt.want, got, tt.acceptance)
	}
	total, _ := s.Sum("capstan_gateway_executions_accepted_total", nil)
	require.Equal(t, float64(n+1), total)
}
