package router

import (
	"context"
	"fmt"
	"log/slog"

	"go.opentelemetry.io/otel"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/daemon"
	"github.com/capstan-dev/capstan/internal/kafka"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
)

// Main runs the router daemon until ctx ends: it opens the store (applying
// migrations first when cfg.Database.MigrateOnStart), serves /healthz and
// /readyz on cfg.Router.AdminListen (ready when store.Ping succeeds; ""
// disables the admin server), creates a Kafka client for cfg.Kafka.Brokers
// (for Kafka consumers; it connects on first use) and runs a Router,
// draining deliveries in flight on shutdown. It returns nil after a clean stop, or the first error:
// a bad database URL, a failed migration, an admin address that cannot be
// bound, or a failing admin server.
func Main(ctx context.Context, cfg *config.Config, logger *slog.Logger) error {
	store, err := pgstore.OpenForDaemon(ctx, cfg.Database.URL, cfg.Database.MigrateOnStart, logger)
	if err != nil {
		return fmt.Errorf("router: %w", err)
	}
	defer store.Close()
	lis, err := daemon.Listen(cfg.Router.AdminListen)
	if err != nil {
		return fmt.Errorf("router: admin: %w", err)
	}
	health := daemon.NewHealth(store.Ping)
	if stop, err := health.Instrument(otel.GetMeterProvider(), "router"); err != nil {
		logger.Warn("readiness gauge not registered", "error", err)
	} else {
		defer stop()
	}
	g, gctx := daemon.NewGroup(ctx)
	if lis != nil {
		logger.InfoContext(ctx, "admin http listening", "addr", lis.Addr().String())
		g.Go(func() error { return daemon.ServeHTTP(gctx, health.Handler(), lis, daemon.Grace) })
	}
	// Metrics go to the global OpenTelemetry provider: a no-op unless the
	// process installed one.
	opts := []Option{WithMeterProvider(otel.GetMeterProvider())}
	if len(cfg.Kafka.Brokers) > 0 {
		// The client connects on first use: only Kafka consumers need it.
		cl, err := kafka.NewClient(cfg.Kafka.Brokers, logger)
		if err != nil {
			return fmt.Errorf("router: %w", err)
		}
		defer cl.Close()
		opts = append(opts, WithKafkaProducer(cl))
	}
	r := New(store, cfg.Router, logger, opts...)
	g.Go(func() error { return r.Run(gctx) })
	g.Go(func() error { health.Watch(gctx, daemon.HealthInterval); return nil })
	if err := g.Wait(); err != nil {
		return fmt.Errorf("router: %w", err)
	}
	return nil
}
