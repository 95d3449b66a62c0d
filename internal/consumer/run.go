package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel"

	"github.com/capstan-dev/capstan/internal/admission"
	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/daemon"
	"github.com/capstan-dev/capstan/internal/kafka"
	"github.com/capstan-dev/capstan/internal/objectstore"
	"github.com/capstan-dev/capstan/internal/steps"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
)

// Main runs the execution consumer until ctx ends: the consume loop, the
// reaper and /healthz, /readyz on cfg.Consumer.AdminListen.
func Main(ctx context.Context, cfg *config.Config, logger *slog.Logger) error {
	store, err := pgstore.OpenForDaemon(ctx, cfg.Database.URL, cfg.Database.MigrateOnStart, logger)
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
	var listen func(context.Context) error // item notifications, for releases with steps
	if stop, err := c.ObserveLag(); err != nil {
		logger.Warn("consumer lag gauge not registered", "error", err)
	} else {
		defer stop()
	}

	// The await transports: a sender for pushed interactions, and a
	// consumer of the kafka transport's response topics.
	var sender *InteractionSender
	var completions *CompletionConsumer
	if c.signer != nil {
		var producer *kgo.Client
		if topics := ResponseTopics(cfg); len(topics) > 0 {
			producer, err = kafka.NewClient(cfg.Kafka.Brokers, logger)
			if err != nil {
				return err
			}
			defer producer.Close()
			for _, cp := range cfg.Capabilities {
				if a := cp.AwaitStep(); a != nil && a.Transport == "kafka" {
					for _, t := range []string{a.RequestTopic, a.ResponseTopic} {
						if err := kafka.EnsureTopic(ctx, producer, t, cfg.Kafka.ExecutionPartitions); err != nil {
							logger.Warn("could not ensure an await topic; continuing", "topic", t, "error", err)
						}
					}
				}
			}
			admitter, err := admission.New(store, cfg)
			if err != nil {
				return err
			}
			coffsets := NewOffsetTracker()
			cclient, err := kafka.NewClient(cfg.Kafka.Brokers, logger, CompletionClientOpts(cfg, coffsets, logger)...)
			if err != nil {
				return err
			}
			defer cclient.Close()
			completions = NewCompletionConsumer(cclient, admitter, coffsets, logger)
		}
		sender = NewInteractionSender(store, cfg, c.signer, producer, logger)
	}
	if hasSteps(cfg) {
		objects, err := objectstore.NewLocal(cfg.ObjectStore.Dir)
		if err != nil {
			return fmt.Errorf("object_store.dir: %w", err)
		}
		defer objects.Close()
		hub := steps.NewHub()
		var s steps.Sender
		if sender != nil {
			s = sender
		}
		runner := steps.NewRunner(store, objects, s, c.adapters, hub, logger)
		if err := runner.Instrument(otel.GetMeterProvider()); err != nil {
			logger.Warn("steps metrics not fully registered", "error", err)
		}
		WithSteps(runner)(c)
		listen = func(ctx context.Context) error { return store.ListenItems(ctx, hub.Notify) }
	}
	health := daemon.NewHealth(func(ctx context.Context) error {
		return errors.Join(store.Ping(ctx), kafka.Ping(ctx, client))
	})
	if stop, err := health.Instrument(otel.GetMeterProvider(), "consumer"); err != nil {
		logger.Warn("readiness gauge not registered", "error", err)
	} else {
		defer stop()
	}
	admin, err := daemon.Listen(cfg.Consumer.AdminListen)
	if err != nil {
		return err
	}
	logger.Info("consumer running", "worker", owner, "admin", daemon.Addr(admin), "max_in_flight", cfg.Consumer.MaxInFlight)
	g, gctx := daemon.NewGroup(ctx)
	g.Go(func() error { return c.Run(gctx) })
	g.Go(func() error { return c.Reap(gctx, cfg.Consumer.ReapInterval) })
	g.Go(func() error { health.Watch(gctx, daemon.HealthInterval); return nil })
	if sender != nil {
		g.Go(func() error { return sender.Run(gctx) })
	}
	if completions != nil {
		g.Go(func() error { return completions.Run(gctx) })
	}
	if listen != nil {
		g.Go(func() error { return listen(gctx) })
	}
	if admin != nil {
		g.Go(func() error { return daemon.ServeHTTP(gctx, health.Handler(), admin, daemon.Grace) })
	}
	err = g.Wait()
	if completions != nil {
		cs := completions.Stats()
		logger.Info("completion consumer stopped", "admitted", cs.Admitted, "duplicates", cs.Duplicates, "refused", cs.Refused)
	}
	s := c.Stats()
	logger.Info("consumer stopped", "started", s.Started, "skipped", s.Skipped, "succeeded", s.Succeeded,
		"failed", s.Failed, "retried", s.Retried, "lost", s.Lost, "reaped", s.Reaped)
	return err
}

// hasSteps reports whether a release is declared as steps.
func hasSteps(cfg *config.Config) bool {
	for _, cp := range cfg.Capabilities {
		if cp.Steps != nil {
			return true
		}
	}
	return false
}
