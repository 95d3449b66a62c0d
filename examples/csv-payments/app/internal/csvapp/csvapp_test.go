package csvapp

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/csv"
	"encoding/hex"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/capstan-dev/capstan/examples/csv-payments/payment"
	"github.com/capstan-dev/capstan/pkg/client"
	eventv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/event/v1"
	executionv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/execution/v1"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func testdata(name string) string {
	return filepath.Join("..", "..", "..", "testdata", name)
}

// newConfig returns a Config for input against g with a fresh loopback
// webhook listener that g delivers to, and an output in a temp dir.
func newConfig(t *testing.T, g *fakeGateway, input string) Config {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g.setWebhookURL("http://" + lis.Addr().String() + "/events")
	return Config{
		Gateway:         g.addr,
		APIKey:          testAPIKey,
		WebhookSecret:   testSecret,
		Input:           input,
		OutDir:          t.TempDir(),
		Concurrency:     16,
		Timeout:         60 * time.Second,
		PollInterval:    50 * time.Millisecond,
		PendingAfter:    time.Minute, // outcomes must come from webhooks unless a test lowers it
		WebhookListener: lis,
	}
}

func readPayments(t *testing.T, path string) []payment.Payment {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	rows, err := payment.ReadCSV(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	return rows
}

func readOutput(t *testing.T, path string) [][]string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	recs, err := csv.NewReader(f).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) == 0 || strings.Join(recs[0], ",") != strings.Join(OutputHeader, ",") {
		t.Fatalf("output header = %v", recs)
	}
	return recs[1:]
}

// checkOutput checks one output row per input row, in order, with the
// outcome payment.Decide predicts, except for rows listed in special.
func checkOutput(t *testing.T, in []payment.Payment, out [][]string, special map[string]bool) {
	t.Helper()
	if len(out) != len(in) {
		t.Fatalf("output has %d rows, input %d", len(out), len(in))
	}
	for i, p := range in {
		rec := out[i]
		if rec[0] != p.ID || rec[1] != p.Recipient || rec[2] != p.Amount || rec[3] != p.Currency {
			t.Fatalf("output row %d = %v, input %+v", i, rec, p)
		}
		if special[p.ID] {
			continue
		}
		o := payment.Decide(p)
		want := []string{"FAILED", "", "", o.FailureClass, o.FailureMessage, "1"}
		if o.Succeeded {
			want = []string{"SUCCEEDED", o.Result.ProviderReference, o.Result.Fee, "", "", "1"}
		}
		if got := rec[4:10]; strings.Join(got, "|") != strings.Join(want, "|") {
			t.Errorf("row %s: %q, want %q", p.ID, got, want)
		}
		if len(rec[10]) != 36 {
			t.Errorf("row %s: execution id %q", p.ID, rec[10])
		}
	}
}

func parseSummary(t *testing.T, s string) map[string]string {
	t.Helper()
	m := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(s), "\n") {
		k, v, ok := strings.Cut(line, ": ")
		if !ok {
			t.Fatalf("summary line %q is not key: value", line)
		}
		m[k] = v
	}
	return m
}

func TestRunEndToEnd(t *testing.T) {
	t.Parallel()
	g := startFakeGateway(t)
	g.duplicateEvery = 7
	g.beforeAnswer = 11
	g.unavailableOnce = map[string]bool{"5": true, "50": true, "500": true}
	cfg := newConfig(t, g, testdata("payments_1k.csv"))

	var stdout bytes.Buffer
	sum, err := Run(t.Context(), cfg, &stdout, nil)
	if err != nil {
		t.Fatal(err)
	}
	in := readPayments(t, cfg.Input)
	checkOutput(t, in, readOutput(t, filepath.Join(cfg.OutDir, "payments_1k.out.csv")), nil)

	if sum.RowsIn != 1000 || sum.InvokedNew != 1000 || sum.InvokedDuplicate != 0 ||
		sum.Succeeded != 802 || sum.Failed != 198 || sum.OtherTerminal != 0 || sum.Rejected != 0 || sum.Pending != 0 {
		t.Errorf("summary = %+v", sum)
	}
	// Every execution's event arrived once as new; deliveries made before
	// the invoke answered (every 11th) and duplicated (every 7th) are
	// certainly counted as duplicates; later duplicates may come after the
	// run finished.
	if sum.EventsDelivered != 1000 {
		t.Errorf("events delivered = %d, want 1000", sum.EventsDelivered)
	}
	if minDup := 1000 / 77; sum.DuplicateEvents < minDup || sum.DuplicateEvents > 1000/7 {
		t.Errorf("duplicate events = %d, want between %d and %d", sum.DuplicateEvents, minDup, 1000/7)
	}
	// Retried invokes reused the idempotency key: no duplicate executions.
	if got := g.accepted.Load(); got != 1000 {
		t.Errorf("gateway accepted %d executions, want 1000", got)
	}
	if got := g.invokes.Load(); got != 1003 {
		t.Errorf("gateway saw %d invokes, want 1003 (3 retried)", got)
	}
	if g.webhookErrors.Load() != 0 {
		t.Errorf("webhooks refused: %d (%s)", g.webhookErrors.Load(), g.lastWebhookErr)
	}

	m := parseSummary(t, stdout.String())
	for k, v := range map[string]string{
		"rows in": "1000", "invoked new": "1000", "invoked duplicate": "0", "succeeded": "802",
		"failed": "198", "other terminal": "0", "events delivered": "1000",
		"duplicate events": strconv.Itoa(sum.DuplicateEvents),
		"output":           filepath.Join(cfg.OutDir, "payments_1k.out.csv"),
	} {
		if m[k] != v {
			t.Errorf("summary %q = %q, want %q", k, m[k], v)
		}
	}
	for _, k := range []string{"elapsed", "rows per second"} {
		if m[k] == "" {
			t.Errorf("summary lacks %q", k)
		}
	}
}

func TestDuplicateWebhooksAreCountedOnce(t *testing.T) {
	t.Parallel()
	g := startFakeGateway(t)
	g.beforeAnswer = 1   // every event is delivered before the invoke answers...
	g.duplicateEvery = 1 // ...twice
	cfg := newConfig(t, g, testdata("payments_12.csv"))
	sum, err := Run(t.Context(), cfg, &bytes.Buffer{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if sum.EventsDelivered != 12 || sum.DuplicateEvents != 12 {
		t.Errorf("events delivered %d, duplicates %d; want 12 and 12", sum.EventsDelivered, sum.DuplicateEvents)
	}
	checkOutput(t, readPayments(t, cfg.Input), readOutput(t, cfg.OutputPath()), nil)
}

func TestRerunTakesOutcomesFromGet(t *testing.T) {
	t.Parallel()
	g := startFakeGateway(t)
	cfg := newConfig(t, g, testdata("payments_12.csv"))
	if _, err := Run(t.Context(), cfg, &bytes.Buffer{}, nil); err != nil {
		t.Fatal(err)
	}
	first, err := os.ReadFile(cfg.OutputPath())
	if err != nil {
		t.Fatal(err)
	}
	getsBefore := g.gets.Load()

	// The re-run gets no webhooks: every invoke answers DUPLICATE with a
	// terminal status, so the outcomes must come from Get, at once (the
	// poll would start only after a minute).
	g.sendWebhooks.Store(false)
	cfg2 := newConfig(t, g, cfg.Input)
	sum, err := Run(t.Context(), cfg2, &bytes.Buffer{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if sum.InvokedNew != 0 || sum.InvokedDuplicate != 12 || sum.EventsDelivered != 0 || sum.Succeeded != 9 || sum.Failed != 3 {
		t.Errorf("re-run summary = %+v", sum)
	}
	if got := g.gets.Load() - getsBefore; got != 12 {
		t.Errorf("re-run made %d Get calls, want 12", got)
	}
	second, err := os.ReadFile(cfg2.OutputPath())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(first, second) {
		t.Errorf("re-run output differs:\n%s\n---\n%s", first, second)
	}
	if g.accepted.Load() != 12 {
		t.Errorf("accepted = %d, want 12", g.accepted.Load())
	}
}

func TestPollSafetyNet(t *testing.T) {
	t.Parallel()
	g := startFakeGateway(t)
	g.sendWebhooks.Store(false) // events "were delivered elsewhere"
	cfg := newConfig(t, g, testdata("payments_12.csv"))
	cfg.PendingAfter = 100 * time.Millisecond
	sum, err := Run(t.Context(), cfg, &bytes.Buffer{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if sum.EventsDelivered != 0 || sum.Succeeded != 9 || sum.Failed != 3 {
		t.Errorf("summary = %+v", sum)
	}
	checkOutput(t, readPayments(t, cfg.Input), readOutput(t, cfg.OutputPath()), nil)
}

func TestTimeoutLeavesRowsPending(t *testing.T) {
	t.Parallel()
	g := startFakeGateway(t)
	g.settle = false
	cfg := newConfig(t, g, testdata("payments_12.csv"))
	cfg.Timeout = 300 * time.Millisecond
	var stdout bytes.Buffer
	sum, err := Run(t.Context(), cfg, &stdout, nil)
	var pe *PendingError
	if !errors.As(err, &pe) || pe.Pending != 12 || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want *PendingError with 12 rows after the deadline", err)
	}
	if sum.Pending != 12 || parseSummary(t, stdout.String())["pending"] != "12" {
		t.Errorf("summary = %+v / %s", sum, stdout.String())
	}
	out := readOutput(t, cfg.OutputPath())
	if len(out) != 12 {
		t.Fatalf("%d output rows, want 12", len(out))
	}
	for _, rec := range out {
		if rec[4] != StatusPending || rec[5] != "" || rec[9] != "0" {
			t.Errorf("row %v, want PENDING", rec)
		}
	}
}

func TestRejectedAndGivenUpRows(t *testing.T) {
	t.Parallel()
	g := startFakeGateway(t)
	g.rejectIDs = map[string]bool{"3": true}
	g.failClass = map[string][]string{"4": {"provider.unavailable", "retry_exhausted.attempt_limit"}}
	cfg := newConfig(t, g, testdata("payments_12.csv"))
	cfg.Output = filepath.Join(t.TempDir(), "sub", "out.csv")
	sum, err := Run(t.Context(), cfg, &bytes.Buffer{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if sum.Rejected != 1 || sum.Failed != 3 || sum.Succeeded != 8 {
		t.Errorf("summary = %+v", sum)
	}
	out := readOutput(t, cfg.Output)
	checkOutput(t, readPayments(t, cfg.Input), out, map[string]bool{"3": true, "4": true})
	if got := strings.Join(out[2][4:], "|"); got != "REJECTED|||invoke.invalid_argument|input: rejected by the fake gateway|0|" {
		t.Errorf("rejected row = %q", got)
	}
	if got := strings.Join(out[3][4:10], "|"); got != "FAILED|||provider.unavailable|retry_exhausted.attempt_limit: gave up|3" {
		t.Errorf("given-up row = %q", got)
	}
}

func TestUnauthenticatedStops(t *testing.T) {
	t.Parallel()
	g := startFakeGateway(t)
	cfg := newConfig(t, g, testdata("payments_12.csv"))
	cfg.APIKey = "wrong"
	_, err := Run(t.Context(), cfg, &bytes.Buffer{}, nil)
	if !errors.Is(err, ErrUnauthenticated) {
		t.Fatalf("err = %v", err)
	}
	if _, err := os.Stat(cfg.OutputPath()); !os.IsNotExist(err) {
		t.Errorf("output written after UNAUTHENTICATED: %v", err)
	}
}

func TestRunInputErrors(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.csv")
	if err := os.WriteFile(bad, []byte("ID,Recipient,Amount,Currency\n1,A,1.234,EUR\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := Config{Gateway: "127.0.0.1:1", APIKey: "k", WebhookSecret: testSecret, Input: bad}
	_, err := Run(t.Context(), cfg, &bytes.Buffer{}, nil)
	var fe *payment.FieldError
	if !errors.As(err, &fe) || fe.Line != 2 || fe.Field != "Amount" {
		t.Errorf("err = %v", err)
	}
	cfg.Input = filepath.Join(dir, "missing.csv")
	if _, err := Run(t.Context(), cfg, &bytes.Buffer{}, nil); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing input: %v", err)
	}
	cfg.Input, cfg.WebhookSecret = bad, ""
	if _, err := Run(t.Context(), cfg, &bytes.Buffer{}, nil); !errors.Is(err, ErrConfig) {
		t.Errorf("no secret: %v", err)
	}
}

// TestReceiver drives the webhook handler directly.
func TestReceiver(t *testing.T) {
	t.Parallel()
	v, err := client.NewEventVerifier(testSecret)
	if err != nil {
		t.Fatal(err)
	}
	rows := []*row{{payment: payment.Payment{ID: "1"}}}
	tr := newTracker(rows, time.Minute)
	rc := &receiver{verifier: v, tracker: tr, logger: slog.New(slog.DiscardHandler)}
	h := rc.handler()

	wh, _ := standardwebhooks.NewWebhook(testSecret)
	post := func(id string, body []byte, tamper bool) int {
		ts := time.Now()
		sig, _ := wh.Sign(id, ts, body)
		if tamper {
			body = append([]byte(" "), body...)
		}
		req := httptest.NewRequest(http.MethodPost, "/events", bytes.NewReader(body))
		req.Header.Set("webhook-id", id)
		req.Header.Set("webhook-timestamp", strconv.FormatInt(ts.Unix(), 10))
		req.Header.Set("webhook-signature", sig)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec.Code
	}
	ev := &eventv1.CompletionEvent{
		EventId: "ev-1", ExecutionId: "ex-1", Status: executionv1.ExecutionStatus_EXECUTION_STATUS_SUCCEEDED,
		Attempts: 2, Output: payment.Result{ProviderReference: "PR-x", Fee: "1.00", Currency: "EUR"}.JSON(),
	}
	body, _ := protojson.Marshal(ev)

	if c := post("ev-1", body, true); c != http.StatusUnauthorized {
		t.Errorf("tampered: %d", c)
	}
	if c := post("ev-x", []byte("garbage"), false); c != http.StatusBadRequest {
		t.Errorf("garbage: %d", c)
	}
	// The event overtakes the invoke answer: 200, kept, applied later.
	if c := post("ev-1", body, false); c != http.StatusOK {
		t.Errorf("unknown execution: %d", c)
	}
	if c := post("ev-1", body, false); c != http.StatusOK {
		t.Errorf("duplicate: %d", c)
	}
	tr.onInvoked(0, &executionv1.InvokeCapabilityResponse{ExecutionId: "ex-1", Status: executionv1.ExecutionStatus_EXECUTION_STATUS_QUEUED}, time.Now())
	select {
	case <-tr.Done():
	default:
		t.Fatal("row not settled by the early event")
	}
	s := tr.counts()
	if s.EventsDelivered != 1 || s.DuplicateEvents != 1 || s.Succeeded != 1 {
		t.Errorf("counts = %+v", s)
	}
	if o := tr.snapshot()[0].out; o.ProviderReference != "PR-x" || o.Fee != "1.00" || o.Attempts != 2 {
		t.Errorf("outcome = %+v", o)
	}

	req := httptest.NewRequest(http.MethodGet, "/events", nil)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code != http.StatusMethodNotAllowed {
		t.Errorf("GET: %d", rec.Code)
	}
}

func TestParseConfig(t *testing.T) {
	t.Parallel()
	env := map[string]string{
		"CAPSTAN_GATEWAY": "127.0.0.1:7443", "CAPSTAN_API_KEY": "k", "APP_WEBHOOK_SECRET": testSecret,
		"APP_WEBHOOK_LISTEN": "127.0.0.1:9000", "APP_CONCURRENCY": "8", "APP_TIMEOUT": "1m",
		"APP_OUT_DIR": "/tmp/out",
	}
	getenv := func(k string) string { return env[k] }
	cfg, level, err := ParseConfig([]string{"--input", "data/payments_1k.csv", "--concurrency", "4"}, getenv, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Gateway != "127.0.0.1:7443" || cfg.APIKey != "k" || cfg.WebhookListen != "127.0.0.1:9000" ||
		cfg.Concurrency != 4 || cfg.Timeout != time.Minute || cfg.PollInterval != DefaultPollInterval ||
		cfg.PendingAfter != DefaultPendingAfter || level.String() != "INFO" {
		t.Errorf("cfg = %+v, level %v", cfg, level)
	}
	if got, want := cfg.OutputPath(), filepath.Join("/tmp/out", "payments_1k.out.csv"); got != want {
		t.Errorf("OutputPath = %q, want %q", got, want)
	}
	if _, _, err := ParseConfig(nil, getenv, &bytes.Buffer{}); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "--input") {
		t.Errorf("missing input: %v", err)
	}
	if _, _, err := ParseConfig([]string{"--input", "x", "--concurrency", "0"}, getenv, &bytes.Buffer{}); !errors.Is(err, ErrConfig) {
		t.Errorf("zero concurrency: %v", err)
	}
	env["APP_TIMEOUT"] = "forever"
	if _, _, err := ParseConfig([]string{"--input", "x"}, getenv, &bytes.Buffer{}); !errors.Is(err, ErrConfig) {
		t.Errorf("bad env: %v", err)
	}
	cfg, _, err = ParseConfig([]string{"--input", "x", "--timeout", "2m"}, getenv, &bytes.Buffer{})
	if err != nil || cfg.Timeout != 2*time.Minute {
		t.Errorf("flag must win over bad env: %v, %v", cfg.Timeout, err)
	}
	if got := (Config{Input: "a/b/in.CSV"}).OutputPath(); got != "in.out.csv" {
		t.Errorf("default OutputPath = %q", got)
	}
}

func TestSummaryFormat(t *testing.T) {
	t.Parallel()
	s := Summary{RowsIn: 10, InvokedNew: 8, InvokedDuplicate: 2, Succeeded: 6, Failed: 2, OtherTerminal: 1,
		Rejected: 1, EventsDelivered: 8, DuplicateEvents: 3, Elapsed: 2500 * time.Millisecond, Output: "x.out.csv"}
	var b bytes.Buffer
	if _, err := s.WriteTo(&b); err != nil {
		t.Fatal(err)
	}
	want := `rows in: 10
invoked new: 8
invoked duplicate: 2
succeeded: 6
failed: 2
other terminal: 1
rejected: 1
pending: 0
events delivered: 8
duplicate events: 3
elapsed: 2.5s
rows per second: 4.0
output: x.out.csv
`
	if b.String() != want {
		t.Errorf("summary:\n%s\nwant:\n%s", b.String(), want)
	}
}

func TestIdempotencyKey(t *testing.T) {
	t.Parallel()
	sum := sha256.Sum256([]byte("file"))
	if got, want := IdempotencyKey(sum, "42"), "csv-payments:"+hex.EncodeToString(sum[:])[:16]+":42"; got != want {
		t.Errorf("key = %q", got)
	}
	if snakeCode(3) != "invalid_argument" || snakeCode(14) != "unavailable" {
		t.Errorf("snakeCode = %q, %q", snakeCode(3), snakeCode(14))
	}
}
