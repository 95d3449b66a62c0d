// Command app is the csv-payments demo application. It reads a CSV of
// payments, invokes the "payments.send" capability once per row through a
// Capstan gateway, receives the signed completion webhooks on POST /events,
// and writes one output row per input row plus a summary on stdout.
//
// With --shape file the whole file is one execution: the application
// uploads it into the local object store --objects-dir, invokes
// "payments.process-file" once, waits for that execution (its webhook, or
// Get), and copies the output object the release published — the same CSV,
// except that Attempts counts the sends of the row's request and
// ExecutionID is the file's execution — to the output path.
//
// Flags (each falls back to the environment variable in brackets when not
// given on the command line):
//
//	--gateway         [CAPSTAN_GATEWAY]     gateway gRPC target (required)
//	--api-key         [CAPSTAN_API_KEY]     application api key (required)
//	--webhook-listen  [APP_WEBHOOK_LISTEN]  webhook receiver address, default 127.0.0.1:8088
//	--webhook-secret  [APP_WEBHOOK_SECRET]  webhook secret, whsec_<base64> (required)
//	--input           [APP_INPUT]           input CSV path (required)
//	--output          [APP_OUTPUT]          output CSV path, default <input base name>.out.csv in --out-dir
//	--out-dir         [APP_OUT_DIR]         directory of the default output, default "."
//	--concurrency     [APP_CONCURRENCY]     invokes in flight, default 32
//	--timeout         [APP_TIMEOUT]         overall timeout, default 10m
//	--poll-interval   [APP_POLL_INTERVAL]   how often overdue rows are polled with Get, default 3s
//	--pending-after   [APP_PENDING_AFTER]   how long a row waits for its webhook before polling, default 5s
//	--log-level       [APP_LOG_LEVEL]       debug, info, warn or error, default info
//	--shape           [APP_SHAPE]           row (one execution per row, default) or file (one for the file)
//	--objects-dir     [APP_OBJECTS_DIR]     local object store root (the gateway's object_store.dir), required with --shape file
//
// Exit status: 0 when every row has an outcome; 1 on errors, including a
// timeout with rows still pending (the output is still written, with Status
// PENDING for them; in the file shape nothing is written then, nor when the
// file's execution failed); 2 for invalid flags.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/capstan-dev/capstan/examples/csv-payments/app/internal/csvapp"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run parses the configuration, runs the application and returns the exit
// status. Logs go to stderr as JSON; the summary goes to stdout.
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	cfg, level, err := csvapp.ParseConfig(args, getenv, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 2
	}
	logger := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: level}))
	if sum, err := csvapp.Run(ctx, cfg, stdout, logger); err != nil {
		var pending *csvapp.PendingError
		if errors.As(err, &pending) {
			reason := "interrupted"
			if errors.Is(err, context.DeadlineExceeded) {
				reason = "timed out"
			}
			if sum.Shape == csvapp.ShapeFile {
				fmt.Fprintf(stderr, "csv-payments-app: %s before execution %s of %s finished (%d rows; no output written)\n",
					reason, sum.ExecutionID, csvapp.FileCapability, pending.Pending)
			} else {
				fmt.Fprintf(stderr, "csv-payments-app: %s with %d rows still pending (written as PENDING)\n", reason, pending.Pending)
			}
		} else {
			fmt.Fprintln(stderr, "csv-payments-app:", err)
		}
		return 1
	}
	return 0
}
