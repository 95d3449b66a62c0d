package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/daemon"
	"github.com/capstan-dev/capstan/internal/kafka"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
)

// Main runs the execution consumer until ctx ends: the consume loop, the
// reaper and /healthz, /readyz on cfg.Consumer.AdminListen.
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
	offsets := NewOffsetTracker()
	client, err := kafka.NewClient(cfg.Kafka.Brokers, logger, ClientOpts(cfg, offsets, logger)...)
	if err != nil {
		return err
	}
	defer client.Close()
	if err := kafka.EnsureTopic(ctx, client, cfg.Kafka.ExecutionTopic, cfg.Kafka.ExecutionPartitions); err != nil {
		logger.Warn("could not ensure the execution topic; continuing", "error", err)
	}
	owner := cfg.Consumer.WorkerID
	if owner == "" {
		host, _ := os.Hostname()
		owner = fmt.Sprintf("%s-%d", host, os.Getpid())
	}
	c := New(store, client, cfg, offsets, owner, logger)
	health := daemon.NewHealth(func(ctx context.Context) error {
		return errors.Join(store.Ping(ctx), kafka.Ping(ctx, client))
	})
	admin, err := daemon.Listen(cfg.Consumer.AdminListen)
	if err != nil {
		return err
	}
	logger.Info("consumer running", "worker", owner, "admin", daemon.Addr(admin), "max_in_flight", cfg.Consumer.MaxInFlight)
	g, gctx := daemon.NewGroup(ctx)
	g.Go(func() error { return c.Run(gctx) })
	g.Go(func() error { return c.Reap(gctx, cfg.Consumer.ReapInterval) })
	if admin != nil {
		g.Go(func() error { return daemon.ServeHTTP(gctx, health.Handler(), admin, daemon.Grace) })
	}
	err = g.Wait()
	s := c.Stats()
	logger.Info("consumer stopped", "started", s.Started, "skipped", s.Skipped, "succeeded", s.Succeeded,
		"failed", s.Failed, "retried", s.Retried, "lost", s.Lost, "reaped", s.Reaped)
	return err
}
