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

// provider is the mock payment provider: an adapter.Handler (direct mode),
// the partner of the await transports (webhook and kafka modes) and the
// decisions behind callbackAdapter (callback mode). It answers per
// payment.Decide, after a random latency, except for a seeded,
// deterministic fraction of attempts that fail retryably.
type provider struct {
	latencyMin, latencyMax time.Duration
	retryableFraction      float64
	seed                   uint64
	duplicateCompletions   bool
	logger                 *slog.Logger

	mu    sync.Mutex
	calls int64
	perID map[string]int
	// await transports: interactions by id (see admitInteraction) and
	// counters of what happened to them.
	interactions                                          map[string]*interactionEntry
	pruneAt                                               int
	resent, completions, duplicateAcks, dropped, renewals int64
}

// newProvider returns a provider for cfg that logs to logger.
func newProvider(cfg config, logger *slog.Logger) *provider {
	return &provider{
		latencyMin:           cfg.LatencyMin,
		latencyMax:           cfg.LatencyMax,
		retryableFraction:    cfg.RetryableFraction,
		seed:                 cfg.Seed,
		duplicateCompletions: cfg.DuplicateCompletions,
		logger:               logger,
		perID:                make(map[string]int),
		interactions:         make(map[string]*interactionEntry),
		pruneAt:              minPruneAt,
	}
}

var _ adapter.Handler = (*provider)(nil)

// Execute performs one attempt. It never logs the input or the output.
func (p *provider) Execute(ctx context.Context, req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
	p.countCall(req.GetExecutionId())
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
	v := p.decideAttempt(req)
	if !v.succeeded {
		return adapter.Failed(v.class, v.message, v.retryable)
	}
	return adapter.Succeeded(v.output, "application/json")
}

// decideAttempt decides an attempt (direct and callback modes): the
// retryable draw keyed by execution id and attempt, then the input.
func (p *provider) decideAttempt(req *adapterv1.ExecuteRequest) verdict {
	return decideInput(failRetryably(p.seed, req.GetExecutionId(), req.GetAttempt(), p.retryableFraction),
		req.GetContentType(), req.GetInput())
}

// verdict is a decided attempt or interaction, independent of how it is
// answered (gRPC response or interaction completion).
type verdict struct {
	succeeded bool
	output    []byte // the JSON result when succeeded
	reference string // the provider reference when succeeded
	class     string
	message   string
	retryable bool
}

// decideInput decides an input of contentType: a retryable
// provider.unavailable when failRetryable, else input.invalid for what is
// not a JSON payment, else per payment.Decide.
func decideInput(failRetryable bool, contentType string, input []byte) verdict {
	if failRetryable {
		return verdict{class: payment.ClassProviderUnavailable, message: "provider temporarily unavailable, try again", retryable: true}
	}
	if contentType != "" {
		if mt, _, err := mime.ParseMediaType(contentType); err != nil || mt != "application/json" {
			return verdict{class: payment.ClassInputInvalid, message: "content type must be application/json"}
		}
	}
	pay, err := payment.DecodeJSON(input)
	if err != nil {
		return verdict{class: payment.ClassInputInvalid, message: "input is not a JSON payment object"}
	}
	o := payment.Decide(pay)
	if !o.Succeeded {
		return verdict{class: o.FailureClass, message: o.FailureMessage, retryable: o.Retryable}
	}
	return verdict{succeeded: true, output: o.Result.JSON(), reference: o.Result.ProviderReference}
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
	var buf [4]byte
	binary.BigEndian.PutUint32(buf[:], uint32(attempt))
	return drawBelow(fraction, seed, []byte(executionID), buf[:])
}

// failInteractionRetryably is failRetryably for the await transports, whose
// requests carry no attempt number: the draw is keyed by the execution and
// the interaction, sha256(seed | executionID | "/" | interactionID). Each
// attempt of an execution opens a new interaction, so attempts stay
// independent, and a resent request draws the same.
func failInteractionRetryably(seed uint64, executionID, interactionID string, fraction float64) bool {
	return drawBelow(fraction, seed, []byte(executionID), []byte("/"), []byte(interactionID))
}

// drawBelow reports whether sha256(seed | parts...), its first 8 bytes read
// as a fraction of 2^64, is below fraction; fractions <= 0 and >= 1 never
// and always are.
func drawBelow(fraction float64, seed uint64, parts ...[]byte) bool {
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
	for _, b := range parts {
		h.Write(b)
	}
	sum := h.Sum(nil)
	u := float64(binary.BigEndian.Uint64(sum[:8])>>11) / (1 << 53)
	return u < fraction
}

// stats is the body of GET /stats. The await-transport counters are
// omitted while zero, so direct mode answers {"calls":N,"executions":M}.
type stats struct {
	// Calls is the number of Execute calls (direct and callback modes) or
	// interaction requests received, resends included (webhook and kafka
	// modes).
	Calls int64 `json:"calls"`
	// Executions is the number of distinct execution ids seen.
	Executions int `json:"executions"`
	// Interactions is the number of interactions remembered (distinct
	// interaction ids whose deadline has not passed).
	Interactions int `json:"interactions,omitempty"`
	// Resent counts requests ignored because their interaction was already
	// being answered or answered, and Execute calls answered without new
	// work because their attempt was already being completed (callback).
	Resent int64 `json:"resent,omitempty"`
	// Completions counts completions delivered: acknowledged by the
	// completion endpoint (webhook) or CompleteExecution (callback), or
	// produced (kafka), copies sent by --duplicate-completions included.
	Completions int64 `json:"completions,omitempty"`
	// DuplicateAcks counts webhook and callback completions that Capstan
	// answered as duplicates of one it had already admitted.
	DuplicateAcks int64 `json:"duplicate_acks,omitempty"`
	// Dropped counts completions given up on: refused by Capstan, past the
	// interaction's deadline, interrupted by shutdown, or (callback) of an
	// attempt whose lease was lost.
	Dropped int64 `json:"dropped,omitempty"`
	// Renewals counts callback leases renewed (callback mode).
	Renewals int64 `json:"renewals,omitempty"`
}

// snapshot returns the current counts.
func (p *provider) snapshot() stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return stats{Calls: p.calls, Executions: len(p.perID), Interactions: len(p.interactions),
		Resent: p.resent, Completions: p.completions, DuplicateAcks: p.duplicateAcks, Dropped: p.dropped,
		Renewals: p.renewals}
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
