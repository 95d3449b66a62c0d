// Command dispatcher is Capstan's dispatcher daemon; see package internal/dispatcher.
package main

import (
	"os"

	"github.com/capstan-dev/capstan/internal/daemon"
	"github.com/capstan-dev/capstan/internal/dispatcher"
)

func main() { os.Exit(daemon.Run("dispatcher", dispatcher.Main)) }
