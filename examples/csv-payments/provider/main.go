// Command provider is the csv-payments example's mock payment provider. It
// implements Capstan's AdapterService (capability "payments.send") with
// pkg/adapter and answers each attempt per payment.Decide after a random
// latency, except for a seeded, deterministic fraction of attempts that fail
// retryably with class "provider.unavailable".
//
// Flags (each falls back to the environment variable in brackets when not
// given on the command line):
//
//	--listen              [PROVIDER_LISTEN]             gRPC address, default 127.0.0.1:7070
//	--admin-listen        [PROVIDER_ADMIN_LISTEN]       HTTP address of GET /stats, default "" (off)
//	--latency-min         [PROVIDER_LATENCY_MIN]        shortest latency per attempt, default 5ms
//	--latency-max         [PROVIDER_LATENCY_MAX]        longest latency per attempt, default 30ms
//	--retryable-fraction  [PROVIDER_RETRYABLE_FRACTION] fraction of attempts failing retryably, 0..1, default 0.1
//	--seed                [PROVIDER_SEED]               seed of that choice, default 1
//	--log-level           [PROVIDER_LOG_LEVEL]          debug, info, warn or error, default info
//
// Logs go to stderr as JSON; inputs and outputs are never logged. GET /stats
// answers {"calls":N,"executions":M}: Execute calls so far and distinct
// execution ids among them.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/capstan-dev/capstan/pkg/adapter"
)

// errConfig is wrapped by parseConfig for invalid flag or environment values.
var errConfig = errors.New("provider: invalid configuration")

// config is the provider's configuration.
type config struct {
	Listen            string
	AdminListen       string
	LatencyMin        time.Duration
	LatencyMax        time.Duration
	RetryableFraction float64
	Seed              uint64
	LogLevel          slog.Level
}

// envFallbacks maps flag names to their environment variables.
var envFallbacks = []struct{ flag, env string }{
	{"listen", "PROVIDER_LISTEN"},
	{"admin-listen", "PROVIDER_ADMIN_LISTEN"},
	{"latency-min", "PROVIDER_LATENCY_MIN"},
	{"latency-max", "PROVIDER_LATENCY_MAX"},
	{"retryable-fraction", "PROVIDER_RETRYABLE_FRACTION"},
	{"seed", "PROVIDER_SEED"},
	{"log-level", "PROVIDER_LOG_LEVEL"},
}

// parseConfig parses args (without the program name); flags not given fall
// back to getenv. Usage and errors are written to usage.
func parseConfig(args []string, getenv func(string) string, usage io.Writer) (config, error) {
	var cfg config
	fs := flag.NewFlagSet("provider", flag.ContinueOnError)
	fs.SetOutput(usage)
	fs.StringVar(&cfg.Listen, "listen", "127.0.0.1:7070", "gRPC listen address of AdapterService")
	fs.StringVar(&cfg.AdminListen, "admin-listen", "", "HTTP listen address of GET /stats (empty: off)")
	fs.DurationVar(&cfg.LatencyMin, "latency-min", 5*time.Millisecond, "shortest simulated latency per attempt")
	fs.DurationVar(&cfg.LatencyMax, "latency-max", 30*time.Millisecond, "longest simulated latency per attempt")
	fs.Float64Var(&cfg.RetryableFraction, "retryable-fraction", 0.1, "fraction (0..1) of attempts that fail retryably with provider.unavailable")
	fs.Uint64Var(&cfg.Seed, "seed", 1, "seed of the deterministic retryable-failure choice")
	fs.TextVar(&cfg.LogLevel, "log-level", slog.LevelInfo, "log level: debug, info, warn or error")
	if err := fs.Parse(args); err != nil {
		return config{}, fmt.Errorf("%w: %w", errConfig, err)
	}
	if fs.NArg() > 0 {
		return config{}, fmt.Errorf("%w: unexpected arguments %q", errConfig, fs.Args())
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	for _, fe := range envFallbacks {
		if v := getenv(fe.env); v != "" && !given[fe.flag] {
			if err := fs.Set(fe.flag, v); err != nil {
				return config{}, fmt.Errorf("%w: %s=%q: %w", errConfig, fe.env, v, err)
			}
		}
	}
	switch {
	case cfg.Listen == "":
		return config{}, fmt.Errorf("%w: --listen is empty", errConfig)
	case cfg.LatencyMin < 0 || cfg.LatencyMax < cfg.LatencyMin:
		return config{}, fmt.Errorf("%w: want 0 <= --latency-min (%s) <= --latency-max (%s)", errConfig, cfg.LatencyMin, cfg.LatencyMax)
	case !(cfg.RetryableFraction >= 0 && cfg.RetryableFraction <= 1):
		return config{}, fmt.Errorf("%w: --retryable-fraction %v is not in [0, 1]", errConfig, cfg.RetryableFraction)
	}
	return cfg, nil
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Getenv, os.Stderr)
	stop()
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "provider:", err)
		os.Exit(1)
	}
}

// run parses the configuration, opens the listeners and serves until ctx
// ends. Logs go to stderr as JSON.
func run(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) error {
	cfg, err := parseConfig(args, getenv, stderr)
	if err != nil {
		return err
	}
	logger := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: cfg.LogLevel}))
	var lc net.ListenConfig
	lis, err := lc.Listen(ctx, "tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("provider: listen %s: %w", cfg.Listen, err)
	}
	var adminLis net.Listener
	if cfg.AdminListen != "" {
		adminLis, err = lc.Listen(ctx, "tcp", cfg.AdminListen)
		if err != nil {
			_ = lis.Close()
			return fmt.Errorf("provider: listen %s: %w", cfg.AdminListen, err)
		}
	}
	return serve(ctx, cfg, lis, adminLis, logger)
}

// serve serves the provider on lis and, when adminLis is not nil, GET /stats
// on adminLis, until ctx ends. It closes both listeners.
func serve(ctx context.Context, cfg config, lis, adminLis net.Listener, logger *slog.Logger) error {
	p := newProvider(cfg, logger)
	logger.InfoContext(ctx, "provider starting",
		slog.String("listen", lis.Addr().String()),
		slog.Duration("latency_min", cfg.LatencyMin),
		slog.Duration("latency_max", cfg.LatencyMax),
		slog.Float64("retryable_fraction", cfg.RetryableFraction),
		slog.Uint64("seed", cfg.Seed))

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	var adminErr error
	if adminLis != nil {
		srv := &http.Server{Handler: p.adminHandler(), ReadHeaderTimeout: 5 * time.Second}
		wg.Go(func() {
			<-ctx.Done()
			sctx, stop := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer stop()
			_ = srv.Shutdown(sctx)
		})
		wg.Go(func() {
			logger.InfoContext(ctx, "admin listening", slog.String("addr", adminLis.Addr().String()))
			if err := srv.Serve(adminLis); !errors.Is(err, http.ErrServerClosed) {
				adminErr = err
				cancel() // stop the gRPC server too
			}
		})
	}

	err := adapter.Serve(ctx, lis, p, logger)
	cancel()
	wg.Wait()
	if adminErr != nil && err == nil {
		err = fmt.Errorf("provider: admin server: %w", adminErr)
	}
	s := p.snapshot()
	logger.InfoContext(context.WithoutCancel(ctx), "provider stopped", slog.Int64("calls", s.Calls), slog.Int("executions", s.Executions))
	return err
}
