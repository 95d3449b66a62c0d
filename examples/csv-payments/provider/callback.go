package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v5"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/capstan-dev/capstan/pkg/adapter"
	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
	callbackv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/callback/v1"
)

// Callback mode limits, timing and wording.
const (
	// maxAdapterKeyBytes is the longest adapter key the gateway accepts.
	maxAdapterKeyBytes = 512
	// maxReferenceBytes bounds Accepted.external_reference.
	maxReferenceBytes = 256
	// callTimeout bounds one call to AdapterCallbackService.
	callTimeout = 10 * time.Second
	// renewRetry is how soon a renewal that failed transiently is tried
	// again (at most; --renew-every when that is shorter).
	renewRetry = 250 * time.Millisecond
	// minRenewEvery floors the renewal rhythm derived from the lease.
	minRenewEvery = 10 * time.Millisecond
	// attemptRetention is how long a completed attempt is remembered, so
	// that an Execute repeated for it completes it identically.
	attemptRetention = 10 * time.Minute
	// progressPercent and progressMessage are the one progress report of
	// an attempt, sent as soon as it is accepted.
	progressPercent = 50
	progressMessage = "submitted to the bank"
)

// errLeaseLost is the cause of an attempt abandoned because Capstan
// refused its lease renewal or progress report (FAILED_PRECONDITION): the
// attempt was superseded or the execution settled, so a completion would
// be refused too.
var errLeaseLost = errors.New("lease lost: the attempt was superseded or the execution settled")

// bearerKey is the adapter's key as per-RPC credentials
// ("authorization: Bearer <key>"). It is sent over plaintext connections
// too: the example talks to a gateway on loopback; a deployment would dial
// with TLS. String redacts it.
type bearerKey string

// GetRequestMetadata implements credentials.PerRPCCredentials.
func (k bearerKey) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(k)}, nil
}

// RequireTransportSecurity implements credentials.PerRPCCredentials.
func (bearerKey) RequireTransportSecurity() bool { return false }

// String never reveals the key.
func (bearerKey) String() string { return "[redacted]" }

// attemptKey names one attempt of an execution.
type attemptKey struct {
	executionID string
	attempt     int32
}

// attemptEntry is what callbackAdapter remembers of an attempt: its
// decision, made once, and whether a completion is running for it.
type attemptEntry struct {
	v        verdict
	running  bool
	finished time.Time // when the last completion run ended
}

// attemptCalls serialises an attempt's RenewLease and CompleteExecution
// calls, so that the lease is renewed between tries of the completion but
// never after Capstan admitted it.
type attemptCalls struct {
	mu        sync.Mutex
	completed bool
}

// callbackAdapter is the provider in callback mode: an adapter.Handler
// whose Execute answers "accepted" at once and completes the attempt in
// the background through the gateway's AdapterCallbackService.
type callbackAdapter struct {
	p          *provider
	client     callbackv1.AdapterCallbackServiceClient
	renewEvery time.Duration
	logger     *slog.Logger
	now        func() time.Time
	// work outlives the Execute calls: completions run under it and it
	// ends a grace period after shutdown starts.
	work context.Context
	wg   sync.WaitGroup

	mu       sync.Mutex
	attempts map[attemptKey]*attemptEntry
	pruneAt  int
}

var _ adapter.Handler = (*callbackAdapter)(nil)

// newCallbackAdapter returns the callback-mode handler for cfg, deciding
// with p and calling back through client; its completions run under work.
func newCallbackAdapter(work context.Context, cfg config, p *provider, client callbackv1.AdapterCallbackServiceClient, logger *slog.Logger) *callbackAdapter {
	return &callbackAdapter{p: p, client: client, renewEvery: cfg.RenewEvery, logger: logger, now: time.Now, work: work,
		attempts: make(map[attemptKey]*attemptEntry), pruneAt: minPruneAt}
}

// serveCallback serves AdapterService on lis in callback mode until ctx
// ends, then stops accepting calls and lets completions in flight finish
// for up to cfg.grace(). It closes lis.
func serveCallback(ctx context.Context, cfg config, p *provider, lis net.Listener, logger *slog.Logger) error {
	conn, err := grpc.NewClient(cfg.Gateway, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithPerRPCCredentials(bearerKey(cfg.AdapterKey)))
	if err != nil {
		_ = lis.Close()
		return fmt.Errorf("provider: gateway client for %s: %w", cfg.Gateway, err)
	}
	defer conn.Close()
	work, cancelWork := drainContext(ctx, cfg.grace())
	defer cancelWork()
	a := newCallbackAdapter(work, cfg, p, callbackv1.NewAdapterCallbackServiceClient(conn), logger)
	logger.InfoContext(ctx, "callback mode: completing through the gateway", slog.String("gateway", cfg.Gateway),
		slog.Duration("renew_every", cfg.RenewEvery))
	if err = adapter.Serve(ctx, lis, a, logger); err != nil {
		cancelWork() // the server failed: do not hold the caller up
	}
	a.wg.Wait() // bounded by work, which ends cfg.grace() after ctx
	return err
}

// Execute validates the attempt, answers "accepted" with the payment's
// provider reference (the execution id when the payment fails) and starts
// completing it in the background. An Execute repeated for an attempt
// that is being completed starts nothing; one repeated after its
// completion completes it again, identically (Capstan answers duplicate).
// It never logs the input, the output or the callback token.
func (a *callbackAdapter) Execute(ctx context.Context, req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
	a.p.countCall(req.GetExecutionId())
	if err := checkExecute(req); err != nil {
		a.logger.WarnContext(ctx, "execute refused", slog.String("execution_id", req.GetExecutionId()),
			slog.Int("attempt", int(req.GetAttempt())), slog.Any("error", err))
		return nil, err
	}
	key := attemptKey{executionID: req.GetExecutionId(), attempt: req.GetAttempt()}
	v, start := a.admit(key, req)
	if start {
		tok := req.GetCallbackToken()
		a.wg.Go(func() { a.complete(key, tok, v) })
	} else {
		a.p.countResent()
		a.logger.DebugContext(ctx, "repeated execute: attempt already being completed",
			slog.String("execution_id", key.executionID), slog.Int("attempt", int(key.attempt)))
	}
	ref := v.reference
	if ref == "" {
		ref = key.executionID
	}
	if len(ref) > maxReferenceBytes {
		ref = ""
	}
	return &adapterv1.ExecuteResponse{Outcome: &adapterv1.ExecuteResponse_Accepted{
		Accepted: &adapterv1.Accepted{ExternalReference: ref},
	}}, nil
}

// checkExecute returns the gRPC error for a request that cannot be
// completed later: INVALID_ARGUMENT without an execution id or attempt,
// FAILED_PRECONDITION without a callback token (Capstan issues none when
// it has no callback_secret). Both are terminal for Capstan.
func checkExecute(req *adapterv1.ExecuteRequest) error {
	switch {
	case req.GetExecutionId() == "":
		return status.Error(codes.InvalidArgument, "execution_id: required")
	case req.GetAttempt() < 1:
		return status.Errorf(codes.InvalidArgument, "attempt %d: want >= 1", req.GetAttempt())
	case req.GetCallbackToken() == "":
		return status.Error(codes.FailedPrecondition,
			"callback_token: required in callback mode (configure callback_secret on Capstan)")
	}
	return nil
}

// admit returns the attempt's decision — made now for a new attempt,
// remembered for a known one — and whether a completion must start: false
// while one is running for it. Attempts completed more than
// attemptRetention ago are swept out as the table grows.
func (a *callbackAdapter) admit(key attemptKey, req *adapterv1.ExecuteRequest) (verdict, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if e, ok := a.attempts[key]; ok {
		if e.running {
			return e.v, false
		}
		e.running = true
		return e.v, true
	}
	if len(a.attempts) >= a.pruneAt {
		cutoff := a.now().Add(-attemptRetention)
		for k, e := range a.attempts {
			if !e.running && e.finished.Before(cutoff) {
				delete(a.attempts, k)
			}
		}
		a.pruneAt = max(minPruneAt, 2*len(a.attempts))
	}
	e := &attemptEntry{v: a.p.decideAttempt(req), running: true}
	a.attempts[key] = e
	return e.v, true
}

// finish records that the completion run of key ended.
func (a *callbackAdapter) finish(key attemptKey) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if e, ok := a.attempts[key]; ok {
		e.running, e.finished = false, a.now()
	}
}

// complete finishes an accepted attempt under a.work: it reports progress,
// holds the work for the simulated latency while renewing the lease, then
// delivers the completion of v — twice with --duplicate-completions. An
// attempt whose lease is lost, or that shutdown interrupts, is dropped:
// Capstan retries it once its lease expires.
func (a *callbackAdapter) complete(key attemptKey, tok string, v verdict) {
	defer a.finish(key)
	ctx := a.work
	log := a.logger.With(slog.String("execution_id", key.executionID), slog.Int("attempt", int(key.attempt)))

	// hold is the bank's work; it ends early when the lease is lost.
	hold, abandon := context.WithCancelCause(ctx)
	defer abandon(nil)
	calls := &attemptCalls{}
	renewCtx, stopRenew := context.WithCancel(ctx)
	var renewer sync.WaitGroup
	renewer.Go(func() { a.keepLease(renewCtx, tok, calls, log, func() { abandon(errLeaseLost) }) })
	defer func() { stopRenew(); renewer.Wait() }()

	if err := a.reportProgress(hold, tok); err != nil {
		if status.Code(err) == codes.FailedPrecondition {
			abandon(errLeaseLost)
		} else {
			log.WarnContext(ctx, "progress not reported", slog.Any("error", err))
		}
	}
	if err := a.p.sleep(hold); err != nil {
		a.p.countDropped()
		log.WarnContext(ctx, "attempt abandoned before completion", slog.Any("error", context.Cause(hold)))
		return
	}
	if v.succeeded {
		log.DebugContext(ctx, "payment sent")
	} else {
		log.DebugContext(ctx, "payment failed", slog.String("class", v.class), slog.Bool("retryable", v.retryable))
	}
	copies := 1
	if a.p.duplicateCompletions {
		copies = 2
	}
	req := completionRequest(tok, v)
	for range copies {
		dup, err := a.completeOnce(ctx, req, calls, log)
		if err != nil {
			a.p.countDropped()
			if status.Code(err) == codes.FailedPrecondition {
				log.InfoContext(ctx, "completion refused as final: the attempt was superseded or the execution settled",
					slog.Any("error", err))
			} else {
				log.WarnContext(ctx, "completion not delivered", slog.Any("error", err))
			}
			return
		}
		a.p.countCompletion(dup)
	}
}

// completionRequest returns the CompleteExecution request of v: the
// result or failure direct mode would have answered.
func completionRequest(tok string, v verdict) *callbackv1.CompleteExecutionRequest {
	req := &callbackv1.CompleteExecutionRequest{CallbackToken: tok}
	if v.succeeded {
		req.Outcome = &callbackv1.CompleteExecutionRequest_Result{
			Result: &adapterv1.Result{Output: v.output, ContentType: "application/json"}}
	} else {
		req.Outcome = &callbackv1.CompleteExecutionRequest_Failure{
			Failure: &adapterv1.Failure{Class: v.class, Message: v.message, Retryable: v.retryable}}
	}
	return req
}

// completeOnce delivers one completion, retrying UNAVAILABLE and
// DEADLINE_EXCEEDED with backoff until ctx ends or
// backoff.DefaultMaxElapsedTime passes (by then Capstan has long expired
// the lease). Other codes are final. It reports whether Capstan answered
// that it had admitted an identical completion before.
func (a *callbackAdapter) completeOnce(ctx context.Context, req *callbackv1.CompleteExecutionRequest, calls *attemptCalls, log *slog.Logger) (bool, error) {
	resp, err := backoff.Retry(ctx, func() (*callbackv1.CompleteExecutionResponse, error) {
		cctx, cancel := context.WithTimeout(ctx, callTimeout)
		defer cancel()
		calls.mu.Lock()
		resp, err := a.client.CompleteExecution(cctx, req)
		calls.completed = calls.completed || err == nil
		calls.mu.Unlock()
		switch status.Code(err) {
		case codes.OK:
			return resp, nil
		case codes.Unavailable, codes.DeadlineExceeded:
			return nil, err
		}
		return nil, backoff.Permanent(err)
	}, backoff.WithBackOff(newBackOff()),
		backoff.WithNotify(func(err error, next time.Duration) {
			log.InfoContext(ctx, "CompleteExecution failed; retrying", slog.Any("error", err), slog.Duration("retry_in", next))
		}))
	if err != nil {
		return false, fmt.Errorf("complete execution: %w", err)
	}
	return resp.GetDuplicate(), nil
}

// reportProgress reports the attempt's one progress step.
func (a *callbackAdapter) reportProgress(ctx context.Context, tok string) error {
	cctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	_, err := a.client.ReportProgress(cctx, &callbackv1.ReportProgressRequest{
		CallbackToken: tok, Percent: progressPercent, Message: progressMessage})
	if err != nil {
		return fmt.Errorf("report progress: %w", err)
	}
	return nil
}

// keepLease renews the attempt's lease every a.renewEvery — or a third of
// the remaining lease a renewal reports, when that is sooner — until ctx
// ends or the completion is admitted. A refused renewal
// (FAILED_PRECONDITION) calls lost and stops; other failures are tried
// again soon.
func (a *callbackAdapter) keepLease(ctx context.Context, tok string, calls *attemptCalls, log *slog.Logger, lost func()) {
	t := time.NewTimer(a.renewEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		calls.mu.Lock()
		if calls.completed {
			calls.mu.Unlock()
			return
		}
		cctx, cancel := context.WithTimeout(ctx, callTimeout)
		resp, err := a.client.RenewLease(cctx, &callbackv1.RenewLeaseRequest{CallbackToken: tok})
		cancel()
		calls.mu.Unlock()
		next := a.renewEvery
		switch {
		case err == nil:
			a.p.countRenewal()
			if exp := resp.GetLeaseExpiresAt(); exp.IsValid() {
				if third := exp.AsTime().Sub(a.now()) / 3; third < next {
					next = max(third, minRenewEvery)
				}
			}
			log.DebugContext(ctx, "lease renewed", slog.Duration("next_in", next))
		case ctx.Err() != nil:
			return
		case status.Code(err) == codes.FailedPrecondition:
			log.InfoContext(ctx, "lease renewal refused; attempt abandoned", slog.Any("error", err))
			lost()
			return
		default:
			next = min(next, renewRetry)
			log.WarnContext(ctx, "lease renewal failed; will try again", slog.Any("error", err), slog.Duration("retry_in", next))
		}
		t.Reset(next)
	}
}

// countCall counts an Execute call (direct and callback modes).
func (p *provider) countCall(executionID string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	p.perID[executionID]++
}

// countResent counts an Execute answered without new work.
func (p *provider) countResent() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.resent++
}

// countDropped counts a completion given up on.
func (p *provider) countDropped() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.dropped++
}

// countRenewal counts a renewed lease.
func (p *provider) countRenewal() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.renewals++
}
