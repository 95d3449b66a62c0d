// Package ctl implements capstanctl, the operator and developer CLI:
//
//	capstanctl migrate [--status]        apply (or show) the schema migrations
//	capstanctl app upsert --name N …     create or update an application
//	capstanctl execution get ID          show one execution (operator view)
//	capstanctl consumers list|get|set|…  manage event consumers (admin API)
//	capstanctl events list|show|replay   inspect and replay completion events (admin API)
//	capstanctl dev [--demo-input F] [--demo-mode M] [--demo-shape S]  run the embedded stack (make demo)
//
// Database commands read DATABASE_URL or --database-url; consumers and
// events call the gateway's admin API (--admin-addr, --admin-token or
// CAPSTAN_ADMIN_ADDR, CAPSTAN_ADMIN_TOKEN).
package ctl

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"github.com/google/uuid"

	"github.com/capstan-dev/capstan/internal/devstack"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
)

// ErrUsage is returned for a bad command line; the caller exits 2.
var ErrUsage = errors.New("usage")

const usage = `capstanctl — Capstan's operator and developer CLI

Commands:
  migrate [--status]                    apply pending schema migrations (or print the version)
  app upsert --name N --api-key K [--webhook-url U --webhook-secret S]
                                        create or update an application (the key is stored hashed)
  execution get ID                      print one execution as JSON (all applications)
  consumers list | get --app ID | set --app ID (--webhook-url U | --kafka-topic T | --grpc-target H:P)
            [--secret S]... [--secrets-file F] | rotate-secret --app ID [--secret S] [--retire-after D]
            | remove-secret --app ID --secret-id ID | enable --app ID
                                        manage event consumers through the admin API
  events list [--app ID] [--status S] [--since T] | show ID [--payload] | replay ID [--force]
            | replay --app ID --since T  inspect events; replay one, or every DEAD one since T
  dev [--demo-input F] [--demo-mode M] [--demo-shape S] [--bin-dir D]
                                        run the embedded stack; with --demo-input, run the
                                        csv-payments demo on F and stop when it finishes;
                                        M is direct (default), webhook, kafka or callback;
                                        S is row (default: one execution per row) or file
                                        (the whole file is one execution, over kafka)
  config print [--config PATH]          print the effective configuration (file + CAPSTAN_*
                                        variables, defaults applied) as YAML, secrets masked

Database commands use --database-url or DATABASE_URL. consumers and events call the
gateway's admin API: --admin-addr (CAPSTAN_ADMIN_ADDR, default 127.0.0.1:7233) and
--admin-token (CAPSTAN_ADMIN_TOKEN, the gateway's gateway.admin_token).
`

// Main runs capstanctl with args (without the program name).
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return ErrUsage
	}
	switch args[0] {
	case "migrate":
		return migrate(ctx, args[1:], stdout)
	case "app":
		return app(ctx, args[1:], stdout)
	case "execution":
		return executionCmd(ctx, args[1:], stdout)
	case "consumers":
		return consumers(ctx, args[1:], stdout)
	case "events":
		return events(ctx, args[1:], stdout)
	case "dev":
		return dev(ctx, args[1:], stdout, stderr)
	case "config":
		return configCmd(args[1:], stdout)
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return nil
	}
	fmt.Fprintf(stderr, "unknown command %q\n\n%s", args[0], usage)
	return ErrUsage
}

func dbFlag(fs *flag.FlagSet) *string {
	return fs.String("database-url", os.Getenv("DATABASE_URL"), "PostgreSQL URL (default $DATABASE_URL)")
}

func need(name, v string) error {
	if v == "" {
		return fmt.Errorf("%w: --%s is required", ErrUsage, name)
	}
	return nil
}

func migrate(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("migrate", flag.ContinueOnError)
	db := dbFlag(fs)
	status := fs.Bool("status", false, "print the schema version and change nothing")
	if err := fs.Parse(args); err != nil {
		return ErrUsage
	}
	if err := need("database-url", *db); err != nil {
		return err
	}
	if *status {
		v, err := pgstore.MigrateStatus(ctx, *db)
		if err != nil {
			return err
		}
		fmt.Fprintf(out, "schema version %d (this binary expects %d)\n", v, pgstore.SchemaVersion)
		return nil
	}
	v, err := pgstore.Migrate(ctx, *db, nil)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "schema at version %d\n", v)
	return nil
}

func app(ctx context.Context, args []string, out io.Writer) error {
	if len(args) == 0 || args[0] != "upsert" {
		return fmt.Errorf("%w: app upsert --name N --api-key K [--webhook-url U --webhook-secret S]", ErrUsage)
	}
	fs := flag.NewFlagSet("app upsert", flag.ContinueOnError)
	db := dbFlag(fs)
	name := fs.String("name", "", "application name (1-128 bytes)")
	key := fs.String("api-key", "", "API key (stored only as its SHA-256)")
	url := fs.String("webhook-url", "", "event consumer URL")
	secret := fs.String("webhook-secret", "", "Standard Webhooks secret, whsec_<base64>")
	if err := fs.Parse(args[1:]); err != nil {
		return ErrUsage
	}
	for n, v := range map[string]string{"database-url": *db, "name": *name, "api-key": *key} {
		if err := need(n, v); err != nil {
			return err
		}
	}
	if *url != "" && !strings.HasPrefix(*secret, "whsec_") {
		return fmt.Errorf("%w: --webhook-secret: want whsec_<base64> with --webhook-url", ErrUsage)
	}
	st, err := pgstore.Open(ctx, *db, nil)
	if err != nil {
		return err
	}
	defer st.Close()
	a, err := st.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: *name, APIKey: *key, WebhookURL: *url, WebhookSecret: *secret})
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "application %s (%s) version %d\n", a.Name, a.ID, a.Version)
	return nil
}

func executionCmd(ctx context.Context, args []string, out io.Writer) error {
	if len(args) < 2 || args[0] != "get" {
		return fmt.Errorf("%w: execution get ID", ErrUsage)
	}
	fs := flag.NewFlagSet("execution get", flag.ContinueOnError)
	db := dbFlag(fs)
	// The id may come before or after the flags.
	rest := args[1:]
	var idText string
	if !strings.HasPrefix(rest[0], "-") {
		idText, rest = rest[0], rest[1:]
	}
	if err := fs.Parse(rest); err != nil {
		return ErrUsage
	}
	if idText == "" && fs.NArg() > 0 {
		idText = fs.Arg(0)
	}
	if err := need("database-url", *db); err != nil {
		return err
	}
	id, err := uuid.Parse(idText)
	if err != nil {
		return fmt.Errorf("%w: execution id %q is not a UUID", ErrUsage, idText)
	}
	st, err := pgstore.Open(ctx, *db, nil)
	if err != nil {
		return err
	}
	defer st.Close()
	e, err := st.ExecutionGet(ctx, uuid.Nil, id)
	if err != nil {
		return err
	}
	e.Input = nil // payloads are not shown by default
	enc := json.NewEncoder(out)
	enc.SetIndent("", "  ")
	return enc.Encode(e)
}

func dev(ctx context.Context, args []string, out, errOut io.Writer) error {
	fs := flag.NewFlagSet("dev", flag.ContinueOnError)
	binDir := fs.String("bin-dir", "bin", "folder with the daemon and example binaries (make build)")
	runDir := fs.String("run-dir", "run", "parent folder of the run folders (logs, config, output)")
	input := fs.String("demo-input", "", "CSV of payments (ID,Recipient,Amount,Currency) to run through the demo")
	mode := fs.String("demo-mode", "direct", "how Capstan reaches the demo provider: direct (AdapterService), webhook or kafka (await step on that transport), callback (accepted, then AdapterCallbackService)")
	shape := fs.String("demo-shape", "row", "what one execution is: row (payments.send per CSV row) or file (the whole file as one execution of payments.process-file, over the kafka transport; --demo-mode must be direct or kafka)")
	verbose := fs.Bool("v", false, "log the stack's own steps to stderr")
	if err := fs.Parse(args); err != nil {
		return ErrUsage
	}
	logger := slog.New(slog.DiscardHandler)
	if *verbose {
		logger = slog.New(slog.NewTextHandler(errOut, nil))
	}
	var brokers []string
	if b := os.Getenv("KAFKA_BROKERS"); b != "" {
		brokers = strings.Split(b, ",")
	}
	return devstack.Run(ctx, devstack.Options{
		BinDir: *binDir, RunDir: *runDir, DemoInput: *input, DemoMode: *mode, DemoShape: *shape,
		DatabaseURL: os.Getenv("DATABASE_URL"), KafkaBrokers: brokers, Out: out, Logger: logger,
	})
}
