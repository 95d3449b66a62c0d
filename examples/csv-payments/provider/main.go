// Command provider is the csv-payments example's mock payment provider. It
// answers each payment per payment.Decide after a random latency, except
// for a seeded, deterministic fraction of attempts that fail retryably with
// class "provider.unavailable". It speaks one of four protocols (--mode):
//
//   - direct: it implements Capstan's AdapterService (capability
//     "payments.send") with pkg/adapter on --listen; the retryable draw is
//     keyed by execution id and attempt.
//   - webhook: it is the partner of a release whose step is an await on the
//     webhook transport. It serves POST /requests on --http-listen, verifies
//     each adapter.InteractionRequest's Standard Webhooks signature with
//     --webhook-secret, answers 202 at once, then decides and POSTs the
//     signed adapter.InteractionCompletion to the request's completion_url,
//     retrying 5xx and connection failures with backoff until the
//     interaction's deadline.
//   - kafka: the partner of the kafka transport. It consumes --request-topic
//     in consumer group --kafka-group and produces each completion to
//     --response-topic keyed by the request's correlation id.
//   - callback: it implements AdapterService on --listen like direct mode,
//     but answers each valid Execute with "accepted" at once (external
//     reference: the payment's provider reference, or the execution id when
//     the payment fails) and finishes the attempt later through the
//     gateway's AdapterCallbackService on --gateway (the interaction-api
//     transport): ReportProgress, RenewLease while it holds the work longer
//     than --renew-every, then CompleteExecution with the outcome direct
//     mode would have answered, retried with backoff while the gateway is
//     unavailable. It authenticates with --adapter-key, which Capstan knows
//     as capabilities[].adapter_key_sha256. The retryable draw is keyed by
//     execution id and attempt, as in direct mode.
//
// In the webhook and kafka modes the retryable draw is keyed by execution id and
// interaction id (each attempt opens a new interaction), and a request sent
// again for an interaction being or already answered is not answered twice.
//
// Flags (each falls back to the environment variable in brackets when not
// given on the command line):
//
//	--mode                [PROVIDER_MODE]               direct, webhook, kafka or callback, default direct
//	--listen              [PROVIDER_LISTEN]             gRPC address (direct, callback), default 127.0.0.1:7070
//	--http-listen         [PROVIDER_HTTP_LISTEN]        HTTP address of POST /requests (webhook), default 127.0.0.1:7071
//	--webhook-secret      [PROVIDER_WEBHOOK_SECRET]     whsec_… secret shared with Capstan (webhook), required there
//	--kafka-brokers       [PROVIDER_KAFKA_BROKERS]      comma-separated seed brokers (kafka), required there
//	--request-topic       [PROVIDER_REQUEST_TOPIC]      topic of the requests (kafka), default payments.requests
//	--response-topic      [PROVIDER_RESPONSE_TOPIC]     topic of the completions (kafka), default payments.responses
//	--kafka-group         [PROVIDER_KAFKA_GROUP]        consumer group (kafka), default csv-payments-provider
//	--gateway             [PROVIDER_GATEWAY]            gRPC address of Capstan's gateway (callback), default 127.0.0.1:7233
//	--adapter-key         [PROVIDER_ADAPTER_KEY]        the adapter's key (callback), required there; prefer the variable
//	--renew-every         [PROVIDER_RENEW_EVERY]        lease renewal rhythm while holding work (callback), default 1s
//	--admin-listen        [PROVIDER_ADMIN_LISTEN]       HTTP address of GET /stats, default "" (off)
//	--latency-min         [PROVIDER_LATENCY_MIN]        shortest latency per attempt, default 5ms
//	--latency-max         [PROVIDER_LATENCY_MAX]        longest latency per attempt, default 30ms
//	--retryable-fraction  [PROVIDER_RETRYABLE_FRACTION] fraction of attempts failing retryably, 0..1, default 0.1
//	--seed                [PROVIDER_SEED]               seed of that choice, default 1
//	--log-level           [PROVIDER_LOG_LEVEL]          debug, info, warn or error, default info
//
// A hidden test flag, --duplicate-completions [PROVIDER_DUPLICATE_COMPLETIONS],
// makes the webhook, kafka and callback modes deliver every completion
// twice.
//
// Logs go to stderr as JSON; inputs, outputs and the adapter key are never
// logged. GET /stats
// answers {"calls":N,"executions":M}: Execute calls (or interaction
// requests) so far and distinct execution ids among them, plus the
// counters of the modes that answer later (see type stats).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/capstan-dev/capstan/internal/telemetry"
	"github.com/capstan-dev/capstan/pkg/adapter"
)

// errConfig is wrapped by parseConfig for invalid flag or environment values.
var errConfig = errors.New("provider: invalid configuration")

// Provider modes (--mode).
const (
	modeDirect  = "direct"
	modeWebhook = "webhook"
	modeKafka   = "kafka"
	// modeCallback answers Execute "accepted" and completes through the
	// gateway's AdapterCallbackService.
	modeCallback = "callback"
)

// config is the provider's configuration.
type config struct {
	// Mode is modeDirect, modeWebhook, modeKafka or modeCallback; "" means
	// modeDirect.
	Mode          string
	Listen        string
	HTTPListen    string
	WebhookSecret string
	// KafkaBrokers is a comma-separated list of seed brokers.
	KafkaBrokers  string
	RequestTopic  string
	ResponseTopic string
	KafkaGroup    string
	// Gateway is the gRPC address of Capstan's gateway (callback mode).
	Gateway string
	// AdapterKey authenticates the callbacks (callback mode). Never log it.
	AdapterKey string
	// RenewEvery is the callback lease's renewal rhythm while the provider
	// holds an attempt (callback mode); after a renewal it is shortened to
	// a third of the remaining lease when that is shorter.
	RenewEvery           time.Duration
	DuplicateCompletions bool
	AdminListen          string
	LatencyMin           time.Duration
	LatencyMax           time.Duration
	RetryableFraction    float64
	Seed                 uint64
	LogLevel             slog.Level
	// drainGrace is how long answers in flight may finish at shutdown in
	// the webhook, kafka and callback modes; 0 means adapter.ShutdownGrace. Not a flag: tests
	// shorten it.
	drainGrace time.Duration
}

// envFallbacks maps flag names to their environment variables.
var envFallbacks = []struct{ flag, env string }{
	{"mode", "PROVIDER_MODE"},
	{"listen", "PROVIDER_LISTEN"},
	{"http-listen", "PROVIDER_HTTP_LISTEN"},
	{"webhook-secret", "PROVIDER_WEBHOOK_SECRET"},
	{"kafka-brokers", "PROVIDER_KAFKA_BROKERS"},
	{"request-topic", "PROVIDER_REQUEST_TOPIC"},
	{"response-topic", "PROVIDER_RESPONSE_TOPIC"},
	{"kafka-group", "PROVIDER_KAFKA_GROUP"},
	{"gateway", "PROVIDER_GATEWAY"},
	{"adapter-key", "PROVIDER_ADAPTER_KEY"},
	{"renew-every", "PROVIDER_RENEW_EVERY"},
	{"duplicate-completions", "PROVIDER_DUPLICATE_COMPLETIONS"},
	{"admin-listen", "PROVIDER_ADMIN_LISTEN"},
	{"latency-min", "PROVIDER_LATENCY_MIN"},
	{"latency-max", "PROVIDER_LATENCY_MAX"},
	{"retryable-fraction", "PROVIDER_RETRYABLE_FRACTION"},
	{"seed", "PROVIDER_SEED"},
	{"log-level", "PROVIDER_LOG_LEVEL"},
}

// parseConfig parses args (without the program name); flags not given fall
// back to getenv. Usage and errors are written to usage.
func parseConfig(args []string, getenv func(string) string, usage io.Writer) (config, error) {
	var cfg config
	fs := flag.NewFlagSet("provider", flag.ContinueOnError)
	fs.SetOutput(usage)
	fs.StringVar(&cfg.Mode, "mode", modeDirect, "protocol: direct (AdapterService), webhook or kafka (await transports), callback (AdapterService answering accepted)")
	fs.StringVar(&cfg.Listen, "listen", "127.0.0.1:7070", "gRPC listen address of AdapterService (direct and callback modes)")
	fs.StringVar(&cfg.HTTPListen, "http-listen", "127.0.0.1:7071", "HTTP listen address of POST "+requestsPath+" (webhook mode)")
	fs.StringVar(&cfg.WebhookSecret, "webhook-secret", "", "whsec_… secret shared with Capstan; verifies requests and signs completions (webhook mode)")
	fs.StringVar(&cfg.KafkaBrokers, "kafka-brokers", "", "comma-separated Kafka seed brokers (kafka mode)")
	fs.StringVar(&cfg.RequestTopic, "request-topic", "payments.requests", "topic of the interaction requests (kafka mode)")
	fs.StringVar(&cfg.ResponseTopic, "response-topic", "payments.responses", "topic of the completions (kafka mode)")
	fs.StringVar(&cfg.KafkaGroup, "kafka-group", "csv-payments-provider", "consumer group of the request topic (kafka mode)")
	fs.StringVar(&cfg.Gateway, "gateway", "127.0.0.1:7233", "gRPC address of Capstan's gateway, for AdapterCallbackService (callback mode)")
	fs.StringVar(&cfg.AdapterKey, "adapter-key", "", "the adapter's key for AdapterCallbackService (callback mode); prefer PROVIDER_ADAPTER_KEY, which stays off the process list")
	fs.DurationVar(&cfg.RenewEvery, "renew-every", time.Second, "renew the callback lease this often while holding an attempt (callback mode); keep it below a third of lease_duration")
	fs.BoolVar(&cfg.DuplicateCompletions, "duplicate-completions", false, "deliver every completion twice (tests)")
	fs.StringVar(&cfg.AdminListen, "admin-listen", "", "HTTP listen address of GET /stats (empty: off)")
	fs.DurationVar(&cfg.LatencyMin, "latency-min", 5*time.Millisecond, "shortest simulated latency per attempt")
	fs.DurationVar(&cfg.LatencyMax, "latency-max", 30*time.Millisecond, "longest simulated latency per attempt")
	fs.Float64Var(&cfg.RetryableFraction, "retryable-fraction", 0.1, "fraction (0..1) of attempts that fail retryably with provider.unavailable")
	fs.Uint64Var(&cfg.Seed, "seed", 1, "seed of the deterministic retryable-failure choice")
	fs.TextVar(&cfg.LogLevel, "log-level", slog.LevelInfo, "log level: debug, info, warn or error")
	fs.Usage = func() { printUsage(fs, usage) }
	if err := fs.Parse(args); err != nil {
		return config{}, fmt.Errorf("%w: %w", errConfig, err)
	}
	if fs.NArg() > 0 {
		return config{}, fmt.Errorf("%w: unexpected arguments %q", errConfig, fs.Args())
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	for _, fe := range envFallbacks {
		if v := getenv(fe.env); v != "" && !given[fe.flag] {
			if err := fs.Set(fe.flag, v); err != nil {
				return config{}, fmt.Errorf("%w: %s=%q: %w", errConfig, fe.env, v, err)
			}
		}
	}
	if err := cfg.validateMode(); err != nil {
		return config{}, err
	}
	switch {
	case cfg.LatencyMin < 0 || cfg.LatencyMax < cfg.LatencyMin:
		return config{}, fmt.Errorf("%w: want 0 <= --latency-min (%s) <= --latency-max (%s)", errConfig, cfg.LatencyMin, cfg.LatencyMax)
	case !(cfg.RetryableFraction >= 0 && cfg.RetryableFraction <= 1):
		return config{}, fmt.Errorf("%w: --retryable-fraction %v is not in [0, 1]", errConfig, cfg.RetryableFraction)
	}
	return cfg, nil
}

// grace returns drainGrace with its default.
func (cfg config) grace() time.Duration {
	if cfg.drainGrace > 0 {
		return cfg.drainGrace
	}
	return adapter.ShutdownGrace
}

// validateMode checks the mode and the flags it needs.
func (cfg config) validateMode() error {
	switch cfg.Mode {
	case modeDirect:
		if cfg.Listen == "" {
			return fmt.Errorf("%w: --listen is empty", errConfig)
		}
	case modeWebhook:
		if cfg.HTTPListen == "" {
			return fmt.Errorf("%w: --http-listen is empty (webhook mode)", errConfig)
		}
		if !strings.HasPrefix(cfg.WebhookSecret, "whsec_") {
			return fmt.Errorf("%w: --webhook-secret: want whsec_<base64> (webhook mode)", errConfig)
		}
		if err := adapter.SignWebhook(http.Header{}, cfg.WebhookSecret, "probe", time.Now(), nil); err != nil {
			return fmt.Errorf("%w: --webhook-secret: %w", errConfig, err)
		}
	case modeCallback:
		switch {
		case cfg.Listen == "":
			return fmt.Errorf("%w: --listen is empty (callback mode)", errConfig)
		case cfg.Gateway == "":
			return fmt.Errorf("%w: --gateway is empty (callback mode)", errConfig)
		case cfg.AdapterKey == "":
			return fmt.Errorf("%w: --adapter-key (or PROVIDER_ADAPTER_KEY) is required (callback mode)", errConfig)
		case len(cfg.AdapterKey) > maxAdapterKeyBytes || strings.ContainsAny(cfg.AdapterKey, " \t\r\n"):
			return fmt.Errorf("%w: --adapter-key: want at most %d bytes without white space (callback mode)", errConfig, maxAdapterKeyBytes)
		case cfg.RenewEvery <= 0:
			return fmt.Errorf("%w: --renew-every %s: want > 0 (callback mode)", errConfig, cfg.RenewEvery)
		}
	case modeKafka:
		switch {
		case len(splitBrokers(cfg.KafkaBrokers)) == 0:
			return fmt.Errorf("%w: --kafka-brokers is empty (kafka mode)", errConfig)
		case cfg.RequestTopic == "" || cfg.ResponseTopic == "":
			return fmt.Errorf("%w: --request-topic and --response-topic are required (kafka mode)", errConfig)
		case cfg.RequestTopic == cfg.ResponseTopic:
			return fmt.Errorf("%w: --request-topic and --response-topic must differ", errConfig)
		case cfg.KafkaGroup == "":
			return fmt.Errorf("%w: --kafka-group is empty (kafka mode)", errConfig)
		}
	default:
		return fmt.Errorf("%w: --mode %q: want direct, webhook, kafka or callback", errConfig, cfg.Mode)
	}
	return nil
}

// hiddenFlags are left out of the usage text.
var hiddenFlags = map[string]bool{"duplicate-completions": true}

// printUsage prints the flags except the hidden ones, as flag.PrintDefaults
// would.
func printUsage(fs *flag.FlagSet, w io.Writer) {
	fmt.Fprintln(w, "Usage of provider:")
	fs.VisitAll(func(f *flag.Flag) {
		if hiddenFlags[f.Name] {
			return
		}
		name, usage := flag.UnquoteUsage(f)
		line := "  --" + f.Name
		if name != "" {
			line += " " + name
		}
		line += "\n    \t" + strings.ReplaceAll(usage, "\n", "\n    \t")
		if f.DefValue != "" && f.DefValue != "false" {
			line += fmt.Sprintf(" (default %q)", f.DefValue)
		}
		fmt.Fprintln(w, line)
	})
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	// Traces as OTEL_TRACES_EXPORTER says (off by default): the adapter's
	// server spans join the trace of the execution they serve.
	tel, err := telemetry.New(ctx, "csv-payments-provider", telemetry.Options{})
	if err != nil {
		stop()
		fmt.Fprintln(os.Stderr, "provider:", err)
		os.Exit(2)
	}
	telemetry.Install(tel)
	err = run(ctx, os.Args[1:], os.Getenv, os.Stderr)
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	if serr := tel.Shutdown(sctx); serr != nil {
		fmt.Fprintln(os.Stderr, "provider: telemetry shutdown:", serr)
	}
	cancel()
	stop()
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "provider:", err)
		os.Exit(1)
	}
}

// run parses the configuration, opens the listeners and serves until ctx
// ends. Logs go to stderr as JSON.
func run(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) error {
	cfg, err := parseConfig(args, getenv, stderr)
	if err != nil {
		return err
	}
	logger := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: cfg.LogLevel}))
	var lc net.ListenConfig
	var lis net.Listener
	switch cfg.Mode {
	case modeDirect, modeCallback:
		if lis, err = lc.Listen(ctx, "tcp", cfg.Listen); err != nil {
			return fmt.Errorf("provider: listen %s: %w", cfg.Listen, err)
		}
	case modeWebhook:
		if lis, err = lc.Listen(ctx, "tcp", cfg.HTTPListen); err != nil {
			return fmt.Errorf("provider: listen %s: %w", cfg.HTTPListen, err)
		}
	}
	var adminLis net.Listener
	if cfg.AdminListen != "" {
		adminLis, err = lc.Listen(ctx, "tcp", cfg.AdminListen)
		if err != nil {
			if lis != nil {
				_ = lis.Close()
			}
			return fmt.Errorf("provider: listen %s: %w", cfg.AdminListen, err)
		}
	}
	return serve(ctx, cfg, lis, adminLis, logger)
}

// serve serves the provider in cfg.Mode — AdapterService (direct and
// callback) or the webhook transport on lis, the kafka transport (lis is
// nil) — and, when
// adminLis is not nil, GET /stats on adminLis, until ctx ends. It closes
// both listeners.
func serve(ctx context.Context, cfg config, lis, adminLis net.Listener, logger *slog.Logger) error {
	if cfg.Mode == "" {
		cfg.Mode = modeDirect
	}
	p := newProvider(cfg, logger)
	addr := ""
	if lis != nil {
		addr = lis.Addr().String()
	}
	logger.InfoContext(ctx, "provider starting",
		slog.String("mode", cfg.Mode),
		slog.String("listen", addr),
		slog.Duration("latency_min", cfg.LatencyMin),
		slog.Duration("latency_max", cfg.LatencyMax),
		slog.Float64("retryable_fraction", cfg.RetryableFraction),
		slog.Uint64("seed", cfg.Seed))

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	var adminErr error
	if adminLis != nil {
		srv := &http.Server{Handler: p.adminHandler(), ReadHeaderTimeout: 5 * time.Second}
		wg.Go(func() {
			<-ctx.Done()
			sctx, stop := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer stop()
			_ = srv.Shutdown(sctx)
		})
		wg.Go(func() {
			logger.InfoContext(ctx, "admin listening", slog.String("addr", adminLis.Addr().String()))
			if err := srv.Serve(adminLis); !errors.Is(err, http.ErrServerClosed) {
				adminErr = err
				cancel() // stop the gRPC server too
			}
		})
	}

	var err error
	switch cfg.Mode {
	case modeWebhook:
		err = serveWebhook(ctx, cfg, p, lis, logger)
	case modeKafka:
		err = serveKafka(ctx, cfg, p, logger)
	case modeCallback:
		err = serveCallback(ctx, cfg, p, lis, logger)
	default:
		err = adapter.Serve(ctx, lis, p, logger)
	}
	cancel()
	wg.Wait()
	if adminErr != nil && err == nil {
		err = fmt.Errorf("provider: admin server: %w", adminErr)
	}
	s := p.snapshot()
	logger.InfoContext(context.WithoutCancel(ctx), "provider stopped", slog.Int64("calls", s.Calls), slog.Int("executions", s.Executions),
		slog.Int("interactions", s.Interactions), slog.Int64("resent", s.Resent), slog.Int64("completions", s.Completions), slog.Int64("duplicate_acks", s.DuplicateAcks),
		slog.Int64("dropped", s.Dropped), slog.Int64("renewals", s.Renewals))
	return err
}
