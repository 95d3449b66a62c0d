// Package devstack implements `capstanctl dev`: the embedded default. It
// starts a throwaway PostgreSQL cluster (unless DATABASE_URL is set) and an
// embedded Kafka (kfake, unless KAFKA_BROKERS is set), applies the schema,
// registers a demo application, then starts the four daemons and the
// csv-payments example processes as separate OS processes with their logs in
// a run folder, and stops everything cleanly on exit or Ctrl-C.
//
// The demo mode picks how Capstan reaches the example provider: "direct"
// calls its AdapterService; "webhook" and "kafka" make payments.send a
// release whose step is an await on that transport (SYSTEM §6), so every
// attempt parks WAITING_EXTERNAL until the provider completes it — a signed
// POST back to the gateway's completion endpoint, or a record on the
// response topic; "callback" calls its AdapterService, which answers
// "accepted", so every attempt parks on the interaction-api transport until
// the provider calls the gateway's AdapterCallbackService with the
// attempt's callback token and its adapter key.
//
// The demo shape picks what one execution is: "row" (default) invokes
// payments.send once per CSV row, in the chosen mode; "file" makes the
// whole file one execution of payments.process-file, a release declared
// as steps (SYSTEM §6): the application uploads the CSV into the run's
// object store (<run folder>/objects), the consumer streams its rows as
// items over the kafka transport to the provider (at most a window of them
// in flight) and publishes the output CSV as one object, which the
// application copies to its output path. The file shape always uses the
// kafka transport: with it the demo mode must be direct (the default,
// which then means kafka) or kafka.
package devstack

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/capstan-dev/capstan/internal/kafka"
	"github.com/capstan-dev/capstan/internal/kafkatest"
	"github.com/capstan-dev/capstan/internal/pgcluster"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/pkg/adapter"
)

// demoApplication is the name the dev stack registers the demo application
// under; in the file shape it is also the prefix of its objects.
const demoApplication = "csv-payments-demo"

// Options configure a dev stack run.
type Options struct {
	// BinDir holds the gateway, dispatcher, consumer, router and example
	// binaries (make build puts them in bin/).
	BinDir string
	// RunDir is the parent of the run folder. Default "run".
	RunDir string
	// DemoInput, when set, runs the csv-payments app on this CSV and stops
	// the stack when it finishes. Empty: run until ctx ends.
	DemoInput string
	// DemoMode is how Capstan reaches the provider: ModeDirect (default),
	// ModeWebhook, ModeKafka or ModeCallback.
	DemoMode string
	// DemoShape is what one execution is: ShapeRow (default, one per CSV
	// row) or ShapeFile (the whole file, over the kafka transport; DemoMode
	// must then be empty, ModeDirect or ModeKafka).
	DemoShape string
	// DatabaseURL, when set, is used instead of a throwaway cluster.
	DatabaseURL string
	// KafkaBrokers, when set, are used instead of the embedded Kafka.
	KafkaBrokers []string
	// Out receives the human-readable progress and the demo summary.
	Out    io.Writer
	Logger *slog.Logger
}

// Demo modes (Options.DemoMode).
const (
	// ModeDirect: the consumer calls the provider's AdapterService.
	ModeDirect = "direct"
	// ModeWebhook: an await step on the webhook transport; the provider
	// receives signed POSTs and POSTs completions to the gateway.
	ModeWebhook = "webhook"
	// ModeKafka: an await step on the kafka transport; requests and
	// completions travel on RequestTopic and ResponseTopic.
	ModeKafka = "kafka"
	// ModeCallback: the consumer calls the provider's AdapterService, which
	// answers "accepted" and completes later through the gateway's
	// AdapterCallbackService (the interaction-api transport),
	// authenticated by a per-run adapter key.
	ModeCallback = "callback"
)

// The kafka demo mode's topics.
const (
	RequestTopic  = "payments.requests"
	ResponseTopic = "payments.responses"
)

// Demo shapes (Options.DemoShape).
const (
	// ShapeRow: the application invokes payments.send once per row.
	ShapeRow = "row"
	// ShapeFile: the application uploads the file and invokes
	// FileCapability once; its rows travel as items on ItemRequestTopic
	// and ItemResponseTopic.
	ShapeFile = "file"
)

// FileCapability is the file shape's capability, a release declared as
// steps.
const FileCapability = "payments.process-file"

// The file shape's item topics.
const (
	ItemRequestTopic  = "payments.items.requests"
	ItemResponseTopic = "payments.items.responses"
)

// fileWindow is the file shape's await.window: the items sent and not yet
// consumed at most.
const fileWindow = 128

// awaitTimeout is the demo's interaction deadline (await.timeout).
const awaitTimeout = 2 * time.Minute

var (
	// ErrDemoFailed is returned when the demo application exits non-zero.
	ErrDemoFailed = errors.New("demo application failed")
	// ErrDemoMode is returned for an unknown Options.DemoMode.
	ErrDemoMode = errors.New("unknown demo mode")
	// ErrShapeMode is returned for a demo mode the demo shape cannot run
	// (the file shape with webhook or callback).
	ErrShapeMode = errors.New("demo mode not available in this demo shape")
	// ErrDemoShape is returned for an unknown Options.DemoShape.
	ErrDemoShape = errors.New("unknown demo shape")
)

// Run starts the stack and runs it until the demo finishes or ctx ends.
func Run(ctx context.Context, o Options) (err error) {
	if o.RunDir == "" {
		o.RunDir = "run"
	}
	switch o.DemoMode {
	case "":
		o.DemoMode = ModeDirect
	case ModeDirect, ModeWebhook, ModeKafka, ModeCallback:
	default:
		return fmt.Errorf("%w %q: want %s, %s, %s or %s", ErrDemoMode, o.DemoMode, ModeDirect, ModeWebhook, ModeKafka, ModeCallback)
	}
	switch o.DemoShape {
	case "":
		o.DemoShape = ShapeRow
	case ShapeRow:
	case ShapeFile:
		// The file shape runs over the kafka transport; direct is the
		// default mode and means "not chosen".
		if o.DemoMode != ModeDirect && o.DemoMode != ModeKafka {
			return fmt.Errorf("%w: mode %q, shape %s: the file shape always uses the kafka transport (use mode %s, the default, or %s)",
				ErrShapeMode, o.DemoMode, ShapeFile, ModeDirect, ModeKafka)
		}
		o.DemoMode = ModeKafka
	default:
		return fmt.Errorf("%w %q: want %s or %s", ErrDemoShape, o.DemoShape, ShapeRow, ShapeFile)
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	runDir, err := filepath.Abs(filepath.Join(o.RunDir, time.Now().UTC().Format("20060102T150405Z")))
	if err != nil {
		return err
	}
	if err := os.MkdirAll(runDir, 0o755); err != nil {
		return err
	}
	fmt.Fprintf(o.Out, "run folder: %s\n", runDir)
	// Cleanup runs under a detached context: Ctrl-C cancels ctx, and the
	// stack must still be torn down.
	cleanupCtx := context.WithoutCancel(ctx)
	var cleanups []func()
	defer func() {
		for i := len(cleanups) - 1; i >= 0; i-- {
			cleanups[i]()
		}
	}()

	dbURL := o.DatabaseURL
	if dbURL == "" {
		cl, err := pgcluster.Start(ctx, pgcluster.Options{Logger: o.Logger})
		if err != nil {
			return fmt.Errorf("throwaway PostgreSQL: %w", err)
		}
		cleanups = append(cleanups, func() {
			sctx, cancel := context.WithTimeout(cleanupCtx, 30*time.Second)
			defer cancel()
			if err := cl.Stop(sctx); err != nil {
				fmt.Fprintf(o.Out, "stop PostgreSQL: %v\n", err)
			}
		})
		if err := createDatabase(ctx, cl.URL("postgres"), "capstan"); err != nil {
			return err
		}
		dbURL = cl.URL("capstan")
		fmt.Fprintf(o.Out, "PostgreSQL: throwaway cluster on port %d (removed on exit)\n", cl.Port())
	} else {
		fmt.Fprintln(o.Out, "PostgreSQL: DATABASE_URL")
	}
	if _, err := pgstore.Migrate(ctx, dbURL, nil); err != nil {
		return err
	}

	objectsDir := ""
	if o.DemoShape == ShapeFile {
		objectsDir = filepath.Join(runDir, "objects")
		if err := os.MkdirAll(objectsDir, 0o755); err != nil {
			return err
		}
	}
	topics := map[string]int32{executionTopic: executionPartitions}
	switch {
	case o.DemoShape == ShapeFile:
		topics[ItemRequestTopic], topics[ItemResponseTopic] = executionPartitions, executionPartitions
	case o.DemoMode == ModeKafka:
		topics[RequestTopic], topics[ResponseTopic] = executionPartitions, executionPartitions
	}
	brokers := o.KafkaBrokers
	if len(brokers) == 0 {
		kc, err := kafkatest.Start(ctx, kafkatest.Options{Topics: topics, Logger: o.Logger})
		if err != nil {
			return fmt.Errorf("embedded Kafka: %w", err)
		}
		cleanups = append(cleanups, kc.Close)
		brokers = kc.Brokers()
		fmt.Fprintf(o.Out, "Kafka: embedded kfake at %s\n", strings.Join(brokers, ","))
	} else {
		fmt.Fprintf(o.Out, "Kafka: KAFKA_BROKERS %s\n", strings.Join(brokers, ","))
		if err := ensureTopics(ctx, brokers, topics, o.Logger); err != nil {
			return err
		}
	}

	ports, err := FreePorts(11)
	if err != nil {
		return err
	}
	s := stack{
		gateway: ports[0], gatewayAdmin: ports[1], dispatcher: ports[2], dispatcherAdmin: ports[3],
		consumerAdmin: ports[4], routerAdmin: ports[5], provider: ports[6], app: ports[7],
		gatewayHTTP: ports[8], providerHTTP: ports[9], providerAdmin: ports[10],
		dbURL: dbURL, brokers: brokers, mode: o.DemoMode, shape: o.DemoShape, objectsDir: objectsDir,
		adminToken: randomKey("adm_"),
	}
	s.secrets()
	cfgPath := filepath.Join(runDir, "capstan.yaml")
	if err := os.WriteFile(cfgPath, []byte(s.config()), 0o600); err != nil {
		return err
	}

	apiKey, secret := randomKey("cap_"), "whsec_"+randomB64(32)
	st, err := pgstore.Open(ctx, dbURL, o.Logger)
	if err != nil {
		return err
	}
	_, err = st.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{
		Name: demoApplication, APIKey: apiKey,
		WebhookURL: fmt.Sprintf("http://127.0.0.1:%d/events", s.app), WebhookSecret: secret,
	})
	st.Close()
	if err != nil {
		return err
	}

	var procs []*process
	cleanups = append(cleanups, func() {
		for i := len(procs) - 1; i >= 0; i-- {
			if err := procs[i].stop(15 * time.Second); err != nil {
				fmt.Fprintf(o.Out, "stop %s: %v\n", procs[i].name, err)
			}
		}
	})
	start := func(name, bin string, args, env []string) error {
		p, err := startProcess(name, filepath.Join(o.BinDir, bin), args, env, runDir, nil)
		if err != nil {
			return err
		}
		procs = append(procs, p)
		return nil
	}
	cfgArgs := []string{"--config", cfgPath}
	providerArgs, providerEnv := s.providerArgs()
	if err := start("provider", "csv-payments-provider", providerArgs, providerEnv); err != nil {
		return err
	}
	for _, d := range []string{"gateway", "dispatcher", "consumer", "router"} {
		if err := start(d, d, cfgArgs, nil); err != nil {
			return err
		}
	}
	for _, url := range []string{
		fmt.Sprintf("http://127.0.0.1:%d/stats", s.providerAdmin),
		fmt.Sprintf("http://127.0.0.1:%d/readyz", s.gatewayAdmin),
		fmt.Sprintf("http://127.0.0.1:%d/readyz", s.dispatcherAdmin),
		fmt.Sprintf("http://127.0.0.1:%d/readyz", s.consumerAdmin),
		fmt.Sprintf("http://127.0.0.1:%d/readyz", s.routerAdmin),
	} {
		if err := waitReady(ctx, url, 60*time.Second, procs); err != nil {
			return err
		}
	}
	fmt.Fprintf(o.Out, "daemons ready: gateway 127.0.0.1:%d (gRPC, reflection on), logs in %s\n", s.gateway, runDir)
	if s.shape == ShapeFile {
		fmt.Fprintf(o.Out, "demo shape file: %s\n", s.describeMode())
	} else {
		fmt.Fprintf(o.Out, "demo mode %s: %s\n", s.mode, s.describeMode())
	}

	appEnv := []string{
		fmt.Sprintf("CAPSTAN_GATEWAY=127.0.0.1:%d", s.gateway),
		"CAPSTAN_API_KEY=" + apiKey,
		fmt.Sprintf("APP_WEBHOOK_LISTEN=127.0.0.1:%d", s.app),
		"APP_WEBHOOK_SECRET=" + secret,
	}
	appArgs := []string{"--out-dir", runDir}
	if s.shape == ShapeFile {
		appArgs = append(appArgs, "--shape", ShapeFile, "--objects-dir", s.objectsDir, "--objects-prefix", demoApplication)
	}
	if o.DemoInput == "" {
		fmt.Fprintf(o.Out, "application %s: %s\n", demoApplication, strings.Join(appEnv[:2], " "))
		fmt.Fprintf(o.Out, "operator API: CAPSTAN_ADMIN_ADDR=127.0.0.1:%d CAPSTAN_ADMIN_TOKEN=%s (capstanctl consumers/events)\n", s.gateway, s.adminToken)
		if s.shape == ShapeFile {
			fmt.Fprintf(o.Out, "object store: %s (invoke %s with {\"source\": \"%s/<key>\", \"output\": \"%s/<key>\"}: an application's objects live under its name)\n",
				s.objectsDir, FileCapability, demoApplication, demoApplication)
		}
		fmt.Fprintf(o.Out, "note: the application's webhook consumer %s has no listener without --demo-input; its events retry and end DEAD (replayable)\n",
			fmt.Sprintf("http://127.0.0.1:%d/events", s.app))
		fmt.Fprintln(o.Out, "Press Ctrl-C to stop.")
		<-ctx.Done()
		return nil
	}
	in, err := filepath.Abs(o.DemoInput)
	if err != nil {
		return err
	}
	app, err := startProcess("app", filepath.Join(o.BinDir, "csv-payments-app"),
		append([]string{"--input", in}, appArgs...), appEnv, runDir, o.Out)
	if err != nil {
		return err
	}
	procs = append(procs, app)
	if err := app.wait(ctx); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("%w: %v (see %s/app.log)", ErrDemoFailed, err, runDir)
	}
	return nil
}

const (
	executionTopic      = "capstan.executions"
	executionPartitions = 8
)

type stack struct {
	gateway, gatewayAdmin, dispatcher, dispatcherAdmin, consumerAdmin, routerAdmin, provider, app int
	// gatewayHTTP serves the webhook transport's completions; providerHTTP
	// the provider's POST /requests; providerAdmin its GET /stats.
	gatewayHTTP, providerHTTP, providerAdmin int
	dbURL                                    string
	brokers                                  []string
	mode                                     string
	// shape is ShapeRow or ShapeFile (whose mode is always ModeKafka);
	// objectsDir is the file shape's object_store.dir.
	shape, objectsDir string
	// awaitSecret (whsec_…) is shared by Capstan and the provider in
	// webhook mode; callbackSecret signs resume tokens (await modes) and
	// callback tokens (callback mode).
	awaitSecret, callbackSecret string
	// adminToken enables the gateway's admin API (capstanctl consumers and
	// events) for this run.
	adminToken string
	// adapterKey is the provider's key for AdapterCallbackService
	// (callback mode); the configuration holds only its SHA-256.
	adapterKey string
}

// secrets draws the mode's per-run secrets.
func (s *stack) secrets() {
	switch s.mode {
	case ModeWebhook, ModeKafka:
		s.awaitSecret, s.callbackSecret = "whsec_"+randomB64(32), randomB64(32)
	case ModeCallback:
		s.callbackSecret, s.adapterKey = randomB64(32), randomKey("ak_")
	}
}

// providerArgs returns the provider's flags and environment for the mode.
// The webhook secret and the adapter key go through the environment, not
// the command line.
func (s stack) providerArgs() (args, env []string) {
	args = []string{"--mode", s.mode, "--admin-listen", fmt.Sprintf("127.0.0.1:%d", s.providerAdmin)}
	switch s.mode {
	case ModeWebhook:
		args = append(args, "--http-listen", fmt.Sprintf("127.0.0.1:%d", s.providerHTTP))
		env = append(env, "PROVIDER_WEBHOOK_SECRET="+s.awaitSecret)
	case ModeKafka:
		req, resp := RequestTopic, ResponseTopic
		if s.shape == ShapeFile {
			req, resp = ItemRequestTopic, ItemResponseTopic
		}
		args = append(args, "--kafka-brokers", strings.Join(s.brokers, ","), "--request-topic", req,
			"--response-topic", resp, "--kafka-group", "csv-payments-provider")
		if s.shape == ShapeFile {
			// A transient failure of an item is a terminal row in the file
			// shape (the item's interaction spans attempts), while the row
			// shape retries it: without them both shapes write the same
			// output.
			args = append(args, "--retryable-fraction", "0")
		}
	case ModeCallback:
		args = append(args, "--listen", fmt.Sprintf("127.0.0.1:%d", s.provider), "--gateway", fmt.Sprintf("127.0.0.1:%d", s.gateway))
		env = append(env, "PROVIDER_ADAPTER_KEY="+s.adapterKey)
	default:
		args = append(args, "--listen", fmt.Sprintf("127.0.0.1:%d", s.provider))
	}
	return args, env
}

// describeMode says in one line how Capstan reaches the provider.
func (s stack) describeMode() string {
	if s.shape == ShapeFile {
		return fmt.Sprintf("the whole file is one execution of %s: rows as items on %s (window %d), completions on %s, output published in %s",
			FileCapability, ItemRequestTopic, fileWindow, ItemResponseTopic, s.objectsDir)
	}
	switch s.mode {
	case ModeWebhook:
		return fmt.Sprintf("await step, signed POSTs to 127.0.0.1:%d/requests, completions to 127.0.0.1:%d%s",
			s.providerHTTP, s.gatewayHTTP, adapter.CompletionPath)
	case ModeKafka:
		return fmt.Sprintf("await step, requests on %s, completions on %s", RequestTopic, ResponseTopic)
	case ModeCallback:
		return fmt.Sprintf("AdapterService calls to 127.0.0.1:%d answered accepted, completions through AdapterCallbackService on 127.0.0.1:%d",
			s.provider, s.gateway)
	}
	return fmt.Sprintf("AdapterService calls to 127.0.0.1:%d", s.provider)
}

// awaitConfig renders the mode's await step of payments.send (empty in
// direct and callback modes).
func (s stack) awaitConfig() string {
	switch s.mode {
	case ModeWebhook:
		return fmt.Sprintf(`    await:
      transport: webhook
      url: http://127.0.0.1:%d/requests
      secret: %q
      timeout: %s
`, s.providerHTTP, s.awaitSecret, awaitTimeout)
	case ModeKafka:
		return fmt.Sprintf(`    await:
      transport: kafka
      request_topic: %s
      response_topic: %s
      timeout: %s
`, RequestTopic, ResponseTopic, awaitTimeout)
	}
	return ""
}

// adapterKeyConfig renders payments.send's adapter_key_sha256 (callback
// mode; empty otherwise): the gateway authenticates the provider's
// callbacks by it.
func (s stack) adapterKeyConfig() string {
	if s.adapterKey == "" {
		return ""
	}
	sum := sha256.Sum256([]byte(s.adapterKey))
	return fmt.Sprintf("    adapter_key_sha256: %s\n", hex.EncodeToString(sum[:]))
}

// gatewayAwaitConfig renders the gateway's completion endpoint and the
// callback secret of the modes other than direct (empty in direct mode).
// All of them need the secret — the resume tokens of the webhook and
// kafka transports and the callback tokens of callback mode are signed
// with it — and, as the gateway serves the completion endpoint whenever
// the secret is set, the endpoint must not take the default :7239 on
// every interface.
func (s stack) gatewayAwaitConfig() (gateway, top string) {
	if s.mode == ModeDirect {
		return "", ""
	}
	return fmt.Sprintf("  http_listen: 127.0.0.1:%d\n  public_url: http://127.0.0.1:%d\n", s.gatewayHTTP, s.gatewayHTTP),
		fmt.Sprintf("callback_secret: %q\n", s.callbackSecret)
}

// config renders the daemons' configuration with time compressed for the
// demo: retries after 200 ms … 5 s instead of 1 min … 6 h.
func (s stack) config() string {
	gw, top := s.gatewayAwaitConfig()
	return fmt.Sprintf(`# Written by capstanctl dev for one run (%s); time is compressed for the demo.
%sdatabase:
  url: %q
kafka:
  brokers: [%s]
  execution_topic: %s
  execution_partitions: %d
gateway:
  listen: 127.0.0.1:%d
  admin_listen: 127.0.0.1:%d
  dispatcher_addr: 127.0.0.1:%d
  admin_token: %q
%sdispatcher:
  listen: 127.0.0.1:%d
  admin_listen: 127.0.0.1:%d
  pass_interval: 200ms
consumer:
  admin_listen: 127.0.0.1:%d
  reap_interval: 1s
  max_in_flight: 256
router:
  admin_listen: 127.0.0.1:%d
  poll_interval: 100ms
  retry_delays: [200ms, 1s, 2s, 5s, 10s]
  timeout: 5s
  claim_ttl: 20s
  # One application gets the whole router here (the default of 8 in
  # flight per application protects tenants from each other).
  concurrency: 64
  per_application_concurrency: 64
log:
  level: info
%s`, s.describeRun(), top, s.dbURL, strings.Join(s.brokers, ", "), executionTopic, executionPartitions,
		s.gateway, s.gatewayAdmin, s.dispatcher, s.adminToken, gw, s.dispatcher, s.dispatcherAdmin, s.consumerAdmin, s.routerAdmin,
		s.capabilitiesConfig())
}

// describeRun names the run's demo mode and shape in the configuration's
// first line.
func (s stack) describeRun() string {
	if s.shape == ShapeFile {
		return "demo shape file, kafka transport"
	}
	return "demo mode " + s.mode
}

// capabilitiesConfig renders the capabilities: payments.send in the row
// shape, payments.process-file in the file shape.
func (s stack) capabilitiesConfig() string {
	if s.shape == ShapeFile {
		return s.fileCapabilityConfig()
	}
	return fmt.Sprintf(`capabilities:
  - name: payments.send
    release: v1
    adapter: 127.0.0.1:%d
    max_attempts: 10
    retry_delays: [200ms, 500ms, 1s, 2s, 5s]
    attempt_timeout: 5s
    lease_duration: 10s
    async_budget: 10m
%s%s`, s.provider, s.adapterKeyConfig(), s.awaitConfig())
}

// fileColumns are the file shape's output columns: the row shape's output
// header (examples/csv-payments/app, OutputHeader), Attempts being how
// many times the row's request was sent and ExecutionID the file's
// execution.
var fileColumns = [][2]string{
	{"ID", "item.ID"}, {"Recipient", "item.Recipient"}, {"Amount", "item.Amount"}, {"Currency", "item.Currency"},
	{"Status", "status"}, {"ProviderReference", "result.provider_reference"}, {"Fee", "result.fee"},
	{"FailureClass", "failure.class"}, {"FailureMessage", "failure.message"},
	{"Attempts", "sends"}, {"ExecutionID", "execution_id"},
}

// fileCapabilityConfig renders payments.process-file and the object store
// of the file shape.
func (s stack) fileCapabilityConfig() string {
	var cols strings.Builder
	for _, c := range fileColumns {
		fmt.Fprintf(&cols, "          - {name: %s, value: %s}\n", c[0], c[1])
	}
	return fmt.Sprintf(`object_store:
  dir: %q
capabilities:
  # The whole CSV is one execution: input {"source": "<key>", "output": "<key>"}.
  - name: %s
    release: v1
    max_attempts: 10
    retry_delays: [200ms, 500ms, 1s, 2s, 5s]
    lease_duration: 10s
    async_budget: 10m
    steps:
      source:
        format: csv
      await:
        transport: kafka
        request_topic: %s
        response_topic: %s
        window: %d
        timeout: %s
      publish:
        format: csv
        columns:
%s`, s.objectsDir, FileCapability, ItemRequestTopic, ItemResponseTopic, fileWindow, awaitTimeout, cols.String())
}

// ensureTopics creates the topics on an external Kafka unless they exist.
func ensureTopics(ctx context.Context, brokers []string, topics map[string]int32, logger *slog.Logger) error {
	cl, err := kafka.NewClient(brokers, logger)
	if err != nil {
		return err
	}
	defer cl.Close()
	for t, n := range topics {
		if err := kafka.EnsureTopic(ctx, cl, t, n); err != nil {
			return fmt.Errorf("kafka: %w", err)
		}
	}
	return nil
}

func createDatabase(ctx context.Context, adminURL, name string) error {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
	if err != nil {
		return fmt.Errorf("create database %s: %w", name, err)
	}
	return nil
}

// waitReady polls url until it answers 200, a process exits, or timeout.
func waitReady(ctx context.Context, url string, timeout time.Duration, procs []*process) error {
	deadline := time.Now().Add(timeout)
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		for _, p := range procs {
			if p.cmd.ProcessState != nil || len(p.done) > 0 {
				return fmt.Errorf("%s exited during start; see %s.log in the run folder", p.name, p.name)
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready after %v", url, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func randomKey(prefix string) string {
	b := make([]byte, 24)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

func randomB64(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return base64.StdEncoding.EncodeToString(b)
}
