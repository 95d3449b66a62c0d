// Command capstanctl is Capstan's operator and developer CLI; see package
// internal/ctl.
package main

import (
	"errors"
	"fmt"
	"os"

	"github.com/capstan-dev/capstan/internal/ctl"
	"github.com/capstan-dev/capstan/internal/daemon"
)

func main() {
	ctx, stop := daemon.SignalContext()
	err := ctl.Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	switch {
	case errors.Is(err, ctl.ErrUsage):
		fmt.Fprintln(os.Stderr, "capstanctl:", err)
		os.Exit(2)
	case err != nil:
		fmt.Fprintln(os.Stderr, "capstanctl:", err)
		os.Exit(1)
	}
}
