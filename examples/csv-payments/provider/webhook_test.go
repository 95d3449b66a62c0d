package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/capstan-dev/capstan/examples/csv-payments/payment"
	"github.com/capstan-dev/capstan/pkg/adapter"
)

// servedProvider is a provider served by serve in a goroutine.
type servedProvider struct {
	admin string // base URL of GET /stats
	stop  func() error
	logs  *bytes.Buffer // JSON logs; read only after stop
}

// final returns the counts of the "provider stopped" log record; call it
// after stop.
func (sp servedProvider) final(t *testing.T) stats {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(sp.logs.Bytes()))
	for {
		var rec struct {
			Msg string `json:"msg"`
			stats
		}
		if err := dec.Decode(&rec); err != nil {
			t.Fatalf("no stop record in the logs (%v):\n%s", err, sp.logs.String())
		}
		if rec.Msg == "provider stopped" {
			return rec.stats
		}
	}
}

// runProvider serves a provider for cfg (lis may be nil in kafka mode) on
// loopback. stop ends it and returns serve's error; it is also called at
// cleanup.
func runProvider(t *testing.T, cfg config, lis net.Listener) servedProvider {
	t.Helper()
	adminLis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	logs := &bytes.Buffer{} // slog handlers serialise their writes
	logger := slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	go func() { errc <- serve(ctx, cfg, lis, adminLis, logger) }()
	var once sync.Once
	var serveErr error
	stop := func() error {
		once.Do(func() { cancel(); serveErr = <-errc })
		return serveErr
	}
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return servedProvider{admin: "http://" + adminLis.Addr().String(), stop: stop, logs: logs}
}

// readPayments reads the 12-row sample.
func readPayments(t *testing.T) []payment.Payment {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "testdata", "payments_12.csv"))
	if err != nil {
		t.Fatal(err)
	}
	rows, err := payment.ReadCSV(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	return rows
}

// interactionRequests returns one request per payment, completing at
// completionURL (empty for kafka).
func interactionRequests(rows []payment.Payment, completionURL string) []adapter.InteractionRequest {
	out := make([]adapter.InteractionRequest, len(rows))
	for i, p := range rows {
		out[i] = adapter.InteractionRequest{
			InteractionID: fmt.Sprintf("10000000-0000-0000-0000-%012d", i),
			CorrelationID: fmt.Sprintf("20000000-0000-0000-0000-%012d", i),
			ExecutionID:   fmt.Sprintf("30000000-0000-0000-0000-%012d", i),
			Capability:    "payments.send", Request: payment.EncodeJSON(p), ContentType: "application/json",
			Deadline: time.Now().Add(time.Minute), ResumeToken: fmt.Sprintf("resume-%d", i), CompletionURL: completionURL,
		}
	}
	return out
}

// checkCompletion fails unless c is the completion that payment.Decide
// (or, when retryable, provider.unavailable) gives for req's payment.
func checkCompletion(t *testing.T, req adapter.InteractionRequest, c adapter.InteractionCompletion, retryable bool) {
	t.Helper()
	if c.ResumeToken != req.ResumeToken || c.CorrelationID != req.CorrelationID {
		t.Errorf("%s: completion carries token %q, correlation %q", req.InteractionID, c.ResumeToken, c.CorrelationID)
	}
	if retryable {
		if f := c.Failure; f == nil || f.Class != payment.ClassProviderUnavailable || !f.Retryable {
			t.Errorf("%s: completion %+v, want a retryable provider.unavailable", req.InteractionID, c)
		}
		return
	}
	p, err := payment.DecodeJSON(req.Request)
	if err != nil {
		t.Fatal(err)
	}
	want := payment.Decide(p)
	if want.Succeeded {
		if c.Result == nil || c.Failure != nil || c.Result.ContentType != "application/json" {
			t.Errorf("%s: completion %+v, want a result", req.InteractionID, c)
			return
		}
		if got, err := payment.ParseResult(c.Result.Output); err != nil || got != want.Result {
			t.Errorf("%s: result %+v (%v), want %+v", req.InteractionID, got, err, want.Result)
		}
		return
	}
	if f := c.Failure; f == nil || c.Result != nil || f.Class != want.FailureClass || f.Message != want.FailureMessage || f.Retryable {
		t.Errorf("%s: completion %+v, want failure %+v", req.InteractionID, c, want)
	}
}

// fakeCompletionEndpoint stands in for the gateway's completion endpoint:
// it verifies each POST's signature and body and answers per script, then
// 200 {"status","duplicate"} like the gateway.
type fakeCompletionEndpoint struct {
	t      *testing.T
	secret string
	// script answers the n-th POST (1-based) of a resume token: 0 admits,
	// -1 drops the connection, another value is the status to answer.
	script func(token string, n int) int

	mu       sync.Mutex
	posts    map[string]int                           // POSTs per resume token
	admitted map[string]adapter.InteractionCompletion // first admitted per token
	admits   map[string]int                           // 200 answers per token
	ids      map[string]string                        // webhook-id per token
	changed  chan struct{}                            // signalled after each POST
}

func newFakeCompletionEndpoint(t *testing.T, secret string, script func(token string, n int) int) (*fakeCompletionEndpoint, string) {
	f := &fakeCompletionEndpoint{t: t, secret: secret, script: script, posts: map[string]int{},
		admitted: map[string]adapter.InteractionCompletion{}, admits: map[string]int{}, ids: map[string]string{},
		changed: make(chan struct{}, 1)}
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	return f, srv.URL + adapter.CompletionPath
}

func (f *fakeCompletionEndpoint) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	defer func() {
		select {
		case f.changed <- struct{}{}:
		default:
		}
	}()
	body, _ := io.ReadAll(r.Body)
	if r.Method != http.MethodPost || r.URL.Path != adapter.CompletionPath {
		f.t.Errorf("completion sent as %s %s", r.Method, r.URL.Path)
		w.WriteHeader(http.StatusNotFound)
		return
	}
	if err := adapter.VerifyWebhook(r.Header, f.secret, body, time.Now(), time.Minute); err != nil {
		f.t.Errorf("completion signature: %v", err)
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	c, err := adapter.DecodeCompletion(body)
	if err != nil {
		f.t.Errorf("completion body: %v", err)
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	f.mu.Lock()
	f.posts[c.ResumeToken]++
	n := f.posts[c.ResumeToken]
	if id, ok := f.ids[c.ResumeToken]; ok && id != r.Header.Get("webhook-id") {
		f.t.Errorf("webhook-id changed from %q to %q", id, r.Header.Get("webhook-id"))
	}
	f.ids[c.ResumeToken] = r.Header.Get("webhook-id")
	code := 0
	if f.script != nil {
		code = f.script(c.ResumeToken, n)
	}
	dup := false
	if code == 0 {
		prev, seen := f.admitted[c.ResumeToken]
		if seen {
			pb, _ := json.Marshal(prev)
			cb, _ := json.Marshal(c)
			if !bytes.Equal(pb, cb) {
				f.t.Errorf("token %s completed twice differently: %s then %s", c.ResumeToken, pb, cb)
			}
		} else {
			f.admitted[c.ResumeToken] = c
		}
		dup = seen
		f.admits[c.ResumeToken]++
	}
	f.mu.Unlock()
	switch code {
	case 0:
		w.Header().Set("content-type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{"status": "COMPLETED", "duplicate": dup})
	case -1:
		hj, ok := w.(http.Hijacker)
		if !ok {
			f.t.Error("cannot hijack")
			return
		}
		conn, _, err := hj.Hijack()
		if err == nil {
			conn.Close()
		}
	default:
		w.WriteHeader(code)
		_, _ = w.Write([]byte(`{"error":"scripted"}`))
	}
}

// waitAdmitted waits until n tokens are admitted at least copies times
// each, or fails after a minute.
func (f *fakeCompletionEndpoint) waitAdmitted(t *testing.T, n, copies int) {
	t.Helper()
	timeout := time.After(time.Minute)
	for {
		f.mu.Lock()
		done := 0
		for _, k := range f.admits {
			if k >= copies {
				done++
			}
		}
		f.mu.Unlock()
		if done >= n {
			return
		}
		select {
		case <-f.changed:
		case <-timeout:
			t.Fatalf("%d of %d completions admitted after a minute", done, n)
		}
	}
}

// postRequest POSTs req to the provider's /requests, signed with secret at
// ts, and returns the status.
func postRequest(t *testing.T, base, secret string, req any, ts time.Time) int {
	t.Helper()
	body, ok := req.([]byte)
	if !ok {
		var err error
		if body, err = json.Marshal(req); err != nil {
			t.Fatal(err)
		}
	}
	hr, err := http.NewRequest(http.MethodPost, base+requestsPath, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	hr.Header.Set("content-type", "application/json")
	if err := adapter.SignWebhook(hr.Header, secret, "msg_1", ts, body); err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(hr)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// startWebhookProvider serves a webhook-mode provider and returns its
// base URL.
func startWebhookProvider(t *testing.T, cfg config) (string, servedProvider) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Mode, cfg.WebhookSecret = modeWebhook, testSecret
	return "http://" + lis.Addr().String(), runProvider(t, cfg, lis)
}

func TestWebhookMode(t *testing.T) {
	t.Parallel()
	rows := readPayments(t)
	tests := []struct {
		name       string
		fraction   float64
		duplicates bool
		script     func(token string, n int) int
		// posts is the POSTs expected per token; copies the admitted ones.
		posts, copies int
	}{
		{name: "decides per payment.Decide", posts: 1, copies: 1},
		{name: "retryable fraction 1 fails every interaction retryably", fraction: 1, posts: 1, copies: 1},
		{
			name: "transient failures are retried", posts: 4, copies: 1,
			script: func(_ string, n int) int {
				return [...]int{http.StatusServiceUnavailable, -1, http.StatusTooManyRequests, 0}[n-1]
			},
		},
		{name: "duplicate completions are sent twice", duplicates: true, posts: 2, copies: 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			fake, completionURL := newFakeCompletionEndpoint(t, testSecret, tt.script)
			base, sp := startWebhookProvider(t, config{LatencyMin: time.Millisecond, LatencyMax: 3 * time.Millisecond,
				RetryableFraction: tt.fraction, Seed: 1, DuplicateCompletions: tt.duplicates})
			reqs := interactionRequests(rows, completionURL)
			for _, req := range reqs {
				if code := postRequest(t, base, testSecret, req, time.Now()); code != http.StatusAccepted {
					t.Fatalf("request %s: status %d, want 202", req.InteractionID, code)
				}
			}
			fake.waitAdmitted(t, len(reqs), tt.copies)
			// A resent request is acknowledged and not answered again.
			if code := postRequest(t, base, testSecret, reqs[0], time.Now()); code != http.StatusAccepted {
				t.Fatalf("resent request: status %d, want 202", code)
			}
			if err := sp.stop(); err != nil {
				t.Fatal(err)
			}
			s := sp.final(t)
			want := stats{Calls: int64(len(reqs) + 1), Executions: len(reqs), Interactions: len(reqs), Resent: 1,
				Completions: int64(len(reqs) * tt.copies)}
			if tt.duplicates {
				want.DuplicateAcks = int64(len(reqs))
			}
			if s != want {
				t.Errorf("stats = %+v, want %+v", s, want)
			}
			fake.mu.Lock()
			defer fake.mu.Unlock()
			for _, req := range reqs {
				if got := fake.posts[req.ResumeToken]; got != tt.posts {
					t.Errorf("%s: %d POSTs, want %d", req.InteractionID, got, tt.posts)
				}
				checkCompletion(t, req, fake.admitted[req.ResumeToken], tt.fraction == 1)
			}
		})
	}
}

func TestWebhookModeGivesUp(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name     string
		code     int
		deadline time.Duration
		posts    func(n int) bool
	}{
		// A refusal (late, superseded, bad signature) is final: one POST.
		{name: "refused completion is not retried", code: http.StatusConflict, deadline: time.Minute, posts: func(n int) bool { return n == 1 }},
		// Transient failures are retried until the interaction's deadline.
		{name: "retries end at the deadline", code: http.StatusBadGateway, deadline: 400 * time.Millisecond, posts: func(n int) bool { return n >= 2 }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			fake, completionURL := newFakeCompletionEndpoint(t, testSecret, func(string, int) int { return tt.code })
			base, sp := startWebhookProvider(t, config{Seed: 1})
			req := interactionRequests(readPayments(t)[:1], completionURL)[0]
			req.Deadline = time.Now().Add(tt.deadline)
			if code := postRequest(t, base, testSecret, req, time.Now()); code != http.StatusAccepted {
				t.Fatalf("status %d", code)
			}
			// Stopping lets the answer finish within the grace period: the
			// refusal comes at once, the deadline within 400ms.
			if err := sp.stop(); err != nil {
				t.Fatal(err)
			}
			fake.mu.Lock()
			n := fake.posts[req.ResumeToken]
			fake.mu.Unlock()
			if !tt.posts(n) {
				t.Errorf("%d POSTs", n)
			}
			if s := sp.final(t); s.Dropped != 1 || s.Completions != 0 || s.Interactions != 0 {
				t.Errorf("stats = %+v, want one dropped and forgotten", s)
			}
		})
	}
}

func TestWebhookModeRefusesBadRequests(t *testing.T) {
	t.Parallel()
	base, sp := startWebhookProvider(t, config{Seed: 1})
	good := interactionRequests(readPayments(t)[:1], "http://127.0.0.1:1"+adapter.CompletionPath)[0]
	without := func(f func(*adapter.InteractionRequest)) adapter.InteractionRequest {
		r := good
		f(&r)
		return r
	}
	tests := []struct {
		name   string
		body   any
		secret string
		ts     time.Time
		want   int
	}{
		{name: "other secret", body: good, secret: "whsec_" + "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", want: http.StatusUnauthorized},
		{name: "stale timestamp", body: good, ts: time.Now().Add(-time.Hour), want: http.StatusUnauthorized},
		{name: "not JSON", body: []byte("{nope"), want: http.StatusBadRequest},
		{name: "no interaction id", body: without(func(r *adapter.InteractionRequest) { r.InteractionID = "" }), want: http.StatusBadRequest},
		{name: "no resume token", body: without(func(r *adapter.InteractionRequest) { r.ResumeToken = "" }), want: http.StatusBadRequest},
		{name: "no completion url", body: without(func(r *adapter.InteractionRequest) { r.CompletionURL = "" }), want: http.StatusBadRequest},
		{name: "bad completion url", body: without(func(r *adapter.InteractionRequest) { r.CompletionURL = "ftp://x/y" }), want: http.StatusBadRequest},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			secret, ts := tt.secret, tt.ts
			if secret == "" {
				secret = testSecret
			}
			if ts.IsZero() {
				ts = time.Now()
			}
			if code := postRequest(t, base, secret, tt.body, ts); code != tt.want {
				t.Errorf("status %d, want %d", code, tt.want)
			}
		})
	}
	t.Run("GET", func(t *testing.T) {
		t.Parallel()
		resp, err := http.Get(base + requestsPath)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusMethodNotAllowed {
			t.Errorf("status %d, want 405", resp.StatusCode)
		}
	})
	t.Cleanup(func() {
		if s := readStats(t, sp.admin); s.Calls != 0 {
			t.Errorf("refused requests were admitted: %+v", s)
		}
	})
}

func TestDecideInteraction(t *testing.T) {
	t.Parallel()
	p := newProvider(config{RetryableFraction: 0.5, Seed: 3}, slog.New(slog.DiscardHandler))
	reqs := interactionRequests(readPayments(t), "")
	differ := 0
	for i, req := range reqs {
		c := p.decideInteraction(req)
		again, _ := json.Marshal(p.decideInteraction(req))
		if b, _ := json.Marshal(c); !bytes.Equal(b, again) {
			t.Fatalf("%s decided twice differently", req.InteractionID)
		}
		retry := failInteractionRetryably(3, req.ExecutionID, req.InteractionID, 0.5)
		checkCompletion(t, req, c, retry)
		// Another interaction (attempt) of the same execution draws anew.
		other := reqs[(i+1)%len(reqs)].InteractionID
		if retry != failInteractionRetryably(3, req.ExecutionID, other, 0.5) {
			differ++
		}
	}
	if differ == 0 {
		t.Error("the draw does not depend on the interaction id")
	}
}

func TestDrainContext(t *testing.T) {
	t.Parallel()
	parent, cancel := context.WithCancel(context.Background())
	ctx, stop := drainContext(parent, 20*time.Millisecond)
	defer stop()
	cancel()
	if ctx.Err() != nil {
		t.Fatal("the drain context ended with its parent")
	}
	<-ctx.Done() // ends after the grace period
	if !errors.Is(ctx.Err(), context.Canceled) {
		t.Errorf("err = %v", ctx.Err())
	}
}
