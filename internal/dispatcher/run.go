package dispatcher

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/daemon"
	"github.com/capstan-dev/capstan/internal/kafka"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	dispatchv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/dispatch/v1"
)

// Main runs the dispatcher until ctx ends: the pass loop, the Nudge gRPC
// service on cfg.Dispatcher.Listen and /healthz, /readyz on AdminListen.
func Main(ctx context.Context, cfg *config.Config, logger *slog.Logger) error {
	store, err := pgstore.OpenForDaemon(ctx, cfg.Database.URL, cfg.Database.MigrateOnStart, logger)
	if err != nil {
		return err
	}
	defer store.Close()
	client, err := kafka.NewClient(cfg.Kafka.Brokers, logger,
		kgo.DefaultProduceTopic(cfg.Kafka.ExecutionTopic),
		kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.ProducerLinger(0),
	)
	if err != nil {
		return err
	}
	defer client.Close()
	if err := kafka.EnsureTopic(ctx, client, cfg.Kafka.ExecutionTopic, cfg.Kafka.ExecutionPartitions); err != nil {
		logger.Warn("could not ensure the execution topic; continuing", "error", err)
	}
	host, _ := os.Hostname()
	d := New(store, client, cfg.Dispatcher, cfg.Kafka.ExecutionTopic, fmt.Sprintf("%s-%d", host, os.Getpid()), logger)

	health := daemon.NewHealth(func(ctx context.Context) error {
		return errors.Join(store.Ping(ctx), kafka.Ping(ctx, client))
	})
	if stop, err := health.Instrument(otel.GetMeterProvider(), "dispatcher"); err != nil {
		logger.Warn("readiness gauge not registered", "error", err)
	} else {
		defer stop()
	}
	srv := daemon.NewGRPCServer(health)
	dispatchv1.RegisterDispatcherServiceServer(srv, NewNudgeServer(d))
	lis, err := daemon.Listen(cfg.Dispatcher.Listen)
	if err != nil {
		return err
	}
	admin, err := daemon.Listen(cfg.Dispatcher.AdminListen)
	if err != nil {
		lis.Close()
		return err
	}
	logger.Info("dispatcher listening", "grpc", daemon.Addr(lis), "admin", daemon.Addr(admin))
	g, gctx := daemon.NewGroup(ctx)
	g.Go(func() error { return d.Run(gctx) })
	g.Go(func() error { return daemon.ServeGRPC(gctx, srv, lis, daemon.Grace) })
	if admin != nil {
		g.Go(func() error { return daemon.ServeHTTP(gctx, health.Handler(), admin, daemon.Grace) })
	}
	g.Go(func() error { health.Watch(gctx, daemon.HealthInterval); return nil })
	return g.Wait()
}
