package gateway

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel"
	"google.golang.org/grpc"

	"github.com/capstan-dev/capstan/internal/admin"
	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/daemon"
	"github.com/capstan-dev/capstan/internal/rpcerr"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/pkg/adapter"
	callbackv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/callback/v1"
	executionv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/execution/v1"
	interactionv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/interaction/v1"
)

// Main runs the gateway until ctx ends: the gRPC API on cfg.Gateway.Listen
// and /healthz, /readyz on cfg.Gateway.AdminListen.
func Main(ctx context.Context, cfg *config.Config, logger *slog.Logger) error {
	store, err := pgstore.OpenForDaemon(ctx, cfg.Database.URL, cfg.Database.MigrateOnStart, logger)
	if err != nil {
		return err
	}
	defer store.Close()
	n, err := newNudger(cfg.Gateway.DispatcherAddr, cfg.Gateway.NudgeTimeout, logger)
	if err != nil {
		return fmt.Errorf("dispatcher client: %w", err)
	}
	health := daemon.NewHealth(store.Ping)
	if stop, err := health.Instrument(otel.GetMeterProvider(), "gateway"); err != nil {
		logger.Warn("readiness gauge not registered", "error", err)
	} else {
		defer stop()
	}
	srv := daemon.NewGRPCServer(health,
		// A server span per RPC (the global tracer provider); the span of
		// InvokeCapability is the root of the execution's trace unless the
		// caller sent a traceparent.
		grpc.StatsHandler(otelgrpc.NewServerHandler()),
		grpc.ChainUnaryInterceptor(rpcerr.UnaryServerInterceptor(), authInterceptor(store),
			admin.AuthInterceptor(cfg.Gateway.AdminToken)),
		grpc.ChainStreamInterceptor(authStreamInterceptor(store)),
		grpc.MaxRecvMsgSize(2*cfg.Gateway.MaxInputBytes+1<<20),
	)
	svc := NewExecutionService(store, cfg, n.Nudge, logger)
	defer svc.Close()
	executionv1.RegisterExecutionServiceServer(srv, svc)
	callbacks, err := NewCallbackService(store, cfg, logger)
	if err != nil {
		return err
	}
	callbackv1.RegisterAdapterCallbackServiceServer(srv, callbacks)
	interactions, err := NewInteractionService(store, cfg, logger)
	if err != nil {
		return err
	}
	interactionv1.RegisterInteractionServiceServer(srv, interactions)
	if err := admin.Register(srv, store, cfg, logger); err != nil {
		return err
	}

	lis, err := daemon.Listen(cfg.Gateway.Listen)
	if err != nil {
		return err
	}
	admin, err := daemon.Listen(cfg.Gateway.AdminListen)
	if err != nil {
		lis.Close()
		return err
	}
	var completionLis net.Listener
	var completionMux http.Handler
	if h := NewCompletionHandler(store, cfg, logger); h != nil && cfg.Gateway.HTTPListen != "" {
		if completionLis, err = daemon.Listen(cfg.Gateway.HTTPListen); err != nil {
			lis.Close()
			if admin != nil {
				admin.Close()
			}
			return err
		}
		mux := http.NewServeMux()
		mux.Handle(adapter.CompletionPath, h)
		completionMux = mux
	}
	logger.Info("gateway listening", "grpc", lis.Addr().String(), "admin", daemon.Addr(admin),
		"completions", daemon.Addr(completionLis))
	g, gctx := daemon.NewGroup(ctx)
	g.Go(func() error { return daemon.ServeGRPC(gctx, srv, lis, daemon.Grace) })
	if admin != nil {
		g.Go(func() error { return daemon.ServeHTTP(gctx, health.Handler(), admin, daemon.Grace) })
	}
	g.Go(func() error { health.Watch(gctx, daemon.HealthInterval); return nil })
	g.Go(func() error { return n.run(gctx) })
	if completionLis != nil {
		g.Go(func() error { return daemon.ServeHTTP(gctx, completionMux, completionLis, daemon.Grace) })
	}
	return g.Wait()
}
