package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/capstan-dev/capstan/examples/csv-payments/payment"
	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
	callbackv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/callback/v1"
	executionv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/execution/v1"
)

// testAdapterKey is the key the fake gateway expects.
const testAdapterKey = "ak_test_7f3c9a1e5b2d4f6a8c0e"

// Methods of AdapterCallbackService, as fakeGateway records them.
const (
	methodRenew    = "RenewLease"
	methodProgress = "ReportProgress"
	methodComplete = "CompleteExecution"
)

// fakeCall is one call fakeGateway received.
type fakeCall struct {
	method, token string
	percent       int32
	message       string
	complete      *callbackv1.CompleteExecutionRequest
	code          codes.Code // what the fake answered
}

// fakeGateway is an in-process AdapterCallbackService on loopback: it
// checks the bearer key, records every call in order and admits
// completions as the gateway does — the first wins, an identical repeat is
// a duplicate, a different one is refused (and fails the test).
type fakeGateway struct {
	callbackv1.UnimplementedAdapterCallbackServiceServer
	t    *testing.T
	addr string
	// lease is what RenewLease extends the lease by. Default 10s.
	lease time.Duration
	// script, when set, may answer the n-th (1-based) call of method for a
	// token with an error instead of serving it.
	script func(method, token string, n int) error
	// gate, when set, holds every ReportProgress until it is closed. Set
	// it under mu once the fake serves.
	gate chan struct{}

	mu       sync.Mutex
	calls    []fakeCall
	n        map[string]int // calls per method and token
	admitted map[string]*callbackv1.CompleteExecutionRequest
	changed  chan struct{} // signalled after each call
}

// startFakeGateway serves a fakeGateway configured by f (may be nil) on
// loopback until the test ends.
func startFakeGateway(t *testing.T, f func(*fakeGateway)) *fakeGateway {
	t.Helper()
	g := &fakeGateway{t: t, lease: 10 * time.Second, n: map[string]int{},
		admitted: map[string]*callbackv1.CompleteExecutionRequest{}, changed: make(chan struct{}, 1)}
	if f != nil {
		f(g)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	callbackv1.RegisterAdapterCallbackServiceServer(srv, g)
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	t.Cleanup(func() { srv.Stop(); <-done })
	g.addr = lis.Addr().String()
	return g
}

// signal wakes waitFor; handlers defer it, so that it follows every
// change the call makes.
func (g *fakeGateway) signal() {
	select {
	case g.changed <- struct{}{}:
	default:
	}
}

// record authenticates a call, records it and returns the scripted error,
// if any.
func (g *fakeGateway) record(ctx context.Context, c fakeCall) error {
	var err error
	if md, _ := metadata.FromIncomingContext(ctx); len(md.Get("authorization")) != 1 ||
		md.Get("authorization")[0] != "Bearer "+testAdapterKey {
		err = status.Error(codes.Unauthenticated, "unknown adapter key")
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.n[c.method+" "+c.token]++
	if err == nil && g.script != nil {
		err = g.script(c.method, c.token, g.n[c.method+" "+c.token])
	}
	c.code = status.Code(err)
	g.calls = append(g.calls, c)
	return err
}

func (g *fakeGateway) RenewLease(ctx context.Context, req *callbackv1.RenewLeaseRequest) (*callbackv1.RenewLeaseResponse, error) {
	defer g.signal()
	if err := g.record(ctx, fakeCall{method: methodRenew, token: req.GetCallbackToken()}); err != nil {
		return nil, err
	}
	return &callbackv1.RenewLeaseResponse{LeaseExpiresAt: timestamppb.New(time.Now().Add(g.lease))}, nil
}

func (g *fakeGateway) ReportProgress(ctx context.Context, req *callbackv1.ReportProgressRequest) (*callbackv1.ReportProgressResponse, error) {
	defer g.signal()
	g.mu.Lock()
	gate := g.gate
	g.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return nil, status.FromContextError(ctx.Err()).Err()
		}
	}
	if err := g.record(ctx, fakeCall{method: methodProgress, token: req.GetCallbackToken(),
		percent: req.GetPercent(), message: req.GetMessage()}); err != nil {
		return nil, err
	}
	return &callbackv1.ReportProgressResponse{}, nil
}

func (g *fakeGateway) CompleteExecution(ctx context.Context, req *callbackv1.CompleteExecutionRequest) (*callbackv1.CompleteExecutionResponse, error) {
	defer g.signal()
	if err := g.record(ctx, fakeCall{method: methodComplete, token: req.GetCallbackToken(), complete: req}); err != nil {
		return nil, err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	st := executionv1.ExecutionStatus_EXECUTION_STATUS_SUCCEEDED
	if req.GetFailure() != nil {
		st = executionv1.ExecutionStatus_EXECUTION_STATUS_FAILED
	}
	prev, seen := g.admitted[req.GetCallbackToken()]
	if !seen {
		g.admitted[req.GetCallbackToken()] = req
		return &callbackv1.CompleteExecutionResponse{Status: st}, nil
	}
	if !proto.Equal(prev, req) {
		g.t.Errorf("token %s completed twice differently: %v then %v", req.GetCallbackToken(), prev, req)
		return nil, status.Error(codes.FailedPrecondition, "a different completion was admitted first")
	}
	return &callbackv1.CompleteExecutionResponse{Status: st, Duplicate: true}, nil
}

// waitFor waits until cond, evaluated under the fake's lock after each
// call, holds, or fails the test after a minute.
func (g *fakeGateway) waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	timeout := time.After(time.Minute)
	for {
		g.mu.Lock()
		ok := cond()
		g.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-g.changed:
		case <-timeout:
			calls := g.snapshot()
			t.Fatalf("timed out waiting for %s; %d calls, the last: %v", what, len(calls), calls[max(0, len(calls)-10):])
		}
	}
}

// count returns the calls of method for token; call it with g.mu held.
func (g *fakeGateway) count(method, token string) int { return g.n[method+" "+token] }

// countNow is count for callers not holding g.mu.
func (g *fakeGateway) countNow(method, token string) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.count(method, token)
}

// completion returns the first completion admitted for token.
func (g *fakeGateway) completion(token string) *callbackv1.CompleteExecutionRequest {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.admitted[token]
}

// admittedCount returns how many tokens have an admitted completion.
func (g *fakeGateway) admittedCount() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.admitted)
}

// snapshot returns the calls so far.
func (g *fakeGateway) snapshot() []fakeCall {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]fakeCall(nil), g.calls...)
}

// callbackConfig is the provider's configuration in callback mode against
// g, without latency unless changed.
func callbackConfig(g *fakeGateway) config {
	return config{Mode: modeCallback, Gateway: g.addr, AdapterKey: testAdapterKey, RenewEvery: time.Second, Seed: 1}
}

// startCallbackProvider serves a provider for cfg on loopback and returns
// an AdapterService client for it.
func startCallbackProvider(t *testing.T, cfg config) (adapterv1.AdapterServiceClient, servedProvider) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	sp := runProvider(t, cfg, lis)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() }) // runs before runProvider's stop
	return adapterv1.NewAdapterServiceClient(conn), sp
}

// execRequest is attempt of execution id with input; its callback token
// is derived from both.
func execRequest(id string, attempt int32, input []byte) *adapterv1.ExecuteRequest {
	return &adapterv1.ExecuteRequest{ExecutionId: id, Attempt: attempt, Capability: "payments.send",
		Input: input, ContentType: "application/json", CallbackToken: fmt.Sprintf("cap1.tok-%s-%d.sig", id, attempt)}
}

// requireAccepted fails unless resp is "accepted" with reference ref.
func requireAccepted(t *testing.T, resp *adapterv1.ExecuteResponse, err error, ref string) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
	if a := resp.GetAccepted(); a == nil || a.GetExternalReference() != ref {
		t.Fatalf("Execute answered %v, want accepted with reference %q", resp, ref)
	}
}

// TestCallbackMatchesDirect runs the 12-row sample, two attempts each,
// through direct mode and callback mode with the same seed: each callback
// completion carries exactly the result or failure direct mode answers,
// after a progress report, and the reference of the "accepted" answer is
// the payment's provider reference or the execution id.
func TestCallbackMatchesDirect(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name     string
		fraction float64
		seed     uint64
	}{
		{name: "no retryable failures", fraction: 0, seed: 1},
		{name: "seeded retryable failures", fraction: 0.4, seed: 3},
	}
	rows := readPayments(t)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			direct, _ := startProvider(t, config{RetryableFraction: tt.fraction, Seed: tt.seed})
			directClient := adapterv1.NewAdapterServiceClient(direct)
			g := startFakeGateway(t, nil)
			cfg := callbackConfig(g)
			cfg.RetryableFraction, cfg.Seed, cfg.LatencyMax = tt.fraction, tt.seed, 5*time.Millisecond
			c, sp := startCallbackProvider(t, cfg)

			want := map[string]*adapterv1.ExecuteResponse{} // by callback token
			for i, p := range rows {
				for attempt := int32(1); attempt <= 2; attempt++ {
					req := execRequest(fmt.Sprintf("00000000-0000-0000-0000-%012d", i), attempt, payment.EncodeJSON(p))
					d, err := directClient.Execute(t.Context(), req)
					if err != nil {
						t.Fatal(err)
					}
					want[req.GetCallbackToken()] = d
					ref := req.GetExecutionId()
					if r := d.GetResult(); r != nil {
						res, err := payment.ParseResult(r.GetOutput())
						if err != nil {
							t.Fatal(err)
						}
						ref = res.ProviderReference
					}
					resp, err := c.Execute(t.Context(), req)
					requireAccepted(t, resp, err, ref)
				}
			}
			g.waitFor(t, "every completion", func() bool { return len(g.admitted) == len(want) })
			if err := sp.stop(); err != nil {
				t.Fatal(err)
			}

			progressed := map[string]bool{}
			retryable := 0
			for _, call := range g.snapshot() {
				if call.code != codes.OK {
					t.Errorf("fake answered %v to %s", call.code, call.method)
				}
				switch call.method {
				case methodProgress:
					if call.percent != progressPercent || call.message != progressMessage {
						t.Errorf("%s: progress %d %q", call.token, call.percent, call.message)
					}
					progressed[call.token] = true
				case methodComplete:
					if !progressed[call.token] {
						t.Errorf("%s: completed before reporting progress", call.token)
					}
					d := want[call.token]
					if !proto.Equal(call.complete.GetResult(), d.GetResult()) || !proto.Equal(call.complete.GetFailure(), d.GetFailure()) {
						t.Errorf("%s: completion %v, direct mode answered %v", call.token, call.complete, d)
					}
					if call.complete.GetFailure().GetRetryable() {
						retryable++
					}
				}
			}
			if tt.fraction > 0 && retryable == 0 {
				t.Error("no retryable failure among the completions")
			}
			if s, wantStats := sp.final(t), (stats{Calls: int64(len(want)), Executions: len(rows), Completions: int64(len(want))}); s != wantStats {
				t.Errorf("stats = %+v, want %+v", s, wantStats)
			}
			if logs := sp.logs.String(); strings.Contains(logs, testAdapterKey) || strings.Contains(logs, "cap1.tok-") {
				t.Errorf("the logs reveal the adapter key or a callback token:\n%s", logs)
			}
		})
	}
}

// TestCallbackRetryableFraction checks that the completions fail retryably
// exactly for the attempts the seeded draw picks, at about the fraction.
func TestCallbackRetryableFraction(t *testing.T) {
	t.Parallel()
	const n, fraction, seed = 400, 0.2, 9
	g := startFakeGateway(t, nil)
	cfg := callbackConfig(g)
	cfg.RetryableFraction, cfg.Seed = fraction, seed
	c, sp := startCallbackProvider(t, cfg)
	input := payment.EncodeJSON(payment.Payment{ID: "1", Recipient: "R", Amount: "10", Currency: "EUR"})
	for i := range n {
		req := execRequest(fmt.Sprintf("exec-%d", i), 1, input)
		resp, err := c.Execute(t.Context(), req)
		if err != nil || resp.GetAccepted() == nil {
			t.Fatalf("Execute: %v, %v", resp, err)
		}
	}
	g.waitFor(t, "every completion", func() bool { return len(g.admitted) == n })
	if err := sp.stop(); err != nil {
		t.Fatal(err)
	}
	retryable := 0
	for i := range n {
		id := fmt.Sprintf("exec-%d", i)
		c := g.completion(execRequest(id, 1, nil).GetCallbackToken())
		got := c.GetFailure().GetRetryable()
		if got != failRetryably(seed, id, 1, fraction) {
			t.Errorf("%s: completion %v, failRetryably = %v", id, c, !got)
		}
		if got {
			retryable++
			if f := c.GetFailure(); f.GetClass() != payment.ClassProviderUnavailable {
				t.Errorf("%s: retryable failure %v", id, f)
			}
		}
	}
	if f := float64(retryable) / n; f < 0.14 || f > 0.26 {
		t.Errorf("retryable fraction = %.3f, want about %v", f, fraction)
	}
}

// TestCallbackLeaseRenewal checks that the lease is renewed while the work
// is held longer than --renew-every, more often when the lease is short,
// not at all for quick work, and always before the completion.
func TestCallbackLeaseRenewal(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name        string
		latency     time.Duration
		renewEvery  time.Duration
		lease       time.Duration
		minRenewals int
		maxRenewals int
	}{
		{name: "quick work is not renewed", latency: time.Millisecond, renewEvery: time.Second, lease: 10 * time.Second, maxRenewals: 0},
		{name: "long work is renewed", latency: 400 * time.Millisecond, renewEvery: 60 * time.Millisecond, lease: 10 * time.Second,
			minRenewals: 2, maxRenewals: 8},
		// Without adapting to the 60ms lease, 400ms of work would see at
		// most 2 renewals (at 150ms and 300ms).
		{name: "a short lease is renewed every third of it", latency: 400 * time.Millisecond, renewEvery: 150 * time.Millisecond,
			lease: 60 * time.Millisecond, minRenewals: 4, maxRenewals: 100},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			g := startFakeGateway(t, func(g *fakeGateway) { g.lease = tt.lease })
			cfg := callbackConfig(g)
			cfg.LatencyMin, cfg.LatencyMax, cfg.RenewEvery = tt.latency, tt.latency, tt.renewEvery
			c, sp := startCallbackProvider(t, cfg)
			req := execRequest("exec-1", 1, payment.EncodeJSON(payment.Payment{ID: "1", Recipient: "R", Amount: "10", Currency: "EUR"}))
			if _, err := c.Execute(t.Context(), req); err != nil {
				t.Fatal(err)
			}
			g.waitFor(t, "the completion", func() bool { return g.count(methodComplete, req.GetCallbackToken()) == 1 })
			if err := sp.stop(); err != nil {
				t.Fatal(err)
			}
			renewals, completed := 0, false
			for _, call := range g.snapshot() {
				switch call.method {
				case methodRenew:
					if completed {
						t.Error("lease renewed after the completion")
					}
					renewals++
				case methodComplete:
					completed = true
				}
			}
			if renewals < tt.minRenewals || renewals > tt.maxRenewals {
				t.Errorf("%d renewals, want %d..%d", renewals, tt.minRenewals, tt.maxRenewals)
			}
			if s := sp.final(t); s.Renewals != int64(renewals) || s.Completions != 1 {
				t.Errorf("stats = %+v, want %d renewals and 1 completion", s, renewals)
			}
		})
	}
}

// TestCallbackFailures checks how the provider handles the gateway's
// answers: UNAVAILABLE and DEADLINE_EXCEEDED are retried until admitted;
// FAILED_PRECONDITION and other refusals are final; a refused renewal or
// progress report (the lease is lost) abandons the attempt uncompleted.
func TestCallbackFailures(t *testing.T) {
	t.Parallel()
	codeOn := func(method string, code codes.Code, upTo int) func(string, string, int) error {
		return func(m, _ string, n int) error {
			if m == method && (upTo == 0 || n <= upTo) {
				return status.Error(code, "scripted")
			}
			return nil
		}
	}
	tests := []struct {
		name          string
		script        func(method, token string, n int) error
		key           string // adapter key; default testAdapterKey
		latency       time.Duration
		renewEvery    time.Duration
		wantCompletes int    // CompleteExecution calls
		refusedBy     string // with no CompleteExecution call: the method refused
		wantLog       string
		want          stats
	}{
		{name: "unavailable twice, then admitted", script: codeOn(methodComplete, codes.Unavailable, 2),
			wantCompletes: 3, want: stats{Completions: 1}},
		{name: "deadline exceeded, then admitted", script: codeOn(methodComplete, codes.DeadlineExceeded, 1),
			wantCompletes: 2, want: stats{Completions: 1}},
		{name: "failed precondition is final", script: codeOn(methodComplete, codes.FailedPrecondition, 0),
			wantCompletes: 1, wantLog: "completion refused as final", want: stats{Dropped: 1}},
		{name: "permission denied is final", script: codeOn(methodComplete, codes.PermissionDenied, 0),
			wantCompletes: 1, wantLog: "completion not delivered", want: stats{Dropped: 1}},
		{name: "a wrong adapter key is refused", key: "ak_wrong", wantCompletes: 1, wantLog: "completion not delivered",
			want: stats{Dropped: 1}},
		{name: "lease renewal refused", script: codeOn(methodRenew, codes.FailedPrecondition, 0),
			latency: 2 * time.Second, renewEvery: 20 * time.Millisecond, refusedBy: methodRenew, wantLog: "lease renewal refused",
			want: stats{Dropped: 1}},
		{name: "lease renewal unavailable, then renewed", script: codeOn(methodRenew, codes.Unavailable, 1),
			latency: 300 * time.Millisecond, renewEvery: 20 * time.Millisecond, wantCompletes: 1, wantLog: "lease renewal failed",
			want: stats{Completions: 1}},
		{name: "progress refused", script: codeOn(methodProgress, codes.FailedPrecondition, 0),
			latency: 2 * time.Second, refusedBy: methodProgress, wantLog: "attempt abandoned before completion", want: stats{Dropped: 1}},
		{name: "progress unavailable is not fatal", script: codeOn(methodProgress, codes.Unavailable, 0),
			wantCompletes: 1, wantLog: "progress not reported", want: stats{Completions: 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			g := startFakeGateway(t, func(g *fakeGateway) { g.script = tt.script })
			cfg := callbackConfig(g)
			cfg.LatencyMin, cfg.LatencyMax = tt.latency, tt.latency
			if tt.renewEvery > 0 {
				cfg.RenewEvery = tt.renewEvery
			}
			if tt.key != "" {
				cfg.AdapterKey = tt.key
			}
			c, sp := startCallbackProvider(t, cfg)
			req := execRequest("exec-1", 1, payment.EncodeJSON(payment.Payment{ID: "1", Recipient: "R", Amount: "10", Currency: "EUR"}))
			if _, err := c.Execute(t.Context(), req); err != nil {
				t.Fatal(err)
			}
			tok := req.GetCallbackToken()
			if tt.wantCompletes > 0 {
				g.waitFor(t, "the completions", func() bool { return g.count(methodComplete, tok) == tt.wantCompletes })
			} else {
				g.waitFor(t, "the refusal", func() bool { return g.count(tt.refusedBy, tok) > 0 })
			}
			start := time.Now()
			if err := sp.stop(); err != nil {
				t.Fatal(err)
			}
			if d := time.Since(start); d > time.Second {
				t.Errorf("stop took %v: the abandoned attempt held it up", d)
			}
			if n := g.countNow(methodComplete, tok); n != tt.wantCompletes {
				t.Errorf("%d CompleteExecution calls, want %d", n, tt.wantCompletes)
			}
			want := tt.want
			want.Calls, want.Executions = 1, 1
			s := sp.final(t)
			s.Renewals = 0
			if s != want {
				t.Errorf("stats = %+v, want %+v", s, want)
			}
			if logs := sp.logs.String(); tt.wantLog != "" && !strings.Contains(logs, tt.wantLog) {
				t.Errorf("logs lack %q:\n%s", tt.wantLog, logs)
			}
		})
	}
}

// newTestCallbackAdapter returns a callback-mode handler for cfg calling
// back to g, its completions running under the test's context; tests wait
// for them with a.wg.
func newTestCallbackAdapter(t *testing.T, g *fakeGateway, cfg config) *callbackAdapter {
	t.Helper()
	conn, err := grpc.NewClient(g.addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithPerRPCCredentials(bearerKey(cfg.AdapterKey)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	logger := slog.New(slog.DiscardHandler)
	a := newCallbackAdapter(t.Context(), cfg, newProvider(cfg, logger), callbackv1.NewAdapterCallbackServiceClient(conn), logger)
	t.Cleanup(a.wg.Wait)
	return a
}

// TestCallbackRepeatedExecute checks that an Execute repeated while its
// attempt is being completed starts nothing, and that one repeated after
// the completion completes it again identically — even with another input
// — which Capstan answers as a duplicate.
func TestCallbackRepeatedExecute(t *testing.T) {
	t.Parallel()
	gate := make(chan struct{})
	g := startFakeGateway(t, func(g *fakeGateway) { g.gate = gate })
	a := newTestCallbackAdapter(t, g, callbackConfig(g))
	p := payment.Payment{ID: "1", Recipient: "R", Amount: "10", Currency: "EUR"}
	req := execRequest("exec-1", 1, payment.EncodeJSON(p))
	ref := payment.Decide(p).Result.ProviderReference
	for range 2 { // the first completion waits for the gate: the second call finds it running
		resp, err := a.Execute(t.Context(), req)
		requireAccepted(t, resp, err, ref)
	}
	close(gate)
	a.wg.Wait()
	tok := req.GetCallbackToken()
	if n := g.countNow(methodComplete, tok); n != 1 {
		t.Fatalf("%d completions, want 1", n)
	}

	again := execRequest("exec-1", 1, payment.EncodeJSON(payment.Payment{ID: "1", Recipient: "R", Amount: "9999.99", Currency: "EUR"}))
	resp, err := a.Execute(t.Context(), again)
	requireAccepted(t, resp, err, ref)
	a.wg.Wait()
	if n := g.countNow(methodComplete, tok); n != 2 { // the fake fails the test if they differ
		t.Errorf("%d completions, want 2", n)
	}
	if n := g.countNow(methodProgress, tok); n != 2 {
		t.Errorf("%d progress reports, want 2", n)
	}
	want := stats{Calls: 3, Executions: 1, Resent: 1, Completions: 2, DuplicateAcks: 1}
	if s := a.p.snapshot(); s != want {
		t.Errorf("stats = %+v, want %+v", s, want)
	}
}

// TestCallbackForgetsOldAttempts checks that completed attempts are swept
// out of the table once they are attemptRetention old and the table grows,
// while attempts being completed stay.
func TestCallbackForgetsOldAttempts(t *testing.T) {
	t.Parallel()
	gate := make(chan struct{})
	g := startFakeGateway(t, nil)
	a := newTestCallbackAdapter(t, g, callbackConfig(g))
	now := time.Now()
	a.now = func() time.Time { return now } // only the test goroutine moves it, while nothing runs
	a.pruneAt = 3
	input := payment.EncodeJSON(payment.Payment{ID: "1", Recipient: "R", Amount: "10", Currency: "EUR"})
	for i := range 2 {
		if _, err := a.Execute(t.Context(), execRequest(fmt.Sprintf("old-%d", i), 1, input)); err != nil {
			t.Fatal(err)
		}
	}
	a.wg.Wait()
	g.mu.Lock()
	g.gate = gate // hold the next completion in its progress report
	g.mu.Unlock()
	if _, err := a.Execute(t.Context(), execRequest("running", 1, input)); err != nil {
		t.Fatal(err)
	}
	a.mu.Lock()
	now = now.Add(attemptRetention + time.Second)
	a.mu.Unlock()
	if _, err := a.Execute(t.Context(), execRequest("new", 1, input)); err != nil {
		t.Fatal(err)
	}
	a.mu.Lock()
	var kept []string
	for k := range a.attempts {
		kept = append(kept, k.executionID)
	}
	a.mu.Unlock()
	slices.Sort(kept)
	if want := []string{"new", "running"}; !slices.Equal(kept, want) {
		t.Errorf("attempts remembered: %q, want %q", kept, want)
	}
	close(gate)
}

// TestCallbackDuplicateCompletions checks --duplicate-completions: every
// completion is delivered twice, the copy answered as a duplicate.
func TestCallbackDuplicateCompletions(t *testing.T) {
	t.Parallel()
	g := startFakeGateway(t, nil)
	cfg := callbackConfig(g)
	cfg.DuplicateCompletions = true
	c, sp := startCallbackProvider(t, cfg)
	rows := readPayments(t)
	for i, p := range rows {
		resp, err := c.Execute(t.Context(), execRequest(fmt.Sprintf("exec-%d", i), 1, payment.EncodeJSON(p)))
		if err != nil || resp.GetAccepted() == nil {
			t.Fatalf("Execute: %v, %v", resp, err)
		}
	}
	g.waitFor(t, "two completions each", func() bool {
		for i := range rows {
			if g.count(methodComplete, execRequest(fmt.Sprintf("exec-%d", i), 1, nil).GetCallbackToken()) != 2 {
				return false
			}
		}
		return true
	})
	if err := sp.stop(); err != nil {
		t.Fatal(err)
	}
	n := int64(len(rows))
	if s, want := sp.final(t), (stats{Calls: n, Executions: len(rows), Completions: 2 * n, DuplicateAcks: n}); s != want {
		t.Errorf("stats = %+v, want %+v", s, want)
	}
}

// TestCallbackShutdown checks the grace period: a completion in flight at
// shutdown is delivered within it, and one that outlasts it is dropped
// without holding shutdown up.
func TestCallbackShutdown(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		latency   time.Duration
		grace     time.Duration
		maxStop   time.Duration
		want      stats
		completes int
	}{
		{name: "finished within the grace", latency: 300 * time.Millisecond, grace: 10 * time.Second, maxStop: 5 * time.Second,
			want: stats{Calls: 1, Executions: 1, Completions: 1}, completes: 1},
		{name: "dropped when the grace is over", latency: time.Minute, grace: 50 * time.Millisecond, maxStop: 5 * time.Second,
			want: stats{Calls: 1, Executions: 1, Dropped: 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			g := startFakeGateway(t, nil)
			cfg := callbackConfig(g)
			cfg.LatencyMin, cfg.LatencyMax, cfg.drainGrace = tt.latency, tt.latency, tt.grace
			c, sp := startCallbackProvider(t, cfg)
			req := execRequest("exec-1", 1, payment.EncodeJSON(payment.Payment{ID: "1", Recipient: "R", Amount: "10", Currency: "EUR"}))
			if _, err := c.Execute(t.Context(), req); err != nil {
				t.Fatal(err)
			}
			// The progress report says the completion is in flight.
			g.waitFor(t, "the progress report", func() bool { return g.count(methodProgress, req.GetCallbackToken()) == 1 })
			start := time.Now()
			if err := sp.stop(); err != nil {
				t.Fatal(err)
			}
			if d := time.Since(start); d > tt.maxStop {
				t.Errorf("stop took %v, want at most %v", d, tt.maxStop)
			}
			if n := g.admittedCount(); n != tt.completes {
				t.Errorf("%d completions admitted, want %d", n, tt.completes)
			}
			if s := sp.final(t); s != tt.want {
				t.Errorf("stats = %+v, want %+v", s, tt.want)
			}
		})
	}
}

// TestCallbackExecuteRefuses checks the requests that cannot be completed
// later: they are refused with a terminal code and nothing is called back.
func TestCallbackExecuteRefuses(t *testing.T) {
	t.Parallel()
	g := startFakeGateway(t, nil)
	c, sp := startCallbackProvider(t, callbackConfig(g))
	input := payment.EncodeJSON(payment.Payment{ID: "1", Recipient: "R", Amount: "10", Currency: "EUR"})
	tests := []struct {
		name string
		req  *adapterv1.ExecuteRequest
		want codes.Code
	}{
		{name: "no execution id", req: execRequest("", 1, input), want: codes.InvalidArgument},
		{name: "attempt 0", req: execRequest("exec-1", 0, input), want: codes.InvalidArgument},
		{name: "no callback token", req: &adapterv1.ExecuteRequest{ExecutionId: "exec-2", Attempt: 1, Input: input},
			want: codes.FailedPrecondition},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := c.Execute(t.Context(), tt.req)
			if status.Code(err) != tt.want {
				t.Errorf("Execute: %v, want %v", err, tt.want)
			}
		})
	}
	if err := sp.stop(); err != nil {
		t.Fatal(err)
	}
	if calls := g.snapshot(); len(calls) != 0 {
		t.Errorf("refused requests were called back: %v", calls)
	}
}
