// Package csvapp is the csv-payments demo application: it reads a CSV of
// payments, invokes the "payments.send" capability once per row through a
// Capstan gateway, collects each row's outcome from signed completion
// webhooks (with Get as a safety net), and writes one output row per input
// row. The command in the parent directory is a thin wrapper around
// ParseConfig and Run.
//
// In the file shape (Config.Shape ShapeFile) the whole file is one
// execution instead: the application checks the file as in the row shape,
// uploads it into the local object store (Config.ObjectsDir), invokes
// FileCapability ("payments.process-file", a release declared as steps)
// once with {"source": <upload key>, "output": <output key>}, waits until
// the execution is terminal (its completion webhook, with Get as a safety
// net), then copies the published output object — the same CSV the row
// shape writes — to the output path, checking it row by row.
package csvapp

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/grpc"

	"github.com/capstan-dev/capstan/internal/objectstore"
)

// Capability is the capability invoked for every row.
const Capability = "payments.send"

// FileCapability is the capability invoked once per file in the file
// shape: a release declared as steps whose input is {"source": "<object
// key>", "output": "<object key>"}.
const FileCapability = "payments.process-file"

// Shapes (Config.Shape): what one execution is.
const (
	// ShapeRow invokes Capability once per row (the default).
	ShapeRow = "row"
	// ShapeFile invokes FileCapability once for the whole file.
	ShapeFile = "file"
)

// Defaults of Config.
const (
	DefaultWebhookListen = "127.0.0.1:8088"
	DefaultOutDir        = "."
	DefaultConcurrency   = 32
	DefaultTimeout       = 10 * time.Minute
	DefaultPollInterval  = 3 * time.Second
	DefaultPendingAfter  = 5 * time.Second
	DefaultRPCTimeout    = 30 * time.Second
)

// ErrConfig is wrapped by ParseConfig and Run for an invalid configuration.
var ErrConfig = errors.New("csvapp: invalid configuration")

// Config configures Run. Zero durations and concurrency take the defaults
// above; Gateway, APIKey, WebhookSecret and Input are required.
type Config struct {
	// Gateway is the gateway's gRPC target, for example "127.0.0.1:7443".
	Gateway string
	// APIKey is the application's api key (sent as a bearer token).
	APIKey string
	// WebhookListen is the address the webhook receiver (POST /events)
	// listens on; ignored when WebhookListener is set.
	WebhookListen string
	// WebhookSecret is the application's webhook secret, "whsec_<base64>".
	WebhookSecret string
	// Input is the CSV path (header ID,Recipient,Amount,Currency).
	Input string
	// Output is the output CSV path; empty means OutputPath's default.
	Output string
	// OutDir is where the default output goes; default ".".
	OutDir string
	// Concurrency is the number of invokes (and polls) in flight; default 32.
	Concurrency int
	// Timeout bounds the whole run; default 10m.
	Timeout time.Duration
	// PollInterval is how often pending rows are checked; default 3s.
	PollInterval time.Duration
	// PendingAfter is how long after its invoke answer a row without an
	// outcome is first polled with Get; later polls back off up to 30s.
	// Default 5s.
	PendingAfter time.Duration
	// RPCTimeout bounds each gRPC call; default 30s.
	RPCTimeout time.Duration
	// Shape is ShapeRow (default) or ShapeFile.
	Shape string
	// ObjectsDir is the root directory of the local object store that the
	// gateway's releases with steps read and publish (object_store.dir);
	// required in the file shape, which uploads the input there and reads
	// the output from there.
	ObjectsDir string
	// ObjectsPrefix is the application's prefix in the object store, its
	// name as registered with Capstan: the gateway accepts only keys under
	// "<prefix>/". Required in the file shape.
	ObjectsPrefix string

	// WebhookListener, when set, is used instead of listening on
	// WebhookListen (tests pass a loopback listener). Run closes it.
	WebhookListener net.Listener
	// DialOptions are added to the gateway connection's options.
	DialOptions []grpc.DialOption
}

// withDefaults returns c with zero fields set to their defaults.
func (c Config) withDefaults() Config {
	if c.WebhookListen == "" {
		c.WebhookListen = DefaultWebhookListen
	}
	if c.OutDir == "" {
		c.OutDir = DefaultOutDir
	}
	if c.Concurrency <= 0 {
		c.Concurrency = DefaultConcurrency
	}
	if c.Timeout <= 0 {
		c.Timeout = DefaultTimeout
	}
	if c.PollInterval <= 0 {
		c.PollInterval = DefaultPollInterval
	}
	if c.PendingAfter <= 0 {
		c.PendingAfter = DefaultPendingAfter
	}
	if c.RPCTimeout <= 0 {
		c.RPCTimeout = DefaultRPCTimeout
	}
	if c.Shape == "" {
		c.Shape = ShapeRow
	}
	return c
}

// validate reports the first missing required field, wrapping ErrConfig.
func (c Config) validate() error {
	for _, f := range []struct{ name, v string }{
		{"--gateway", c.Gateway}, {"--api-key", c.APIKey},
		{"--webhook-secret", c.WebhookSecret}, {"--input", c.Input},
	} {
		if strings.TrimSpace(f.v) == "" {
			return fmt.Errorf("%w: %s is required", ErrConfig, f.name)
		}
	}
	switch c.Shape {
	case "", ShapeRow:
	case ShapeFile:
		if strings.TrimSpace(c.ObjectsDir) == "" {
			return fmt.Errorf("%w: --objects-dir is required with --shape %s (the object store the gateway reads and publishes)", ErrConfig, ShapeFile)
		}
		if err := objectstore.ValidateKey(c.ObjectsPrefix); err != nil {
			return fmt.Errorf("%w: --objects-prefix is required with --shape %s (the application's name as registered; its objects live under <name>/): %v", ErrConfig, ShapeFile, err)
		}
	default:
		return fmt.Errorf("%w: --shape %q: want %s or %s", ErrConfig, c.Shape, ShapeRow, ShapeFile)
	}
	return nil
}

// OutputPath returns c.Output, or "<input base name without .csv>.out.csv"
// in c.OutDir (default ".") when c.Output is empty.
func (c Config) OutputPath() string {
	if c.Output != "" {
		return c.Output
	}
	dir := c.OutDir
	if dir == "" {
		dir = DefaultOutDir
	}
	base := filepath.Base(c.Input)
	if ext := filepath.Ext(base); strings.EqualFold(ext, ".csv") {
		base = strings.TrimSuffix(base, ext)
	}
	return filepath.Join(dir, base+".out.csv")
}

// envFallbacks maps flag names to their environment variables.
var envFallbacks = []struct{ flag, env string }{
	{"gateway", "CAPSTAN_GATEWAY"},
	{"api-key", "CAPSTAN_API_KEY"},
	{"webhook-listen", "APP_WEBHOOK_LISTEN"},
	{"webhook-secret", "APP_WEBHOOK_SECRET"},
	{"input", "APP_INPUT"},
	{"output", "APP_OUTPUT"},
	{"out-dir", "APP_OUT_DIR"},
	{"concurrency", "APP_CONCURRENCY"},
	{"timeout", "APP_TIMEOUT"},
	{"poll-interval", "APP_POLL_INTERVAL"},
	{"pending-after", "APP_PENDING_AFTER"},
	{"log-level", "APP_LOG_LEVEL"},
	{"shape", "APP_SHAPE"},
	{"objects-dir", "APP_OBJECTS_DIR"},
	{"objects-prefix", "APP_OBJECTS_PREFIX"},
}

// ParseConfig parses the command line args (without the program name). A
// flag not given falls back to its environment variable read with getenv
// (see the command's documentation for the names). Usage and flag errors
// are written to usage. It also returns the log level (--log-level).
//
// Errors wrap ErrConfig (and flag.ErrHelp for -h).
func ParseConfig(args []string, getenv func(string) string, usage io.Writer) (Config, slog.Level, error) {
	var (
		c     Config
		level = slog.LevelInfo
	)
	fs := flag.NewFlagSet("csv-payments-app", flag.ContinueOnError)
	fs.SetOutput(usage)
	fs.StringVar(&c.Gateway, "gateway", "", "gateway gRPC target (required)")
	fs.StringVar(&c.APIKey, "api-key", "", "application api key (required)")
	fs.StringVar(&c.WebhookListen, "webhook-listen", DefaultWebhookListen, "listen address of the webhook receiver (POST /events)")
	fs.StringVar(&c.WebhookSecret, "webhook-secret", "", "webhook secret, whsec_<base64> (required)")
	fs.StringVar(&c.Input, "input", "", "input CSV path (required)")
	fs.StringVar(&c.Output, "output", "", "output CSV path (default <input base name>.out.csv in --out-dir)")
	fs.StringVar(&c.OutDir, "out-dir", DefaultOutDir, "directory of the default output")
	fs.IntVar(&c.Concurrency, "concurrency", DefaultConcurrency, "invokes in flight")
	fs.DurationVar(&c.Timeout, "timeout", DefaultTimeout, "overall timeout")
	fs.DurationVar(&c.PollInterval, "poll-interval", DefaultPollInterval, "how often rows still pending are checked with Get")
	fs.DurationVar(&c.PendingAfter, "pending-after", DefaultPendingAfter, "how long a row waits for its webhook before it is polled")
	fs.TextVar(&level, "log-level", slog.LevelInfo, "log level: debug, info, warn or error")
	fs.StringVar(&c.Shape, "shape", ShapeRow, "row: invoke "+Capability+" once per row; file: upload the file to --objects-dir and invoke "+FileCapability+" once for all of it")
	fs.StringVar(&c.ObjectsDir, "objects-dir", "", "root directory of the local object store (object_store.dir of the gateway); required with --shape file")
	fs.StringVar(&c.ObjectsPrefix, "objects-prefix", "", "the application's name as registered with Capstan: its objects live under <name>/ in the object store; required with --shape file")
	if err := fs.Parse(args); err != nil {
		return Config{}, 0, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	if fs.NArg() > 0 {
		return Config{}, 0, fmt.Errorf("%w: unexpected arguments %q", ErrConfig, fs.Args())
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	for _, fe := range envFallbacks {
		if v := getenv(fe.env); v != "" && !given[fe.flag] {
			if err := fs.Set(fe.flag, v); err != nil {
				return Config{}, 0, fmt.Errorf("%w: %s: %w", ErrConfig, fe.env, err)
			}
		}
	}
	switch {
	case c.Concurrency <= 0:
		return Config{}, 0, fmt.Errorf("%w: --concurrency must be positive", ErrConfig)
	case c.Timeout <= 0 || c.PollInterval <= 0 || c.PendingAfter <= 0:
		return Config{}, 0, fmt.Errorf("%w: --timeout, --poll-interval and --pending-after must be positive", ErrConfig)
	}
	if err := c.validate(); err != nil {
		return Config{}, 0, err
	}
	return c, level, nil
}
