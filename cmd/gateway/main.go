// Command gateway is Capstan's gateway daemon; see package internal/gateway.
package main

import (
	"os"

	"github.com/capstan-dev/capstan/internal/daemon"
	"github.com/capstan-dev/capstan/internal/gateway"
)

func main() { os.Exit(daemon.Run("gateway", gateway.Main)) }
