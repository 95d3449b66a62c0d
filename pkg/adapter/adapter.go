// Package adapter is the SDK for providers: implement Handler and call Serve
// to expose it as Capstan's AdapterService over gRPC, together with the
// standard gRPC health service and server reflection.
//
// Capstan's consumer calls Execute once per attempt. An answer that carries a
// result or a failure is the attempt's outcome; a returned gRPC error is
// mapped by Capstan (UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED, INTERNAL and
// most other codes are retryable; INVALID_ARGUMENT and FAILED_PRECONDITION
// are terminal). Handlers should treat execution_id as their idempotency key:
// the same execution may be attempted again after a crash or a lease expiry.
package adapter

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"

	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
)

// DefaultContentType is the content type Succeeded uses when given none.
const DefaultContentType = "application/json"

// ShutdownGrace is how long Serve lets in-flight calls finish after ctx ends
// before it closes their connections.
const ShutdownGrace = 10 * time.Second

var (
	// ErrNilHandler is returned by Serve when the handler is nil.
	ErrNilHandler = errors.New("adapter: nil handler")
	// ErrNilListener is returned by Serve when the listener is nil.
	ErrNilListener = errors.New("adapter: nil listener")
)

// Handler performs attempts. Execute is called concurrently, once per
// attempt; ctx carries the attempt's deadline. Return a response built with
// Succeeded or Failed; return a gRPC status error only for conditions that
// Capstan should classify itself (see the package documentation). A nil
// response with a nil error is answered as INTERNAL.
type Handler interface {
	Execute(ctx context.Context, req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error)
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(ctx context.Context, req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error)

// Execute calls f(ctx, req).
func (f HandlerFunc) Execute(ctx context.Context, req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
	return f(ctx, req)
}

// Succeeded returns a successful outcome carrying output of contentType
// (empty means DefaultContentType).
func Succeeded(output []byte, contentType string) *adapterv1.ExecuteResponse {
	if contentType == "" {
		contentType = DefaultContentType
	}
	return &adapterv1.ExecuteResponse{Outcome: &adapterv1.ExecuteResponse_Result{
		Result: &adapterv1.Result{Output: output, ContentType: contentType},
	}}
}

// Failed returns an unsuccessful outcome of the dotted class (for example
// "payment.declined") with a human-readable message (Capstan stores up to
// 1024 bytes) and whether another attempt may succeed.
func Failed(class, message string, retryable bool) *adapterv1.ExecuteResponse {
	return &adapterv1.ExecuteResponse{Outcome: &adapterv1.ExecuteResponse_Failure{
		Failure: &adapterv1.Failure{Class: class, Message: message, Retryable: retryable},
	}}
}

// Serve serves h as AdapterService on lis until ctx ends, then stops
// gracefully: health turns NOT_SERVING, new calls are refused and calls in
// flight get up to ShutdownGrace to finish before connections are closed.
// The server also registers the standard health service
// (grpc.health.v1.Health, SERVING for "" and "capstan.adapter.v1.AdapterService")
// and server reflection. Every call gets an OpenTelemetry server span from
// the global tracer provider (otelgrpc), child of the trace context Capstan
// sends in the gRPC metadata, so the adapter's work joins the execution's
// trace; the handler's ctx carries that span. opts are passed to
// grpc.NewServer (for example TLS credentials or interceptors). logger may be nil (logs are discarded); Serve
// logs method, execution id, attempt, outcome and duration at debug level,
// never inputs or outputs. Serve closes lis.
//
// It returns nil after a shutdown caused by ctx, ErrNilHandler,
// ErrNilListener, or the wrapped error of grpc.Server.Serve.
func Serve(ctx context.Context, lis net.Listener, h Handler, logger *slog.Logger, opts ...grpc.ServerOption) error {
	if lis == nil {
		return ErrNilListener
	}
	if h == nil {
		_ = lis.Close()
		return ErrNilHandler
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	srv := grpc.NewServer(append([]grpc.ServerOption{grpc.StatsHandler(otelgrpc.NewServerHandler())}, opts...)...)
	adapterv1.RegisterAdapterServiceServer(srv, &service{h: h, logger: logger})
	hs := health.NewServer()
	hs.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	hs.SetServingStatus(adapterv1.AdapterService_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(srv, hs)
	reflection.Register(srv)

	served := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		select {
		case <-served:
			return
		case <-ctx.Done():
		}
		logger.InfoContext(ctx, "adapter server stopping", slog.String("addr", lis.Addr().String()))
		hs.Shutdown()
		graceful := make(chan struct{})
		go func() { defer close(graceful); srv.GracefulStop() }()
		timer := time.NewTimer(ShutdownGrace)
		defer timer.Stop()
		select {
		case <-graceful:
		case <-timer.C:
			logger.Warn("adapter server: grace period over, closing connections", slog.Duration("grace", ShutdownGrace))
			srv.Stop()
			<-graceful
		}
	}()

	logger.InfoContext(ctx, "adapter server listening", slog.String("addr", lis.Addr().String()))
	err := srv.Serve(lis)
	close(served)
	if err != nil && errors.Is(err, grpc.ErrServerStopped) && ctx.Err() != nil {
		err = nil // ctx ended before Serve started accepting.
	}
	if err != nil {
		srv.Stop()
		<-stopped
		return fmt.Errorf("adapter: serve %s: %w", lis.Addr(), err)
	}
	<-stopped
	return nil
}

// service adapts a Handler to the generated AdapterServiceServer.
type service struct {
	adapterv1.UnimplementedAdapterServiceServer

	h      Handler
	logger *slog.Logger
}

// Execute calls the handler, turns a panic into INTERNAL and logs the
// outcome without payloads.
func (s *service) Execute(ctx context.Context, req *adapterv1.ExecuteRequest) (resp *adapterv1.ExecuteResponse, err error) {
	start := time.Now()
	defer func() {
		if r := recover(); r != nil {
			s.logger.ErrorContext(ctx, "adapter handler panicked",
				slog.String("execution_id", req.GetExecutionId()),
				slog.Int("attempt", int(req.GetAttempt())),
				slog.Any("panic", r))
			resp, err = nil, status.Error(codes.Internal, "adapter handler panicked")
		}
	}()
	resp, err = s.h.Execute(ctx, req)
	if err == nil && resp.GetOutcome() == nil {
		err = status.Error(codes.Internal, "adapter handler returned no outcome")
		resp = nil
	}
	if err != nil {
		// Keep gRPC status errors as they are; map context errors to their
		// codes so that Capstan classifies them correctly.
		if _, ok := status.FromError(err); !ok {
			if ctxErr := ctx.Err(); ctxErr != nil {
				err = status.FromContextError(ctxErr).Err()
			}
		}
	}
	if s.logger.Enabled(ctx, slog.LevelDebug) {
		attrs := []slog.Attr{
			slog.String("execution_id", req.GetExecutionId()),
			slog.Int("attempt", int(req.GetAttempt())),
			slog.String("capability", req.GetCapability()),
			slog.Duration("duration", time.Since(start)),
		}
		switch {
		case err != nil:
			attrs = append(attrs, slog.String("code", status.Code(err).String()))
		case resp.GetFailure() != nil:
			attrs = append(attrs, slog.String("outcome", "failure"),
				slog.String("class", resp.GetFailure().GetClass()),
				slog.Bool("retryable", resp.GetFailure().GetRetryable()))
		default:
			attrs = append(attrs, slog.String("outcome", "result"))
		}
		s.logger.LogAttrs(ctx, slog.LevelDebug, "adapter execute", attrs...)
	}
	return resp, err
}
