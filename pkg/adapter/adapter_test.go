package adapter_test

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"

	"github.com/capstan-dev/capstan/pkg/adapter"
	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// start serves h on a loopback listener and returns a connection to it. The
// server stops and Serve's result is checked at cleanup.
func start(t *testing.T, h adapter.Handler) *grpc.ClientConn {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- adapter.Serve(ctx, lis, h, slog.New(slog.DiscardHandler)) }()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = conn.Close()
		cancel()
		if err := <-errc; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return conn
}

func TestServe(t *testing.T) {
	t.Parallel()
	h := adapter.HandlerFunc(func(_ context.Context, req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
		switch string(req.GetInput()) {
		case "ok":
			return adapter.Succeeded([]byte(`{"x":1}`), ""), nil
		case "fail":
			return adapter.Failed("payment.declined", "too much", false), nil
		case "nil":
			return nil, nil
		case "panic":
			panic("boom")
		default:
			return nil, status.Error(codes.Unavailable, "later")
		}
	})
	conn := start(t, h)
	ctx := t.Context()
	c := adapterv1.NewAdapterServiceClient(conn)

	resp, err := c.Execute(ctx, &adapterv1.ExecuteRequest{ExecutionId: "e1", Attempt: 1, Input: []byte("ok")})
	if err != nil {
		t.Fatal(err)
	}
	if r := resp.GetResult(); string(r.GetOutput()) != `{"x":1}` || r.GetContentType() != "application/json" {
		t.Errorf("result = %v", r)
	}
	resp, err = c.Execute(ctx, &adapterv1.ExecuteRequest{ExecutionId: "e2", Attempt: 1, Input: []byte("fail")})
	if err != nil {
		t.Fatal(err)
	}
	if f := resp.GetFailure(); f.GetClass() != "payment.declined" || f.GetMessage() != "too much" || f.GetRetryable() {
		t.Errorf("failure = %v", f)
	}
	for in, want := range map[string]codes.Code{"nil": codes.Internal, "panic": codes.Internal, "other": codes.Unavailable} {
		_, err := c.Execute(ctx, &adapterv1.ExecuteRequest{ExecutionId: "e3", Input: []byte(in)})
		if status.Code(err) != want {
			t.Errorf("input %q: code %v, want %v (%v)", in, status.Code(err), want, err)
		}
	}

	hc := healthpb.NewHealthClient(conn)
	for _, svc := range []string{"", "capstan.adapter.v1.AdapterService"} {
		hr, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: svc})
		if err != nil {
			t.Fatal(err)
		}
		if hr.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("health %q = %v", svc, hr.GetStatus())
		}
	}

	rc, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}); err != nil {
		t.Fatal(err)
	}
	rr, err := rc.Recv()
	if err != nil {
		t.Fatal(err)
	}
	_ = rc.CloseSend()
	found := false
	for _, s := range rr.GetListServicesResponse().GetService() {
		found = found || s.GetName() == "capstan.adapter.v1.AdapterService"
	}
	if !found {
		t.Errorf("reflection does not list AdapterService: %v", rr)
	}
}

func TestServeGracefulStop(t *testing.T) {
	t.Parallel()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	entered := make(chan struct{})
	h := adapter.HandlerFunc(func(context.Context, *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
		close(entered)
		time.Sleep(100 * time.Millisecond)
		return adapter.Succeeded(nil, "text/plain"), nil
	})
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- adapter.Serve(ctx, lis, h, nil) }()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	callErr := make(chan error, 1)
	go func() {
		_, err := adapterv1.NewAdapterServiceClient(conn).Execute(t.Context(), &adapterv1.ExecuteRequest{ExecutionId: "e"})
		callErr <- err
	}()
	<-entered
	cancel()
	if err := <-callErr; err != nil {
		t.Errorf("in-flight call failed during graceful stop: %v", err)
	}
	select {
	case err := <-errc:
		if err != nil {
			t.Errorf("Serve = %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Serve did not return after ctx ended")
	}
}

func TestServeArguments(t *testing.T) {
	t.Parallel()
	if err := adapter.Serve(t.Context(), nil, adapter.HandlerFunc(nil), nil); !errors.Is(err, adapter.ErrNilListener) {
		t.Errorf("nil listener: %v", err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if err := adapter.Serve(t.Context(), lis, nil, nil); !errors.Is(err, adapter.ErrNilHandler) {
		t.Errorf("nil handler: %v", err)
	}
	// A context that already ended makes Serve return nil at once.
	lis, err = net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := adapter.Serve(ctx, lis, adapter.HandlerFunc(nil), nil); err != nil {
		t.Errorf("ended ctx: %v", err)
	}
}

func TestHelpers(t *testing.T) {
	t.Parallel()
	if got := adapter.Succeeded([]byte("x"), "text/plain").GetResult(); got.GetContentType() != "text/plain" || string(got.GetOutput()) != "x" {
		t.Errorf("Succeeded = %v", got)
	}
	if got := adapter.Failed("c", "m", true).GetFailure(); got.GetClass() != "c" || got.GetMessage() != "m" || !got.GetRetryable() {
		t.Errorf("Failed = %v", got)
	}
}
