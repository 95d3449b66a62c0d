package gateway_test

import (
	"context"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/gateway"
	"github.com/capstan-dev/capstan/internal/pgcluster"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/testutil/pgtest"
	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
	executionv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/execution/v1"
)

func TestMain(m *testing.M) { os.Exit(pgtest.RunMain(m)) }

func migrate(ctx context.Context, url string) error {
	_, err := pgstore.Migrate(ctx, url, nil)
	return err
}

type bundle struct {
	client executionv1.ExecutionServiceClient
	url    string
	nudges *int
}

func testConfig() *config.Config {
	return &config.Config{
		Gateway: config.Gateway{MaxInputBytes: 1024},
		Capabilities: []config.Capability{{Name: "payments.send", Release: "v1", Adapter: "127.0.0.1:1"},
			{Name: "payments.process-file", Release: "v1", Steps: &config.ReleaseSteps{}}},
	}
}

// serve starts the gateway's gRPC server on loopback over the store at url.
func serve(t *testing.T, url string) bundle { return serveWith(t, url, testConfig()) }

func serveWith(t *testing.T, url string, cfg *config.Config) bundle {
	t.Helper()
	ctx := context.Background()
	st, err := pgstore.Open(ctx, url, nil)
	require.NoError(t, err)
	t.Cleanup(st.Close)
	_, err = st.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: "a", APIKey: "key-a"})
	require.NoError(t, err)
	_, err = st.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: "b", APIKey: "key-b"})
	require.NoError(t, err)
	var mu sync.Mutex
	nudges := 0
	svc := gateway.NewExecutionService(st, cfg, func() { mu.Lock(); nudges++; mu.Unlock() }, slog.New(slog.DiscardHandler))
	srv := gateway.NewServerForTest(svc, st, 1024)
	executionv1.RegisterExecutionServiceServer(srv, svc)
	t.Cleanup(svc.Close)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { cc.Close() })
	return bundle{client: executionv1.NewExecutionServiceClient(cc), url: url, nudges: &nudges}
}

func as(key string) context.Context {
	return metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+key)
}

func TestInvokeAcceptsAfterCommit(t *testing.T) {
	t.Parallel()
	b := serve(t, pgtest.NewDatabase(t, migrate))
	resp, err := b.client.InvokeCapability(as("key-a"), &executionv1.InvokeCapabilityRequest{
		Capability: "payments.send", Input: []byte(`{"id":"1"}`), IdempotencyKey: "k1"})
	require.NoError(t, err)
	require.Equal(t, executionv1.InvokeAcceptance_INVOKE_ACCEPTANCE_ACCEPTED, resp.Acceptance)
	require.Equal(t, executionv1.ExecutionStatus_EXECUTION_STATUS_QUEUED, resp.Status)
	require.Equal(t, 1, *b.nudges)

	// Committed before the answer: the row and its dispatch record exist.
	conn, err := pgx.Connect(context.Background(), b.url)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	var n int
	require.NoError(t, conn.QueryRow(context.Background(),
		`SELECT count(*) FROM dispatch_records WHERE execution_id = $1 AND attempt = 1`, resp.ExecutionId).Scan(&n))
	require.Equal(t, 1, n)

	again, err := b.client.InvokeCapability(as("key-a"), &executionv1.InvokeCapabilityRequest{
		Capability: "payments.send", Input: []byte(`{"id":"1"}`), IdempotencyKey: "k1"})
	require.NoError(t, err)
	require.Equal(t, resp.ExecutionId, again.ExecutionId)
	require.Equal(t, executionv1.InvokeAcceptance_INVOKE_ACCEPTANCE_DUPLICATE, again.Acceptance)
	require.Equal(t, 1, *b.nudges, "a duplicate creates no work and sends no nudge")

	_, err = b.client.InvokeCapability(as("key-a"), &executionv1.InvokeCapabilityRequest{
		Capability: "payments.send", Input: []byte(`{"id":"2"}`), IdempotencyKey: "k1"})
	require.Equal(t, codes.AlreadyExists, status.Code(err))

	got, err := b.client.GetExecution(as("key-a"), &executionv1.GetExecutionRequest{ExecutionId: resp.ExecutionId})
	require.NoError(t, err)
	require.Equal(t, "payments.send", got.Execution.Capability)
	require.Equal(t, "k1", got.Execution.IdempotencyKey)

	_, err = b.client.GetExecution(as("key-b"), &executionv1.GetExecutionRequest{ExecutionId: resp.ExecutionId})
	require.Equal(t, codes.NotFound, status.Code(err), "another application must not see it")
}

func TestInvokeRefusals(t *testing.T) {
	t.Parallel()
	b := serve(t, pgtest.NewDatabase(t, migrate))
	tests := []struct {
		name  string
		ctx   context.Context
		req   *executionv1.InvokeCapabilityRequest
		code  codes.Code
		field string
	}{
		{"no credentials", context.Background(), &executionv1.InvokeCapabilityRequest{Capability: "payments.send"}, codes.Unauthenticated, ""},
		{"unknown key", as("nope"), &executionv1.InvokeCapabilityRequest{Capability: "payments.send"}, codes.Unauthenticated, ""},
		{"missing capability", as("key-a"), &executionv1.InvokeCapabilityRequest{}, codes.InvalidArgument, "capability"},
		{"unknown capability", as("key-a"), &executionv1.InvokeCapabilityRequest{Capability: "payments.steal"}, codes.NotFound, "payments.steal"},
		{"input too large", as("key-a"), &executionv1.InvokeCapabilityRequest{Capability: "payments.send", Input: make([]byte, 1025)}, codes.InvalidArgument, "input"},
		{"key too long", as("key-a"), &executionv1.InvokeCapabilityRequest{Capability: "payments.send", IdempotencyKey: strings.Repeat("k", 257)}, codes.InvalidArgument, "idempotency_key"},
		{"NUL in key", as("key-a"), &executionv1.InvokeCapabilityRequest{Capability: "payments.send", IdempotencyKey: "a\x00b"}, codes.InvalidArgument, "idempotency_key"},
		{"content type too long", as("key-a"), &executionv1.InvokeCapabilityRequest{Capability: "payments.send", ContentType: strings.Repeat("x", 129)}, codes.InvalidArgument, "content_type"},
		{"steps: not JSON", as("key-a"), &executionv1.InvokeCapabilityRequest{Capability: "payments.process-file", Input: []byte("x")}, codes.InvalidArgument, "input"},
		{"steps: no source", as("key-a"), &executionv1.InvokeCapabilityRequest{Capability: "payments.process-file", Input: []byte(`{"output":"o.csv"}`)}, codes.InvalidArgument, "input.source"},
		{"steps: output escapes", as("key-a"), &executionv1.InvokeCapabilityRequest{Capability: "payments.process-file", Input: []byte(`{"source":"in.csv","output":"../o.csv"}`)}, codes.InvalidArgument, "input.output"},
		{"steps: another application's source", as("key-a"), &executionv1.InvokeCapabilityRequest{Capability: "payments.process-file", Input: []byte(`{"source":"b/in.csv","output":"a/o.csv"}`)}, codes.InvalidArgument, "input.source"},
		{"steps: output outside the prefix", as("key-a"), &executionv1.InvokeCapabilityRequest{Capability: "payments.process-file", Input: []byte(`{"source":"a/in.csv","output":"o.csv"}`)}, codes.InvalidArgument, "input.output"},
		{"steps: unknown field", as("key-a"), &executionv1.InvokeCapabilityRequest{Capability: "payments.process-file", Input: []byte(`{"source":"in.csv","output":"o.csv","x":1}`)}, codes.InvalidArgument, "input"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := b.client.InvokeCapability(tc.ctx, tc.req)
			require.Equal(t, tc.code, status.Code(err), "%v", err)
			require.Contains(t, status.Convert(err).Message(), tc.field)
		})
	}
	_, err := b.client.GetExecution(as("key-a"), &executionv1.GetExecutionRequest{ExecutionId: "not-a-uuid"})
	require.Equal(t, codes.InvalidArgument, status.Code(err))
	require.Contains(t, status.Convert(err).Message(), "execution_id")

	conn, err := pgx.Connect(context.Background(), b.url)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	var n int
	require.NoError(t, conn.QueryRow(context.Background(), `SELECT count(*) FROM executions`).Scan(&n))
	require.Zero(t, n, "refused calls commit nothing")
}

func TestInvokeUnavailableWhenDatabaseIsDown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cl, err := pgcluster.Start(ctx, pgcluster.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = cl.Stop(context.Background()) })
	require.NoError(t, migrate(ctx, cl.URL("postgres")))
	b := serve(t, cl.URL("postgres"))

	require.NoError(t, cl.StopServer(ctx))
	cctx, cancel := context.WithTimeout(as("key-a"), 10*time.Second)
	defer cancel()
	_, err = b.client.InvokeCapability(cctx, &executionv1.InvokeCapabilityRequest{Capability: "payments.send", IdempotencyKey: "x"})
	// Authentication reads the database too, so the refusal comes from
	// there: either way the caller sees UNAVAILABLE and retries with its key.
	require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)

	require.NoError(t, cl.StartServer(ctx))
	require.Eventually(t, func() bool {
		_, err := b.client.InvokeCapability(as("key-a"), &executionv1.InvokeCapabilityRequest{Capability: "payments.send", IdempotencyKey: "x"})
		if err != nil {
			t.Logf("still refused: %v", err)
		}
		return err == nil
	}, 20*time.Second, 100*time.Millisecond, "the gateway recovers by itself")
}

func TestCancelExecution(t *testing.T) {
	t.Parallel()
	b := serve(t, pgtest.NewDatabase(t, migrate))
	ctx := context.Background()
	st, err := pgstore.Open(ctx, b.url, nil)
	require.NoError(t, err)
	defer st.Close()
	invoke := func(key string) string {
		resp, err := b.client.InvokeCapability(as("key-a"), &executionv1.InvokeCapabilityRequest{Capability: "payments.send", IdempotencyKey: key})
		require.NoError(t, err)
		return resp.ExecutionId
	}

	// A running attempt is cancelled; its later answer changes nothing.
	running := invoke("running")
	e, err := st.AttemptStart(ctx, pgstore.AttemptStartParams{ExecutionID: uuid.MustParse(running), Attempt: 1, Owner: "w", LeaseFor: time.Minute})
	require.NoError(t, err)
	_, err = b.client.CancelExecution(as("key-b"), &executionv1.CancelExecutionRequest{ExecutionId: running})
	require.Equal(t, codes.NotFound, status.Code(err), "only the owner may cancel")
	resp, err := b.client.CancelExecution(as("key-a"), &executionv1.CancelExecutionRequest{ExecutionId: running, Reason: "changed my mind"})
	require.NoError(t, err)
	require.Equal(t, executionv1.ExecutionStatus_EXECUTION_STATUS_CANCELLED, resp.Execution.Status)
	require.Equal(t, "cancelled.by_caller", resp.Execution.Failure.Reason)
	require.Equal(t, "changed my mind", resp.Execution.Failure.Message)
	_, err = st.ExecutionSettle(ctx, pgstore.SettleParams{ExecutionID: e.ID,
		Fence: pgstore.Fence{Attempt: 1, LeaseToken: e.LeaseToken}, Status: execution.StatusSucceeded})
	require.ErrorIs(t, err, execution.ErrConflict, "the attempt's late answer is fenced out")

	again, err := b.client.CancelExecution(as("key-a"), &executionv1.CancelExecutionRequest{ExecutionId: running})
	require.NoError(t, err, "cancelling twice is idempotent")
	require.Equal(t, resp.Execution.SettledAt.AsTime(), again.Execution.SettledAt.AsTime())

	// A queued execution is cancelled and its dispatch record removed.
	queued := invoke("queued")
	_, err = b.client.CancelExecution(as("key-a"), &executionv1.CancelExecutionRequest{ExecutionId: queued})
	require.NoError(t, err)

	// A succeeded execution cannot be cancelled.
	done := invoke("done")
	d, err := st.AttemptStart(ctx, pgstore.AttemptStartParams{ExecutionID: uuid.MustParse(done), Attempt: 1, Owner: "w", LeaseFor: time.Minute})
	require.NoError(t, err)
	_, err = st.ExecutionSettle(ctx, pgstore.SettleParams{ExecutionID: d.ID, Fence: pgstore.Fence{Attempt: 1, LeaseToken: d.LeaseToken}, Status: execution.StatusSucceeded})
	require.NoError(t, err)
	_, err = b.client.CancelExecution(as("key-a"), &executionv1.CancelExecutionRequest{ExecutionId: done})
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	require.Contains(t, status.Convert(err).Message(), "SUCCEEDED")

	conn, err := pgx.Connect(ctx, b.url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	var events, records, abandoned int
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM completion_events`).Scan(&events))
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM dispatch_records`).Scan(&records))
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM attempts WHERE outcome = 'ABANDONED'`).Scan(&abandoned))
	require.Equal(t, 3, events, "one event per settled execution")
	require.Equal(t, 0, records, "settlement removes pending dispatch records")
	require.Equal(t, 1, abandoned)
}

type syncAdapter struct {
	adapterv1.UnimplementedAdapterServiceServer
}

func (syncAdapter) Execute(ctx context.Context, req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
	switch string(req.GetInput()) {
	case "fail":
		return nil, status.Error(codes.Unavailable, "provider down")
	case "slow":
		select { // longer than the release's attempt timeout
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(2 * time.Second):
		}
	}
	return &adapterv1.ExecuteResponse{Outcome: &adapterv1.ExecuteResponse_Result{Result: &adapterv1.Result{
		Output: append([]byte("quote:"), req.GetInput()...)}}}, nil
}

func TestSyncRelease(t *testing.T) {
	t.Parallel()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	gs := grpc.NewServer()
	adapterv1.RegisterAdapterServiceServer(gs, syncAdapter{})
	go func() { _ = gs.Serve(lis) }()
	defer gs.Stop()
	cfg := testConfig()
	cfg.Capabilities = append(cfg.Capabilities, config.Capability{Name: "payments.quote", Release: "v1", Mode: "SYNC",
		Adapter: lis.Addr().String(), AttemptTimeout: 300 * time.Millisecond})
	b := serveWith(t, pgtest.NewDatabase(t, migrate), cfg)

	tests := []struct {
		name, input string
		status      executionv1.ExecutionStatus
		class       string
	}{
		{"success", "eur", executionv1.ExecutionStatus_EXECUTION_STATUS_SUCCEEDED, ""},
		{"adapter error is not retried", "fail", executionv1.ExecutionStatus_EXECUTION_STATUS_FAILED, "adapter.unavailable"},
		{"attempt timeout", "slow", executionv1.ExecutionStatus_EXECUTION_STATUS_FAILED, "adapter.deadline_exceeded"},
	}
	for _, tc := range tests {
		resp, err := b.client.InvokeCapability(as("key-a"), &executionv1.InvokeCapabilityRequest{
			Capability: "payments.quote", Input: []byte(tc.input), IdempotencyKey: tc.name})
		require.NoError(t, err, tc.name)
		require.Equal(t, tc.status, resp.Status, tc.name)
		require.Equal(t, tc.status, resp.Execution.Status, tc.name)
		require.Equal(t, int32(1), resp.Execution.Attempts)
		if tc.class == "" {
			require.Equal(t, "quote:"+tc.input, string(resp.Execution.Output))
		} else {
			require.Equal(t, tc.class, resp.Execution.Failure.Class, tc.name)
		}
		again, err := b.client.InvokeCapability(as("key-a"), &executionv1.InvokeCapabilityRequest{
			Capability: "payments.quote", Input: []byte(tc.input), IdempotencyKey: tc.name})
		require.NoError(t, err)
		require.Equal(t, executionv1.InvokeAcceptance_INVOKE_ACCEPTANCE_DUPLICATE, again.Acceptance)
		require.Equal(t, resp.ExecutionId, again.ExecutionId)
		require.Equal(t, tc.status, again.Status, "the duplicate sees the settled execution, no second call")
	}
	conn, err := pgx.Connect(context.Background(), b.url)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	var events, records int
	require.NoError(t, conn.QueryRow(context.Background(), `SELECT count(*) FROM completion_events`).Scan(&events))
	require.NoError(t, conn.QueryRow(context.Background(), `SELECT count(*) FROM dispatch_records`).Scan(&records))
	require.Equal(t, 3, events, "a SYNC execution still writes its completion event")
	require.Zero(t, records, "a SYNC execution is never dispatched")
}
