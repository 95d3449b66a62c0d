package main

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"log/slog"
	"math/rand/v2"
	"mime"
	"net/http"
	"sync"
	"time"

	"google.golang.org/grpc/status"

	"github.com/capstan-dev/capstan/examples/csv-payments/payment"
	"github.com/capstan-dev/capstan/pkg/adapter"
	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
)

// provider is the mock payment provider: an adapter.Handler that answers
// per payment.Decide, after a random latency, except for a seeded,
// deterministic fraction of attempts that fail retryably.
type provider struct {
	latencyMin, latencyMax time.Duration
	retryableFraction      float64
	seed                   uint64
	logger                 *slog.Logger

	mu    sync.Mutex
	calls int64
	perID map[string]int
}

// newProvider returns a provider for cfg that logs to logger.
func newProvider(cfg config, logger *slog.Logger) *provider {
	return &provider{
		latencyMin:        cfg.LatencyMin,
		latencyMax:        cfg.LatencyMax,
		retryableFraction: cfg.RetryableFraction,
		seed:              cfg.Seed,
		logger:            logger,
		perID:             make(map[string]int),
	}
}

var _ adapter.Handler = (*provider)(nil)

// Execute performs one attempt. It never logs the input or the output.
func (p *provider) Execute(ctx context.Context, req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
	p.mu.Lock()
	p.calls++
	p.perID[req.GetExecutionId()]++
	p.mu.Unlock()

	if err := p.sleep(ctx); err != nil {
		return nil, status.FromContextError(err).Err()
	}

	resp := p.decide(req)
	if f := resp.GetFailure(); f != nil {
		p.logger.DebugContext(ctx, "payment failed",
			slog.String("execution_id", req.GetExecutionId()),
			slog.Int("attempt", int(req.GetAttempt())),
			slog.String("class", f.GetClass()),
			slog.Bool("retryable", f.GetRetryable()))
	} else {
		p.logger.DebugContext(ctx, "payment sent",
			slog.String("execution_id", req.GetExecutionId()),
			slog.Int("attempt", int(req.GetAttempt())))
	}
	return resp, nil
}

// decide returns the attempt's outcome without latency.
func (p *provider) decide(req *adapterv1.ExecuteRequest) *adapterv1.ExecuteResponse {
	if failRetryably(p.seed, req.GetExecutionId(), req.GetAttempt(), p.retryableFraction) {
		return adapter.Failed(payment.ClassProviderUnavailable, "provider temporarily unavailable, try again", true)
	}
	if ct := req.GetContentType(); ct != "" {
		if mt, _, err := mime.ParseMediaType(ct); err != nil || mt != "application/json" {
			return adapter.Failed(payment.ClassInputInvalid, "content type must be application/json", false)
		}
	}
	pay, err := payment.DecodeJSON(req.GetInput())
	if err != nil {
		return adapter.Failed(payment.ClassInputInvalid, "input is not a JSON payment object", false)
	}
	o := payment.Decide(pay)
	if !o.Succeeded {
		return adapter.Failed(o.FailureClass, o.FailureMessage, o.Retryable)
	}
	return adapter.Succeeded(o.Result.JSON(), "application/json")
}

// sleep waits a uniformly random duration in [latencyMin, latencyMax], or
// until ctx ends (then it returns ctx's error).
func (p *provider) sleep(ctx context.Context) error {
	d := p.latencyMin
	if span := p.latencyMax - p.latencyMin; span > 0 {
		d += rand.N(span + 1)
	}
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// failRetryably decides, deterministically, whether attempt of executionID
// fails with provider.unavailable: the first 8 bytes of
// sha256(seed | executionID | attempt) read as a fraction of 2^64 are below
// fraction. Attempts are independent, so attempt 1 may fail and attempt 2
// usually succeeds.
func failRetryably(seed uint64, executionID string, attempt int32, fraction float64) bool {
	if fraction <= 0 {
		return false
	}
	if fraction >= 1 {
		return true
	}
	h := sha256.New()
	var buf [8]byte
	binary.BigEndian.PutUint64(buf[:], seed)
	h.Write(buf[:])
	h.Write([]byte(executionID))
	binary.BigEndian.PutUint32(buf[:4], uint32(attempt))
	h.Write(buf[:4])
	sum := h.Sum(nil)
	u := float64(binary.BigEndian.Uint64(sum[:8])>>11) / (1 << 53)
	return u < fraction
}

// stats is the body of GET /stats.
type stats struct {
	// Calls is the number of Execute calls.
	Calls int64 `json:"calls"`
	// Executions is the number of distinct execution ids seen.
	Executions int `json:"executions"`
}

// snapshot returns the current counts.
func (p *provider) snapshot() stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return stats{Calls: p.calls, Executions: len(p.perID)}
}

// adminHandler serves GET /stats as JSON {"calls":N,"executions":M}.
func (p *provider) adminHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /stats", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		if err := json.NewEncoder(w).Encode(p.snapshot()); err != nil {
			p.logger.WarnContext(r.Context(), "write stats", slog.Any("error", err))
		}
	})
	return mux
}
