// Command consumer is Capstan's consumer daemon; see package internal/consumer.
package main

import (
	"os"

	"github.com/capstan-dev/capstan/internal/consumer"
	"github.com/capstan-dev/capstan/internal/daemon"
)

func main() { os.Exit(daemon.Run("consumer", consumer.Main)) }
