package e2e_test

// The process-level harness of the failure tests: one Capstan stack per
// test, every daemon a separate OS process that the test can start, kill,
// pause, resume and terminate individually, on a fresh database and an
// in-process kfake broker, with time compressed so that leases, session
// timeouts and retries happen within seconds.

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/capstan-dev/capstan/examples/csv-payments/payment"
	"github.com/capstan-dev/capstan/internal/devstack"
	"github.com/capstan-dev/capstan/internal/kafkatest"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/testutil/pgtest"
	"github.com/capstan-dev/capstan/pkg/client"
)

const (
	capability          = "payments.send"
	executionTopic      = "capstan.executions"
	executionPartitions = 8
	// readyTimeout bounds one process's start until its health endpoint
	// answers 200.
	readyTimeout = 60 * time.Second
	// stopGrace is how long cleanup waits after SIGTERM before SIGKILL; it
	// exceeds the daemons' own shutdown grace (daemon.Grace, 10s).
	stopGrace = 15 * time.Second
)

// stackOptions configure a stack. Zero values take the defaults noted.
type stackOptions struct {
	// DatabaseURL is a migrated database to use; "" creates a fresh one
	// with pgtest.NewDatabase.
	DatabaseURL string
	// ProviderLatencyMin/Max bound the mock provider's latency per
	// attempt. Default 20ms..80ms.
	ProviderLatencyMin, ProviderLatencyMax time.Duration
	// RetryableFraction of attempts the provider fails retryably.
	// Negative means 0; zero means the default 0.05.
	RetryableFraction float64
	// LeaseDuration of payments.send. Default 1s.
	LeaseDuration time.Duration
	// AttemptTimeout of payments.send. Default 5s.
	AttemptTimeout time.Duration
	// SessionTimeout is consumer.session_timeout. Default 6s (the
	// regression test checks that a 2s one works too).
	SessionTimeout time.Duration
	// Env is added to the environment of every process of the stack,
	// the provider included (e.g. OTEL_TRACES_EXPORTER=console).
	Env []string
	// SeparateStdout writes each process's standard output to
	// <dir>/<name>.stdout (proc.stdoutPath) instead of its log, which then
	// holds standard error only.
	SeparateStdout bool
	// Steps adds the release declared as steps stepsCapability over the
	// kafka transport (stack.stepsConfig, steps_test.go), a callback
	// secret, the object store <dir>/objects (stack.objects) and the
	// transport's topics. StepsWindow is its window. Default 32.
	Steps       bool
	StepsWindow int
}

func (o *stackOptions) defaults() {
	if o.ProviderLatencyMin == 0 && o.ProviderLatencyMax == 0 {
		o.ProviderLatencyMin, o.ProviderLatencyMax = 20*time.Millisecond, 80*time.Millisecond
	}
	switch {
	case o.RetryableFraction < 0:
		o.RetryableFraction = 0
	case o.RetryableFraction == 0:
		o.RetryableFraction = 0.05
	}
	if o.LeaseDuration == 0 {
		o.LeaseDuration = time.Second
	}
	if o.AttemptTimeout == 0 {
		o.AttemptTimeout = 5 * time.Second
	}
	if o.SessionTimeout == 0 {
		o.SessionTimeout = 6 * time.Second
	}
	if o.Steps && o.StepsWindow == 0 {
		o.StepsWindow = 32
	}
}

// stack is one Capstan deployment of a test. Create it with newStack; start
// its processes with startProvider, startGateway, startDispatcher,
// startRouter and startConsumer (or startAll). Everything is stopped and
// removed when the test ends; on failure the tail of every process log is
// printed.
type stack struct {
	t        testing.TB
	opts     stackOptions
	bin      string
	dir      string // config and process logs
	cfgPath  string
	dbURL    string
	db       *pgxpool.Pool
	apiKey   string
	receiver *receiver
	client   *client.Client
	brokers  []string
	objects  string // the object store's root, with Steps

	gateway, gatewayAdmin, dispatcher, dispatcherAdmin, routerAdmin, provider, providerAdmin int

	mu    sync.Mutex
	procs []*proc // every process started, in order, restarted ones included
}

// newStack builds the binaries (once per test binary), prepares the
// database (fresh unless opts.DatabaseURL), starts kfake with the execution
// topic, writes the configuration, registers an application whose webhook
// is an in-test receiver, and dials the gateway. It starts no process.
func newStack(t testing.TB, opts stackOptions) *stack {
	t.Helper()
	opts.defaults()
	s := &stack{t: t, opts: opts, bin: buildBinaries(t), dir: t.TempDir()}
	ctx := t.Context()

	s.dbURL = opts.DatabaseURL
	if s.dbURL == "" {
		s.dbURL = pgtest.NewDatabase(t, func(ctx context.Context, url string) error {
			_, err := pgstore.Migrate(ctx, url, nil)
			return err
		})
	}
	db, err := pgxpool.New(ctx, s.dbURL)
	require.NoError(t, err)
	t.Cleanup(db.Close)
	s.db = db

	topics := map[string]int32{executionTopic: executionPartitions}
	if opts.Steps {
		topics[stepsRequestTopic], topics[stepsResponseTopic] = executionPartitions, executionPartitions
		s.objects = filepath.Join(s.dir, "objects")
		require.NoError(t, os.MkdirAll(s.objects, 0o755))
	}
	kc, err := kafkatest.Start(ctx, kafkatest.Options{
		Topics: topics,
		Extra:  []kfake.Opt{kfake.GroupMinSessionTimeout(500 * time.Millisecond)},
	})
	require.NoError(t, err)
	t.Cleanup(kc.Close)
	s.brokers = kc.Brokers()

	s.receiver = newReceiver()
	srv := httptest.NewServer(s.receiver) // listens on 127.0.0.1
	t.Cleanup(srv.Close)

	ports := freePorts(t, 7)
	s.gateway, s.gatewayAdmin, s.dispatcher, s.dispatcherAdmin = ports[0], ports[1], ports[2], ports[3]
	s.routerAdmin, s.provider, s.providerAdmin = ports[4], ports[5], ports[6]
	s.cfgPath = filepath.Join(s.dir, "capstan.yaml")
	require.NoError(t, os.WriteFile(s.cfgPath, []byte(s.config(kc.Brokers())), 0o600))

	var key, secret [32]byte
	_, _ = rand.Read(key[:]) // crypto/rand.Read never fails
	_, _ = rand.Read(secret[:])
	s.apiKey = "cap_e2e_" + hex.EncodeToString(key[:])
	st, err := pgstore.Open(ctx, s.dbURL, nil)
	require.NoError(t, err)
	_, err = st.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{
		Name: "e2e-failures", APIKey: s.apiKey, WebhookURL: srv.URL + "/events",
		WebhookSecret: "whsec_" + base64.StdEncoding.EncodeToString(secret[:]),
	})
	st.Close()
	require.NoError(t, err)

	cl, err := client.Dial(ctx, fmt.Sprintf("127.0.0.1:%d", s.gateway), s.apiKey)
	require.NoError(t, err)
	t.Cleanup(func() { _ = cl.Close() })
	s.client = cl

	// Registered last, so it runs first: processes stop before Kafka,
	// the receiver and the database go away, and logs are printed before
	// the temporary directory is removed.
	t.Cleanup(s.cleanup)
	return s
}

// config renders the daemons' configuration with time compressed: leases
// of about a second, a 200ms reaper, a 6s Kafka session, retries after
// 50-200ms. With stackOptions.Steps, stepsConfig is appended.
func (s *stack) config(brokers []string) string {
	o := s.opts
	steps := ""
	if o.Steps {
		steps = s.stepsConfig()
	}
	return fmt.Sprintf(`# Written by the e2e failure tests; time is compressed.
database:
  url: %q
kafka:
  brokers: [%s]
  execution_topic: %s
  execution_partitions: %d
gateway:
  listen: 127.0.0.1:%d
  admin_listen: 127.0.0.1:%d
  dispatcher_addr: 127.0.0.1:%d
  # No webhook transport here: no completion endpoint (its default, :7239,
  # would collide between stacks running in parallel).
  http_listen: ""
dispatcher:
  listen: 127.0.0.1:%d
  admin_listen: 127.0.0.1:%d
  pass_interval: 100ms
  claim_ttl: 3s
consumer:
  # Each consumer process gets its own admin port and worker id through
  # CAPSTAN_CONSUMER_ADMIN_LISTEN and CAPSTAN_CONSUMER_WORKER_ID.
  admin_listen: ""
  reap_interval: 200ms
  session_timeout: %s
  max_in_flight: 256
router:
  admin_listen: 127.0.0.1:%d
  poll_interval: 100ms
  retry_delays: [100ms, 200ms, 500ms, 1s, 2s]
  timeout: 2s
  claim_ttl: 5s
log:
  level: info
capabilities:
  - name: %s
    release: v1
    adapter: 127.0.0.1:%d
    max_attempts: 10
    retry_delays: [50ms, 100ms, 200ms]
    attempt_timeout: %s
    lease_duration: %s
    async_budget: 10m
%s`, s.dbURL, strings.Join(brokers, ", "), executionTopic, executionPartitions,
		s.gateway, s.gatewayAdmin, s.dispatcher, s.dispatcher, s.dispatcherAdmin,
		o.SessionTimeout, s.routerAdmin, capability, s.provider, o.AttemptTimeout, o.LeaseDuration, steps)
}

// startAll starts the provider, gateway, dispatcher and router, and one
// consumer per worker id, and waits until each is ready.
func (s *stack) startAll(workers ...string) {
	s.t.Helper()
	s.startProvider()
	s.startGateway()
	s.startDispatcher()
	s.startRouter()
	for _, w := range workers {
		s.startConsumer(w)
	}
}

// startProvider starts the mock payment provider with the stack's latency
// and retryable fraction.
func (s *stack) startProvider() *proc {
	s.t.Helper()
	o := s.opts
	return s.start("provider", "csv-payments-provider", fmt.Sprintf("http://127.0.0.1:%d/stats", s.providerAdmin), nil,
		"--listen", fmt.Sprintf("127.0.0.1:%d", s.provider), "--admin-listen", fmt.Sprintf("127.0.0.1:%d", s.providerAdmin),
		"--latency-min", o.ProviderLatencyMin.String(), "--latency-max", o.ProviderLatencyMax.String(),
		"--retryable-fraction", fmt.Sprint(o.RetryableFraction))
}

func (s *stack) startGateway() *proc {
	s.t.Helper()
	return s.start("gateway", "gateway", s.readyURL(s.gatewayAdmin), nil, "--config", s.cfgPath)
}

func (s *stack) startDispatcher() *proc {
	s.t.Helper()
	return s.start("dispatcher", "dispatcher", s.readyURL(s.dispatcherAdmin), nil, "--config", s.cfgPath)
}

func (s *stack) startRouter() *proc {
	s.t.Helper()
	return s.start("router", "router", s.readyURL(s.routerAdmin), nil, "--config", s.cfgPath)
}

// startConsumer starts a consumer process named and leasing as workerID,
// on a fresh admin port (a restart under the same id gets a new port and a
// new log file).
func (s *stack) startConsumer(workerID string) *proc {
	s.t.Helper()
	port := freePorts(s.t, 1)[0]
	return s.start(workerID, "consumer", s.readyURL(port), []string{
		"CAPSTAN_CONSUMER_WORKER_ID=" + workerID,
		fmt.Sprintf("CAPSTAN_CONSUMER_ADMIN_LISTEN=127.0.0.1:%d", port),
	}, "--config", s.cfgPath)
}

func (s *stack) readyURL(port int) string { return fmt.Sprintf("http://127.0.0.1:%d/readyz", port) }

// start starts bin as a process called name, logging to <dir>/<name>.log
// (<name>.2.log, … for restarts), and waits until readyURL answers 200.
func (s *stack) start(name, bin, readyURL string, env []string, args ...string) *proc {
	s.t.Helper()
	s.mu.Lock()
	n := 1
	for _, p := range s.procs {
		if p.name == name {
			n++
		}
	}
	s.mu.Unlock()
	logName := name + ".log"
	if n > 1 {
		logName = fmt.Sprintf("%s.%d.log", name, n)
	}
	logPath := filepath.Join(s.dir, logName)
	f, err := os.Create(logPath)
	require.NoError(s.t, err)
	cmd := exec.Command(filepath.Join(s.bin, bin), args...)
	cmd.Dir = s.dir
	cmd.Env = append(append(os.Environ(), s.opts.Env...), env...)
	cmd.Stdout, cmd.Stderr = f, f
	var stdoutPath string
	var out *os.File
	if s.opts.SeparateStdout {
		stdoutPath = strings.TrimSuffix(logPath, ".log") + ".stdout"
		out, err = os.Create(stdoutPath)
		if err != nil {
			f.Close()
			require.NoError(s.t, err)
		}
		cmd.Stdout = out
	}
	// Own process group (a terminal's Ctrl-C reaches only the test), and
	// SIGKILL should the test binary die.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		if out != nil {
			out.Close()
		}
		require.NoError(s.t, err, "start %s", name)
	}
	p := &proc{name: name, logPath: logPath, stdoutPath: stdoutPath, readyURL: readyURL, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		f.Close()
		if out != nil {
			out.Close()
		}
		close(p.done)
	}()
	s.mu.Lock()
	s.procs = append(s.procs, p)
	s.mu.Unlock()
	p.waitReady(s.t)
	return p
}

// cleanup stops every process still running (SIGCONT first, in case it is
// paused, then SIGTERM; SIGKILL after stopGrace) and, if the test failed,
// prints the tail of every log.
func (s *stack) cleanup() {
	s.mu.Lock()
	procs := slices.Clone(s.procs)
	s.mu.Unlock()
	var wg sync.WaitGroup
	for _, p := range slices.Backward(procs) {
		if p.exited() {
			continue
		}
		wg.Go(func() {
			_ = p.cmd.Process.Signal(syscall.SIGCONT)
			_ = p.cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-p.done:
			case <-time.After(stopGrace):
				_ = p.cmd.Process.Kill()
				<-p.done
				s.t.Errorf("%s did not stop within %v of SIGTERM; killed", p.name, stopGrace)
			}
		})
	}
	wg.Wait()
	if s.t.Failed() {
		for _, p := range procs {
			s.t.Logf("--- tail of %s (%s) ---\n%s", filepath.Base(p.logPath), p.state(), tail(p.logPath, 40))
		}
	}
}

// proc is one OS process of a stack.
type proc struct {
	name       string
	logPath    string
	stdoutPath string // "" unless stackOptions.SeparateStdout
	readyURL   string
	cmd        *exec.Cmd
	done       chan struct{} // closed when the process has exited
	err        error         // cmd.Wait's result, valid after done
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

func (p *proc) state() string {
	if !p.exited() {
		return fmt.Sprintf("pid %d, running", p.pid())
	}
	return fmt.Sprintf("pid %d, %v", p.pid(), p.cmd.ProcessState)
}

func (p *proc) signal(t testing.TB, sig syscall.Signal) {
	t.Helper()
	require.NoError(t, p.cmd.Process.Signal(sig), "send %v to %s", sig, p.name)
}

// kill sends SIGKILL and waits until the process is gone.
func (p *proc) kill(t testing.TB) {
	t.Helper()
	p.signal(t, syscall.SIGKILL)
	<-p.done
}

// pause stops the process (SIGSTOP); resume continues it (SIGCONT).
func (p *proc) pause(t testing.TB)  { t.Helper(); p.signal(t, syscall.SIGSTOP) }
func (p *proc) resume(t testing.TB) { t.Helper(); p.signal(t, syscall.SIGCONT) }

// waitReady polls the process's health URL until it answers 200; it fails
// the test if the process exits first or readyTimeout passes.
func (p *proc) waitReady(t testing.TB) {
	t.Helper()
	deadline := time.Now().Add(readyTimeout)
	for {
		code, body, err := httpGet(p.readyURL)
		if code == http.StatusOK {
			return
		}
		if p.exited() {
			t.Fatalf("%s exited during start (%v):\n%s", p.name, p.cmd.ProcessState, tail(p.logPath, 40))
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not ready at %s after %v (last answer %d %q, error %v):\n%s", p.name, p.readyURL, readyTimeout,
				code, body, err, tail(p.logPath, 40))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

var readyClient = &http.Client{Timeout: 3 * time.Second}

// httpStatus GETs url and returns the status code (0 when unreachable).
func httpStatus(url string) (int, error) {
	code, _, err := httpGet(url)
	return code, err
}

// httpGet GETs url and returns the status code (0 when unreachable) and
// the start of the body.
func httpGet(url string) (int, string, error) {
	resp, err := readyClient.Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1024))
	return resp.StatusCode, string(b), err
}

// tail returns the last n lines of the file at path.
func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(cannot read %s: %v)", path, err)
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// freePorts returns n distinct free loopback ports outside the ephemeral
// range (see devstack.FreePorts), so that no outbound connection of another
// test can take one before the daemon binds it.
func freePorts(t testing.TB, n int) []int {
	t.Helper()
	out, err := devstack.FreePorts(n)
	require.NoError(t, err)
	return out
}

// --- load ---------------------------------------------------------------

// samplePayments returns the first n payments of the csv-payments
// example's 1k sample (in the repository, so never skipped).
func samplePayments(t testing.TB, n int) []payment.Payment {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	f, err := os.Open(filepath.Join(filepath.Dir(file), "..", "..", "examples", "csv-payments", "testdata", "payments_1k.csv"))
	require.NoError(t, err)
	defer f.Close()
	ps, err := payment.ReadCSV(f)
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(ps), n)
	return ps[:n]
}

// invokeResult is what an invocation run accepted.
type invokeResult struct {
	mu          sync.Mutex
	byExecution map[string]payment.Payment // execution id → its payment
	unavailable int                        // UNAVAILABLE or DEADLINE_EXCEEDED answers, retried
}

func (r *invokeResult) executions() map[string]payment.Payment {
	r.mu.Lock()
	defer r.mu.Unlock()
	return maps.Clone(r.byExecution)
}

func (r *invokeResult) retried() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.unavailable
}

// invoke invokes payments.send once per payment with concurrency workers,
// idempotency key "pay-<ID>", retrying UNAVAILABLE and DEADLINE_EXCEEDED
// with the same key until accepted or ctx ends. It may run in a goroutine:
// it reports problems as an error, never through t. Results accumulate in
// into (which may be shared by several runs).
func (s *stack) invoke(ctx context.Context, payments []payment.Payment, concurrency int, into *invokeResult) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	work := make(chan payment.Payment)
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	fail := func(err error) {
		mu.Lock()
		errs = append(errs, err)
		mu.Unlock()
		cancel()
	}
	for range concurrency {
		wg.Go(func() {
			for p := range work {
				id, err := s.invokeOne(ctx, p, into)
				if err != nil {
					fail(err)
					return
				}
				into.mu.Lock()
				prev, dup := into.byExecution[id]
				into.byExecution[id] = p
				into.mu.Unlock()
				if dup && prev.ID != p.ID {
					fail(fmt.Errorf("payments %s and %s got the same execution %s", prev.ID, p.ID, id))
					return
				}
			}
		})
	}
feed:
	for _, p := range payments {
		select {
		case work <- p:
		case <-ctx.Done():
			break feed
		}
	}
	close(work)
	wg.Wait()
	if len(errs) == 0 && ctx.Err() != nil {
		return ctx.Err()
	}
	return errors.Join(errs...)
}

func (s *stack) invokeOne(ctx context.Context, p payment.Payment, into *invokeResult) (string, error) {
	wait := 50 * time.Millisecond
	for {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		resp, err := s.client.Invoke(cctx, capability, payment.EncodeJSON(p), "application/json", "pay-"+p.ID)
		cancel()
		if err == nil {
			return resp.GetExecutionId(), nil
		}
		if c := status.Code(err); (c != codes.Unavailable && c != codes.DeadlineExceeded) || ctx.Err() != nil {
			return "", fmt.Errorf("invoke payment %s: %w", p.ID, err)
		}
		into.mu.Lock()
		into.unavailable++
		into.mu.Unlock()
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("invoke payment %s: %w (last: %v)", p.ID, ctx.Err(), err)
		case <-time.After(wait):
		}
		wait = min(2*wait, time.Second)
	}
}

func newInvokeResult() *invokeResult {
	return &invokeResult{byExecution: map[string]payment.Payment{}}
}

// --- webhook receiver ---------------------------------------------------

// receiver is the application's webhook consumer: it verifies nothing,
// answers 200 and counts deliveries by webhook-id and the event ids seen
// per execution.
type receiver struct {
	mu         sync.Mutex
	deliveries map[string]int             // webhook-id → deliveries
	eventsOf   map[string]map[string]bool // execution id → webhook-ids
	bad        []string                   // malformed deliveries
}

func newReceiver() *receiver {
	return &receiver{deliveries: map[string]int{}, eventsOf: map[string]map[string]bool{}}
}

func (r *receiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	body, err := io.ReadAll(req.Body)
	id := req.Header.Get("webhook-id")
	var ev struct {
		EventID     string `json:"eventId"`
		ExecutionID string `json:"executionId"`
	}
	if err == nil {
		err = json.Unmarshal(body, &ev)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if err != nil || id == "" || ev.ExecutionID == "" || ev.EventID != id {
		r.bad = append(r.bad, fmt.Sprintf("webhook-id %q event %q execution %q: %v", id, ev.EventID, ev.ExecutionID, err))
	}
	r.deliveries[id]++
	if r.eventsOf[ev.ExecutionID] == nil {
		r.eventsOf[ev.ExecutionID] = map[string]bool{}
	}
	r.eventsOf[ev.ExecutionID][id] = true
	w.WriteHeader(http.StatusOK)
}

// --- database checks ----------------------------------------------------

func (s *stack) queryInt(t testing.TB, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, s.db.QueryRow(t.Context(), sql, args...).Scan(&n), sql)
	return n
}

// queryIntNow is queryInt for polling loops: errors (e.g. during a
// database outage) read as -1.
func (s *stack) queryIntNow(ctx context.Context, sql string, args ...any) int {
	var n int
	if err := s.db.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
		return -1
	}
	return n
}

// runningAttempts counts the attempts of worker still RUNNING.
func (s *stack) runningAttempts(ctx context.Context, worker string) int {
	return s.queryIntNow(ctx, `SELECT count(*) FROM attempts WHERE worker = $1 AND outcome = 'RUNNING'`, worker)
}

// progress summarises the database for failure messages.
func (s *stack) progress(ctx context.Context) string {
	rows, err := s.db.Query(ctx, `
SELECT 'executions ' || status, count(*) FROM executions GROUP BY status
UNION ALL SELECT 'attempts ' || outcome, count(*) FROM attempts GROUP BY outcome
UNION ALL SELECT 'events ' || status, count(*) FROM completion_events GROUP BY status
UNION ALL SELECT 'dispatch records', count(*) FROM dispatch_records
UNION ALL SELECT 'leases expiring in > 5s', count(*) FROM executions WHERE lease_expires_at > now() + interval '5 seconds'
ORDER BY 1`)
	if err != nil {
		return fmt.Sprintf("(progress unavailable: %v)", err)
	}
	defer rows.Close()
	var b strings.Builder
	for rows.Next() {
		var k string
		var n int
		if err := rows.Scan(&k, &n); err != nil {
			return err.Error()
		}
		fmt.Fprintf(&b, "%s=%d; ", k, n)
	}
	return b.String()
}

// waitAllSettled waits until want executions exist, all terminal, every
// completion event delivered and seen by the receiver, and returns how long
// it took.
func (s *stack) waitAllSettled(t testing.TB, want int, timeout time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	ctx := t.Context()
	ok := pollUntil(ctx, timeout, 200*time.Millisecond, func() bool {
		return s.queryIntNow(ctx, `SELECT count(*) FROM executions WHERE settled_at IS NOT NULL`) == want &&
			s.queryIntNow(ctx, `SELECT count(*) FROM completion_events WHERE status = 'DELIVERED'`) == want &&
			s.receiver.distinct() >= want
	})
	if !ok {
		t.Fatalf("not all of %d executions settled and delivered within %v: %s receiver saw %d events",
			want, timeout, s.progress(ctx), s.receiver.distinct())
	}
	return time.Since(start)
}

func (r *receiver) distinct() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.deliveries)
}

// pollUntil calls cond every interval until it is true (true), or timeout
// passes or ctx ends (false).
func pollUntil(ctx context.Context, timeout, interval time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(interval):
		}
	}
}

// requireExactlyOnce checks, after waitAllSettled, that nothing was lost
// and nothing done twice for the executions of invoked:
//   - exactly these executions exist, every one terminal, with exactly one
//     completion event, DELIVERED, and no dispatch record left;
//   - the receiver saw every event id at least once and, per execution,
//     only that event id;
//   - every outcome is the one payment.Decide gives for its payment;
//   - attempts are numbered 1..attempt with none RUNNING: every attempt but
//     the last ended RETRYABLE_FAILURE or LEASE_EXPIRED, the last one
//     SUCCEEDED or FAILED as the execution;
//   - the provider saw every execution.
func (s *stack) requireExactlyOnce(t testing.TB, invoked map[string]payment.Payment) {
	t.Helper()
	ctx := t.Context()
	n := len(invoked)
	require.Equal(t, n, s.queryInt(t, `SELECT count(*) FROM executions`), "one execution per invoked payment")
	require.Zero(t, s.queryInt(t, `SELECT count(*) FROM executions WHERE settled_at IS NULL`), "every execution is terminal")
	require.Zero(t, s.queryInt(t, `SELECT count(*) FROM executions e
 WHERE (SELECT count(*) FROM completion_events c WHERE c.execution_id = e.id) <> 1`), "exactly one completion event per execution")
	require.Equal(t, n, s.queryInt(t, `SELECT count(*) FROM completion_events WHERE status = 'DELIVERED'`), "every event delivered")
	require.Zero(t, s.queryInt(t, `SELECT count(*) FROM dispatch_records`), "no dispatch work left behind")
	require.Zero(t, s.queryInt(t, `SELECT count(*) FROM attempts WHERE outcome = 'RUNNING'`), "no attempt left RUNNING")

	// Events as delivered.
	rows, err := s.db.Query(ctx, `SELECT id::text, execution_id::text FROM completion_events`)
	require.NoError(t, err)
	events, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct{ ID, Execution string }])
	require.NoError(t, err)
	s.receiver.mu.Lock()
	require.Empty(t, s.receiver.bad, "malformed deliveries")
	for _, ev := range events {
		require.Positive(t, s.receiver.deliveries[ev.ID], "event %s of execution %s was delivered", ev.ID, ev.Execution)
		require.Equal(t, map[string]bool{ev.ID: true}, s.receiver.eventsOf[ev.Execution],
			"execution %s was announced by exactly one event id", ev.Execution)
	}
	require.Len(t, s.receiver.eventsOf, n, "the receiver heard of exactly the invoked executions")
	s.receiver.mu.Unlock()

	// Outcomes.
	type outcome struct {
		ID, Status   string
		Class        *string
		Output       []byte
		Attempt      int
		AttemptRows  int
		MaxRow       int
		LastOutcome  string
		EarlierOther int
	}
	rows, err = s.db.Query(ctx, `
SELECT e.id::text, e.status, e.failure_class, e.output, e.attempt,
       (SELECT count(*)::int FROM attempts a WHERE a.execution_id = e.id),
       (SELECT coalesce(max(attempt), 0) FROM attempts a WHERE a.execution_id = e.id),
       coalesce((SELECT outcome FROM attempts a WHERE a.execution_id = e.id AND a.attempt = e.attempt), ''),
       (SELECT count(*)::int FROM attempts a WHERE a.execution_id = e.id AND a.attempt < e.attempt
           AND a.outcome NOT IN ('RETRYABLE_FAILURE', 'LEASE_EXPIRED'))
  FROM executions e`)
	require.NoError(t, err)
	outs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[outcome])
	require.NoError(t, err)
	for _, o := range outs {
		p, ok := invoked[o.ID]
		require.True(t, ok, "execution %s was invoked by the test", o.ID)
		want := payment.Decide(p)
		if want.Succeeded {
			require.Equal(t, "SUCCEEDED", o.Status, "payment %s (execution %s)", p.ID, o.ID)
			got, err := payment.ParseResult(o.Output)
			require.NoError(t, err)
			require.Equal(t, want.Result, got, "payment %s", p.ID)
		} else {
			require.Equal(t, "FAILED", o.Status, "payment %s (execution %s)", p.ID, o.ID)
			require.NotNil(t, o.Class)
			require.Equal(t, want.FailureClass, *o.Class, "payment %s", p.ID)
		}
		require.Positive(t, o.Attempt, "execution %s ran", o.ID)
		require.Equal(t, o.Attempt, o.AttemptRows, "execution %s: one attempt row per attempt", o.ID)
		require.Equal(t, o.Attempt, o.MaxRow, "execution %s: attempts numbered 1..%d", o.ID, o.Attempt)
		require.Equal(t, o.Status, o.LastOutcome, "execution %s: the last attempt ended as the execution", o.ID)
		require.Zero(t, o.EarlierOther, "execution %s: earlier attempts ended retryably or by lease expiry", o.ID)
	}

	// The provider saw every execution (at least once; attempts whose
	// lease expired may have reached it twice, which is allowed).
	resp, err := readyClient.Get(fmt.Sprintf("http://127.0.0.1:%d/stats", s.providerAdmin))
	if err == nil { // the provider may have been stopped by the test
		defer resp.Body.Close()
		var st struct{ Calls, Executions int }
		require.NoError(t, json.NewDecoder(resp.Body).Decode(&st))
		require.Equal(t, n, st.Executions, "the provider saw every execution")
		require.GreaterOrEqual(t, st.Calls, s.queryInt(t, `SELECT count(*) FROM attempts WHERE outcome <> 'LEASE_EXPIRED'`),
			"every attempt that ended with an answer called the provider")
	}
}

// logLines returns the lines of p's log that contain substr.
func (p *proc) logLines(substr string) []string {
	f, err := os.Open(p.logPath)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if strings.Contains(sc.Text(), substr) {
			out = append(out, sc.Text())
		}
	}
	return out
}

// procsNamed returns every process started under name, restarts included.
func (s *stack) procsNamed(name string) []*proc {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*proc
	for _, p := range s.procs {
		if p.name == name {
			out = append(out, p)
		}
	}
	return out
}

// deliveries returns how many times the receiver got the completion event
// of execution id.
func (s *stack) deliveries(t testing.TB, id string) int {
	t.Helper()
	var ev string
	require.NoError(t, s.db.QueryRow(t.Context(), `SELECT id::text FROM completion_events WHERE execution_id = $1`, id).Scan(&ev))
	s.receiver.mu.Lock()
	defer s.receiver.mu.Unlock()
	return s.receiver.deliveries[ev]
}
