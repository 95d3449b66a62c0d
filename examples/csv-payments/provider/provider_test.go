package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/capstan-dev/capstan/examples/csv-payments/payment"
	"github.com/capstan-dev/capstan/internal/kafkatest"
	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// defaultConfig is parseConfig's result without flags or environment.
var defaultConfig = config{Mode: modeDirect, Listen: "127.0.0.1:7070", HTTPListen: "127.0.0.1:7071",
	RequestTopic: "payments.requests", ResponseTopic: "payments.responses", KafkaGroup: "csv-payments-provider",
	Gateway: "127.0.0.1:7233", RenewEvery: time.Second,
	LatencyMin: 5 * time.Millisecond, LatencyMax: 30 * time.Millisecond, RetryableFraction: 0.1, Seed: 1, LogLevel: slog.LevelInfo}

const testSecret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw" // base64 of 24 bytes

func TestParseConfig(t *testing.T) {
	t.Parallel()
	with := func(f func(*config)) config {
		c := defaultConfig
		f(&c)
		return c
	}
	tests := []struct {
		name string
		args []string
		env  map[string]string
		want config
	}{
		{name: "defaults", want: defaultConfig},
		{
			name: "env and flags, flags win",
			args: []string{"--seed", "9", "--listen=127.0.0.1:1"},
			env: map[string]string{
				"PROVIDER_LISTEN": "127.0.0.1:9999", "PROVIDER_ADMIN_LISTEN": "127.0.0.1:9998",
				"PROVIDER_LATENCY_MIN": "1ms", "PROVIDER_LATENCY_MAX": "2ms",
				"PROVIDER_RETRYABLE_FRACTION": "0.25", "PROVIDER_SEED": "7", "PROVIDER_LOG_LEVEL": "debug",
			},
			want: with(func(c *config) {
				c.Listen, c.AdminListen, c.LatencyMin, c.LatencyMax = "127.0.0.1:1", "127.0.0.1:9998", time.Millisecond, 2*time.Millisecond
				c.RetryableFraction, c.Seed, c.LogLevel = 0.25, 9, slog.LevelDebug
			}),
		},
		{
			name: "webhook mode from the environment",
			env: map[string]string{"PROVIDER_MODE": "webhook", "PROVIDER_HTTP_LISTEN": "127.0.0.1:0",
				"PROVIDER_WEBHOOK_SECRET": testSecret, "PROVIDER_DUPLICATE_COMPLETIONS": "true"},
			want: with(func(c *config) {
				c.Mode, c.HTTPListen, c.WebhookSecret, c.DuplicateCompletions = modeWebhook, "127.0.0.1:0", testSecret, true
			}),
		},
		{
			name: "kafka mode from flags",
			args: []string{"--mode", "kafka", "--kafka-brokers", "127.0.0.1:1, 127.0.0.1:2", "--request-topic", "rq",
				"--response-topic", "rs", "--kafka-group", "g", "--duplicate-completions"},
			env: map[string]string{"PROVIDER_KAFKA_BROKERS": "127.0.0.1:3"},
			want: with(func(c *config) {
				c.Mode, c.KafkaBrokers, c.RequestTopic, c.ResponseTopic, c.KafkaGroup = modeKafka, "127.0.0.1:1, 127.0.0.1:2", "rq", "rs", "g"
				c.DuplicateCompletions = true
			}),
		},
		{
			name: "callback mode, the key from the environment",
			args: []string{"--mode", "callback", "--gateway", "127.0.0.1:9", "--renew-every", "250ms"},
			env:  map[string]string{"PROVIDER_ADAPTER_KEY": "ak_1", "PROVIDER_GATEWAY": "127.0.0.1:8"},
			want: with(func(c *config) {
				c.Mode, c.Gateway, c.AdapterKey, c.RenewEvery = modeCallback, "127.0.0.1:9", "ak_1", 250*time.Millisecond
			}),
		},
		{
			name: "callback mode from the environment",
			env: map[string]string{"PROVIDER_MODE": "callback", "PROVIDER_ADAPTER_KEY": "ak_2", "PROVIDER_GATEWAY": "gw:7233",
				"PROVIDER_RENEW_EVERY": "3s", "PROVIDER_LISTEN": "127.0.0.1:0"},
			want: with(func(c *config) {
				c.Mode, c.Gateway, c.AdapterKey, c.RenewEvery, c.Listen = modeCallback, "gw:7233", "ak_2", 3*time.Second, "127.0.0.1:0"
			}),
		},
		{
			name: "kafka mode from the environment",
			env:  map[string]string{"PROVIDER_MODE": "kafka", "PROVIDER_KAFKA_BROKERS": "127.0.0.1:3"},
			want: with(func(c *config) { c.Mode, c.KafkaBrokers = modeKafka, "127.0.0.1:3" }),
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg, err := parseConfig(tt.args, func(k string) string { return tt.env[k] }, &bytes.Buffer{})
			if err != nil {
				t.Fatal(err)
			}
			if cfg != tt.want {
				t.Errorf("config = %+v, want %+v", cfg, tt.want)
			}
		})
	}
}

func TestParseConfigRejects(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		args []string
		env  map[string]string
	}{
		{name: "latency range", args: []string{"--latency-min", "50ms", "--latency-max", "10ms"}},
		{name: "fraction above 1", args: []string{"--retryable-fraction", "1.5"}},
		{name: "fraction NaN", args: []string{"--retryable-fraction", "NaN"}},
		{name: "negative seed", args: []string{"--seed", "-1"}},
		{name: "unknown flag", args: []string{"--nope"}},
		{name: "extra argument", args: []string{"extra"}},
		{name: "bad env", env: map[string]string{"PROVIDER_LATENCY_MAX": "soon"}},
		{name: "unknown mode", args: []string{"--mode", "carrier-pigeon"}},
		{name: "empty listen", args: []string{"--listen", ""}},
		{name: "webhook without secret", args: []string{"--mode", "webhook"}},
		{name: "webhook secret without prefix", args: []string{"--mode", "webhook", "--webhook-secret", "c2VjcmV0"}},
		{name: "webhook secret not base64", args: []string{"--mode", "webhook", "--webhook-secret", "whsec_!!!"}},
		{name: "webhook without listen", args: []string{"--mode", "webhook", "--webhook-secret", testSecret, "--http-listen", ""}},
		{name: "kafka without brokers", args: []string{"--mode", "kafka", "--kafka-brokers", " , "}},
		{name: "kafka same topics", args: []string{"--mode", "kafka", "--kafka-brokers", "b:1", "--response-topic", "payments.requests"}},
		{name: "kafka without group", args: []string{"--mode", "kafka", "--kafka-brokers", "b:1", "--kafka-group", ""}},
		{name: "bad duplicate flag", env: map[string]string{"PROVIDER_DUPLICATE_COMPLETIONS": "twice"}},
		{name: "callback without key", args: []string{"--mode", "callback"}},
		{name: "callback key with white space", args: []string{"--mode", "callback", "--adapter-key", "ak 1"}},
		{name: "callback key too long", args: []string{"--mode", "callback", "--adapter-key", strings.Repeat("k", 513)}},
		{name: "callback without gateway", args: []string{"--mode", "callback", "--adapter-key", "k", "--gateway", ""}},
		{name: "callback without listen", args: []string{"--mode", "callback", "--adapter-key", "k", "--listen", ""}},
		{name: "callback renew-every zero", args: []string{"--mode", "callback", "--adapter-key", "k", "--renew-every", "0s"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if _, err := parseConfig(tt.args, func(k string) string { return tt.env[k] }, &bytes.Buffer{}); !errors.Is(err, errConfig) {
				t.Errorf("parseConfig(%q, %v) err = %v, want errConfig", tt.args, tt.env, err)
			}
		})
	}
}

func TestUsageHidesTestFlags(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	if _, err := parseConfig([]string{"--help"}, func(string) string { return "" }, &out); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("--help: %v", err)
	}
	if !strings.Contains(out.String(), "--mode") || strings.Contains(out.String(), "duplicate-completions") {
		t.Errorf("usage lists --mode and hides --duplicate-completions:\n%s", out.String())
	}
}

func TestFailRetryably(t *testing.T) {
	t.Parallel()
	const n = 20000
	failed, secondAlsoFailed := 0, 0
	for i := range n {
		id := fmt.Sprintf("exec-%d", i)
		a := failRetryably(1, id, 1, 0.1)
		if a != failRetryably(1, id, 1, 0.1) {
			t.Fatal("not deterministic")
		}
		if a {
			failed++
			if failRetryably(1, id, 2, 0.1) {
				secondAlsoFailed++
			}
		}
	}
	if f := float64(failed) / n; f < 0.09 || f > 0.11 {
		t.Errorf("fraction failed = %.3f, want about 0.1", f)
	}
	if f := float64(secondAlsoFailed) / float64(failed); f > 0.15 {
		t.Errorf("attempt 2 failed again in %.3f of cases, want about 0.1", f)
	}
	if failRetryably(1, "x", 1, 0) || !failRetryably(1, "x", 1, 1) {
		t.Error("fractions 0 and 1 must never and always fail")
	}
	// Another seed picks other attempts.
	same := 0
	for i := range 1000 {
		id := fmt.Sprintf("exec-%d", i)
		if failRetryably(1, id, 1, 0.5) == failRetryably(2, id, 1, 0.5) {
			same++
		}
	}
	if same > 600 {
		t.Errorf("seeds 1 and 2 agree on %d of 1000 attempts", same)
	}
}

// startProvider serves a provider for cfg on loopback and returns a gRPC
// connection and the admin base URL.
func startProvider(t *testing.T, cfg config) (*grpc.ClientConn, string) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	adminLis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- serve(ctx, cfg, lis, adminLis, slog.New(slog.DiscardHandler)) }()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = conn.Close()
		cancel()
		if err := <-errc; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return conn, "http://" + adminLis.Addr().String()
}

func readStats(t *testing.T, base string) stats {
	t.Helper()
	resp, err := http.Get(base + "/stats")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var s stats
	if err := json.NewDecoder(resp.Body).Decode(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

func TestProviderOverGRPC(t *testing.T) {
	t.Parallel()
	conn, admin := startProvider(t, config{LatencyMin: time.Millisecond, LatencyMax: 3 * time.Millisecond, RetryableFraction: 0, Seed: 1})
	c := adapterv1.NewAdapterServiceClient(conn)
	ctx := t.Context()

	b, err := os.ReadFile(filepath.Join("..", "testdata", "payments_12.csv"))
	if err != nil {
		t.Fatal(err)
	}
	rows, err := payment.ReadCSV(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	for i, p := range rows {
		id := fmt.Sprintf("00000000-0000-0000-0000-%012d", i)
		resp, err := c.Execute(ctx, &adapterv1.ExecuteRequest{
			ExecutionId: id, Attempt: 1, Capability: "payments.send",
			Input: payment.EncodeJSON(p), ContentType: "application/json",
		})
		if err != nil {
			t.Fatal(err)
		}
		want := payment.Decide(p)
		if want.Succeeded {
			r := resp.GetResult()
			got, err := payment.ParseResult(r.GetOutput())
			if err != nil || got != want.Result || r.GetContentType() != "application/json" {
				t.Errorf("row %s: result %v (%v), want %+v", p.ID, r, err, want.Result)
			}
			continue
		}
		f := resp.GetFailure()
		if f.GetClass() != want.FailureClass || f.GetMessage() != want.FailureMessage || f.GetRetryable() {
			t.Errorf("row %s: failure %v, want %+v", p.ID, f, want)
		}
	}

	bad := []*adapterv1.ExecuteRequest{
		{ExecutionId: "bad-1", Attempt: 1, Input: []byte("{not json"), ContentType: "application/json"},
		{ExecutionId: "bad-2", Attempt: 1, Input: payment.EncodeJSON(rows[0]), ContentType: "text/csv"},
		{ExecutionId: "bad-3", Attempt: 1, Input: []byte(`{"id":"1","recipient":"","amount":"1","currency":"EUR"}`)},
	}
	for _, req := range bad {
		resp, err := c.Execute(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if f := resp.GetFailure(); f.GetClass() != payment.ClassInputInvalid || f.GetRetryable() {
			t.Errorf("%s: %v, want input.invalid", req.GetExecutionId(), resp)
		}
	}
	// A repeated attempt of the same execution counts as a call, not as an execution.
	if _, err := c.Execute(ctx, bad[0]); err != nil {
		t.Fatal(err)
	}
	if s, want := readStats(t, admin), (stats{Calls: int64(len(rows) + 4), Executions: len(rows) + 3}); s != want {
		t.Errorf("stats = %+v, want %+v", s, want)
	}

	hr, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil || hr.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("health = %v, %v", hr, err)
	}
}

func TestProviderRetryableFailures(t *testing.T) {
	t.Parallel()
	conn, _ := startProvider(t, config{RetryableFraction: 0.5, Seed: 42})
	c := adapterv1.NewAdapterServiceClient(conn)
	input := payment.EncodeJSON(payment.Payment{ID: "1", Recipient: "R", Amount: "10", Currency: "EUR"})
	sawFailThenSucceed := false
	for i := range 40 {
		id := fmt.Sprintf("exec-%d", i)
		var outcomes [2]string
		for attempt := int32(1); attempt <= 2; attempt++ {
			var first string
			for range 2 { // the same attempt twice answers the same
				resp, err := c.Execute(t.Context(), &adapterv1.ExecuteRequest{ExecutionId: id, Attempt: attempt, Input: input})
				if err != nil {
					t.Fatal(err)
				}
				got := "ok"
				if f := resp.GetFailure(); f != nil {
					if f.GetClass() != payment.ClassProviderUnavailable || !f.GetRetryable() {
						t.Fatalf("unexpected failure %v", f)
					}
					got = "retry"
				}
				if first != "" && got != first {
					t.Fatalf("%s attempt %d answered %s then %s", id, attempt, first, got)
				}
				first = got
			}
			outcomes[attempt-1] = first
			if want := failRetryably(42, id, attempt, 0.5); want != (first == "retry") {
				t.Fatalf("%s attempt %d: %s, failRetryably = %v", id, attempt, first, want)
			}
		}
		sawFailThenSucceed = sawFailThenSucceed || outcomes == [2]string{"retry", "ok"}
	}
	if !sawFailThenSucceed {
		t.Error("no execution failed on attempt 1 and succeeded on attempt 2")
	}
}

// startWatcher is a log writer that closes started once the provider
// logged that it listens; it is safe for concurrent use.
type startWatcher struct {
	mu      sync.Mutex
	buf     bytes.Buffer
	once    sync.Once
	started chan struct{}
}

func (w *startWatcher) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if bytes.Contains(b, []byte(`"msg":"provider starting"`)) {
		w.once.Do(func() { close(w.started) })
	}
	return w.buf.Write(b)
}

func (w *startWatcher) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}

func TestRunStartsAndStops(t *testing.T) {
	t.Parallel()
	kc, err := kafkatest.Start(t.Context(), kafkatest.Options{Topics: map[string]int32{"payments.requests": 1, "payments.responses": 1}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close)
	tests := []struct {
		name string
		args []string
		env  map[string]string
	}{
		{name: "direct", args: []string{"--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"}},
		{name: "webhook", args: []string{"--mode", "webhook", "--http-listen", "127.0.0.1:0", "--webhook-secret", testSecret}},
		{name: "kafka", args: []string{"--mode", "kafka", "--kafka-brokers", kc.Brokers()[0], "--admin-listen", "127.0.0.1:0"}},
		{name: "callback", args: []string{"--mode", "callback", "--listen", "127.0.0.1:0", "--gateway", "127.0.0.1:1"},
			env: map[string]string{"PROVIDER_ADAPTER_KEY": testAdapterKey}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithCancel(t.Context())
			logs := &startWatcher{started: make(chan struct{})}
			errc := make(chan error, 1)
			go func() { errc <- run(ctx, tt.args, func(k string) string { return tt.env[k] }, logs) }()
			select {
			case <-logs.started:
			case err := <-errc:
				t.Fatalf("run ended before starting: %v\n%s", err, logs.String())
			}
			cancel()
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(logs.String(), `"msg":"provider stopped"`) {
				t.Errorf("logs lack the stop record: %s", logs.String())
			}
			if strings.Contains(logs.String(), testAdapterKey) {
				t.Errorf("logs reveal the adapter key: %s", logs.String())
			}
		})
	}
	t.Run("bad flag", func(t *testing.T) {
		t.Parallel()
		if err := run(t.Context(), []string{"--retryable-fraction", "2"}, func(string) string { return "" }, &bytes.Buffer{}); !errors.Is(err, errConfig) {
			t.Errorf("bad flag: %v", err)
		}
	})
	t.Run("port taken", func(t *testing.T) {
		t.Parallel()
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer lis.Close()
		err = run(t.Context(), []string{"--mode", "webhook", "--http-listen", lis.Addr().String(), "--webhook-secret", testSecret},
			func(string) string { return "" }, &bytes.Buffer{})
		if err == nil {
			t.Error("run served on a port already taken")
		}
	})
}
