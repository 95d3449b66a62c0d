package client_test

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/capstan-dev/capstan/pkg/client"
	executionv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/execution/v1"
)

// fakeGateway records what it was called with and answers fixed values.
type fakeGateway struct {
	executionv1.UnimplementedExecutionServiceServer

	mu      sync.Mutex
	auth    []string
	invokes []*executionv1.InvokeCapabilityRequest
}

func (f *fakeGateway) checkAuth(ctx context.Context) error {
	md, _ := metadata.FromIncomingContext(ctx)
	f.mu.Lock()
	f.auth = append(f.auth, md.Get("authorization")...)
	f.mu.Unlock()
	if v := md.Get("authorization"); len(v) != 1 || v[0] != "Bearer k-123" {
		return status.Error(codes.Unauthenticated, "bad key")
	}
	return nil
}

func (f *fakeGateway) InvokeCapability(ctx context.Context, req *executionv1.InvokeCapabilityRequest) (*executionv1.InvokeCapabilityResponse, error) {
	if err := f.checkAuth(ctx); err != nil {
		return nil, err
	}
	if req.GetCapability() == "" {
		return nil, status.Error(codes.InvalidArgument, "capability: required")
	}
	f.mu.Lock()
	f.invokes = append(f.invokes, req)
	f.mu.Unlock()
	return &executionv1.InvokeCapabilityResponse{
		ExecutionId: "00000000-0000-0000-0000-000000000001",
		Acceptance:  executionv1.InvokeAcceptance_INVOKE_ACCEPTANCE_ACCEPTED,
		Status:      executionv1.ExecutionStatus_EXECUTION_STATUS_QUEUED,
	}, nil
}

func (f *fakeGateway) GetExecution(ctx context.Context, req *executionv1.GetExecutionRequest) (*executionv1.GetExecutionResponse, error) {
	if err := f.checkAuth(ctx); err != nil {
		return nil, err
	}
	if req.GetExecutionId() != "00000000-0000-0000-0000-000000000001" {
		return nil, status.Error(codes.NotFound, "no such execution")
	}
	return &executionv1.GetExecutionResponse{Execution: &executionv1.Execution{
		ExecutionId: req.GetExecutionId(),
		Status:      executionv1.ExecutionStatus_EXECUTION_STATUS_SUCCEEDED,
		Attempts:    1,
	}}, nil
}

func startFake(t *testing.T) (*fakeGateway, string) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	fake := &fakeGateway{}
	executionv1.RegisterExecutionServiceServer(srv, fake)
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	t.Cleanup(func() { srv.Stop(); <-done })
	return fake, lis.Addr().String()
}

func TestClientInvokeAndGet(t *testing.T) {
	t.Parallel()
	fake, addr := startFake(t)
	ctx := t.Context()

	c, err := client.Dial(ctx, addr, "k-123")
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := c.Close(); err != nil {
			t.Error(err)
		}
	}()

	resp, err := c.Invoke(ctx, "payments.send", []byte(`{}`), "", "key-1")
	if err != nil {
		t.Fatal(err)
	}
	if resp.GetAcceptance() != executionv1.InvokeAcceptance_INVOKE_ACCEPTANCE_ACCEPTED {
		t.Errorf("acceptance = %v", resp.GetAcceptance())
	}
	fake.mu.Lock()
	got := fake.invokes[0]
	auth := append([]string(nil), fake.auth...)
	fake.mu.Unlock()
	if got.GetContentType() != client.DefaultContentType || got.GetIdempotencyKey() != "key-1" || string(got.GetInput()) != "{}" {
		t.Errorf("request = %v", got)
	}
	if len(auth) != 1 || auth[0] != "Bearer k-123" {
		t.Errorf("authorization metadata = %q", auth)
	}

	ex, err := c.Get(ctx, resp.GetExecutionId())
	if err != nil {
		t.Fatal(err)
	}
	if !client.IsTerminal(ex.GetStatus()) {
		t.Errorf("status %v not terminal", ex.GetStatus())
	}

	_, err = c.Get(ctx, "00000000-0000-0000-0000-000000000002")
	if status.Code(err) != codes.NotFound {
		t.Errorf("Get unknown: code %v, err %v", status.Code(err), err)
	}
	_, err = c.Invoke(ctx, "", nil, "", "")
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("Invoke empty capability: code %v, err %v", status.Code(err), err)
	}
}

func TestClientWrongKey(t *testing.T) {
	t.Parallel()
	_, addr := startFake(t)
	c, err := client.Dial(t.Context(), addr, "other")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, err = c.Invoke(t.Context(), "payments.send", nil, "", "")
	if status.Code(err) != codes.Unauthenticated {
		t.Fatalf("code %v, err %v", status.Code(err), err)
	}
}

func TestDialValidation(t *testing.T) {
	t.Parallel()
	if _, err := client.Dial(t.Context(), "", "k"); !errors.Is(err, client.ErrEmptyTarget) {
		t.Errorf("empty target: %v", err)
	}
	if _, err := client.Dial(t.Context(), "127.0.0.1:1", ""); !errors.Is(err, client.ErrEmptyAPIKey) {
		t.Errorf("empty key: %v", err)
	}
	if _, err := client.Dial(t.Context(), "127.0.0.1:1", "a\nb"); !errors.Is(err, client.ErrEmptyAPIKey) {
		t.Errorf("newline key: %v", err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := client.Dial(ctx, "127.0.0.1:1", "k"); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled ctx: %v", err)
	}
}

func TestIsTerminal(t *testing.T) {
	t.Parallel()
	for s := range executionv1.ExecutionStatus_name {
		st := executionv1.ExecutionStatus(s)
		want := st >= executionv1.ExecutionStatus_EXECUTION_STATUS_SUCCEEDED
		if got := client.IsTerminal(st); got != want {
			t.Errorf("IsTerminal(%v) = %v", st, got)
		}
	}
}
