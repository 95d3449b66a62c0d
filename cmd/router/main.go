// Command router is Capstan's event router daemon: it delivers completion
// events to each application's registered webhook (see internal/router).
//
// Usage: router [--config path]; the path defaults to $CAPSTAN_CONFIG, and
// every key can also be set through CAPSTAN_* environment variables.
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/daemon"
	"github.com/capstan-dev/capstan/internal/router"
)

func main() { os.Exit(run()) }

func run() int {
	path := flag.String("config", os.Getenv("CAPSTAN_CONFIG"), "configuration file (YAML); env CAPSTAN_CONFIG")
	flag.Parse()
	cfg, err := config.Load(*path)
	if err != nil {
		fmt.Fprintln(os.Stderr, "router:", err)
		return 2
	}
	logger := daemon.NewLogger(os.Stderr, cfg.Log, "router")
	ctx, stop := daemon.SignalContext()
	defer stop()
	if err := router.Main(ctx, cfg, logger); err != nil {
		logger.Error("router failed", "error", err)
		return 1
	}
	return 0
}
