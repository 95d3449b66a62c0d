package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/capstan-dev/capstan/examples/csv-payments/payment"
	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestParseConfig(t *testing.T) {
	t.Parallel()
	noEnv := func(string) string { return "" }
	cfg, err := parseConfig(nil, noEnv, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	want := config{Listen: "127.0.0.1:7070", LatencyMin: 5 * time.Millisecond, LatencyMax: 30 * time.Millisecond, RetryableFraction: 0.1, Seed: 1, LogLevel: slog.LevelInfo}
	if cfg != want {
		t.Errorf("defaults = %+v, want %+v", cfg, want)
	}

	env := map[string]string{
		"PROVIDER_LISTEN": "127.0.0.1:9999", "PROVIDER_ADMIN_LISTEN": "127.0.0.1:9998",
		"PROVIDER_LATENCY_MIN": "1ms", "PROVIDER_LATENCY_MAX": "2ms",
		"PROVIDER_RETRYABLE_FRACTION": "0.25", "PROVIDER_SEED": "7", "PROVIDER_LOG_LEVEL": "debug",
	}
	cfg, err = parseConfig([]string{"--seed", "9", "--listen=127.0.0.1:1"}, func(k string) string { return env[k] }, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	want = config{Listen: "127.0.0.1:1", AdminListen: "127.0.0.1:9998", LatencyMin: time.Millisecond, LatencyMax: 2 * time.Millisecond, RetryableFraction: 0.25, Seed: 9, LogLevel: slog.LevelDebug}
	if cfg != want {
		t.Errorf("env + flags = %+v, want %+v", cfg, want)
	}

	for _, args := range [][]string{
		{"--latency-min", "50ms", "--latency-max", "10ms"},
		{"--retryable-fraction", "1.5"},
		{"--retryable-fraction", "NaN"},
		{"--seed", "-1"},
		{"--nope"},
		{"extra"},
	} {
		if _, err := parseConfig(args, noEnv, &bytes.Buffer{}); !errors.Is(err, errConfig) {
			t.Errorf("parseConfig(%q) err = %v", args, err)
		}
	}
	if _, err := parseConfig(nil, func(k string) string {
		if k == "PROVIDER_LATENCY_MAX" {
			return "soon"
		}
		return ""
	}, &bytes.Buffer{}); !errors.Is(err, errConfig) {
		t.Errorf("bad env: %v", err)
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

func TestRunStartsAndStops(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(t.Context())
	var logs bytes.Buffer
	errc := make(chan error, 1)
	go func() {
		errc <- run(ctx, []string{"--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"}, func(string) string { return "" }, &logs)
	}()
	time.Sleep(100 * time.Millisecond)
	cancel()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(logs.Bytes(), []byte(`"msg":"provider stopped"`)) {
		t.Errorf("logs lack the stop record: %s", logs.String())
	}
	if err := run(t.Context(), []string{"--retryable-fraction", "2"}, func(string) string { return "" }, &bytes.Buffer{}); !errors.Is(err, errConfig) {
		t.Errorf("bad flag: %v", err)
	}
}
