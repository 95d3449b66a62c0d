// Command router is Capstan's event router daemon: it delivers completion
// events to each application's registered consumer: a webhook, a Kafka topic
// or a gRPC EventConsumerService (see internal/router).
//
// Usage: router [--config path]; the path defaults to $CAPSTAN_CONFIG, and
// every key can also be set through CAPSTAN_* environment variables.
package main

import (
	"os"

	"github.com/capstan-dev/capstan/internal/daemon"
	"github.com/capstan-dev/capstan/internal/router"
)

func main() { os.Exit(daemon.Run("router", router.Main)) }
