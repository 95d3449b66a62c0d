package gateway

import (
	"context"
	"fmt"
	"log/slog"

	"google.golang.org/grpc"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/daemon"
	"github.com/capstan-dev/capstan/internal/rpcerr"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	executionv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/execution/v1"
)

// Main runs the gateway until ctx ends: the gRPC API on cfg.Gateway.Listen
// and /healthz, /readyz on cfg.Gateway.AdminListen.
func Main(ctx context.Context, cfg *config.Config, logger *slog.Logger) error {
	if cfg.Database.MigrateOnStart {
		if _, err := pgstore.Migrate(ctx, cfg.Database.URL, logger); err != nil {
			return err
		}
	}
	store, err := pgstore.Open(ctx, cfg.Database.URL, logger)
	if err != nil {
		return err
	}
	defer store.Close()
	n, err := newNudger(cfg.Gateway.DispatcherAddr, cfg.Gateway.NudgeTimeout, logger)
	if err != nil {
		return fmt.Errorf("dispatcher client: %w", err)
	}
	health := daemon.NewHealth(store.Ping)
	srv := daemon.NewGRPCServer(health,
		grpc.ChainUnaryInterceptor(rpcerr.UnaryServerInterceptor(), authInterceptor(store)),
		grpc.MaxRecvMsgSize(2*cfg.Gateway.MaxInputBytes+1<<20),
	)
	svc := NewExecutionService(store, cfg, n.Nudge, logger)
	defer svc.Close()
	executionv1.RegisterExecutionServiceServer(srv, svc)

	lis, err := daemon.Listen(cfg.Gateway.Listen)
	if err != nil {
		return err
	}
	admin, err := daemon.Listen(cfg.Gateway.AdminListen)
	if err != nil {
		lis.Close()
		return err
	}
	logger.Info("gateway listening", "grpc", lis.Addr().String(), "admin", daemon.Addr(admin))
	g, gctx := daemon.NewGroup(ctx)
	g.Go(func() error { return daemon.ServeGRPC(gctx, srv, lis, daemon.Grace) })
	if admin != nil {
		g.Go(func() error { return daemon.ServeHTTP(gctx, health.Handler(), admin, daemon.Grace) })
	}
	g.Go(func() error { health.Watch(gctx, daemon.HealthInterval); return nil })
	g.Go(func() error { return n.run(gctx) })
	return g.Wait()
}
