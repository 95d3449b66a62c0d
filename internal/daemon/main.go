package daemon

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/telemetry"
)

// MainFunc runs a daemon until ctx ends.
type MainFunc func(ctx context.Context, cfg *config.Config, logger *slog.Logger) error

// Run is the body of every cmd main: it parses --config (default
// $CAPSTAN_CONFIG), loads and validates the configuration, builds the
// logger, installs the telemetry (internal/telemetry: /metrics on the
// admin port, traces as OTEL_TRACES_EXPORTER says), runs fn until SIGINT or SIGTERM, and returns the exit code
// (0 on a clean stop, 1 on an error, 2 on a configuration error).
func Run(component string, fn MainFunc) int {
	fs := flag.NewFlagSet(component, flag.ContinueOnError)
	path := fs.String("config", os.Getenv("CAPSTAN_CONFIG"), "configuration file (YAML); CAPSTAN_* variables override it")
	if err := fs.Parse(os.Args[1:]); err != nil {
		return 2
	}
	cfg, err := config.Load(*path)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", component, err)
		return 2
	}
	logger := NewLogger(os.Stderr, cfg.Log, component)
	ctx, stop := SignalContext()
	defer stop()
	tel, err := telemetry.New(ctx, "capstan-"+component, telemetry.Options{})
	if err != nil {
		logger.Error("telemetry", "error", err)
		return 2
	}
	telemetry.Install(tel)
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), Grace)
		defer cancel()
		if err := tel.Shutdown(sctx); err != nil {
			logger.Warn("telemetry shutdown", "error", err)
		}
	}()
	if err := fn(ctx, cfg, logger); err != nil {
		logger.Error("stopped with an error", "error", err)
		return 1
	}
	logger.Info("stopped")
	return 0
}
