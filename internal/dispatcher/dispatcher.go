// Package dispatcher implements cmd/dispatcher (SYSTEM §4 hop 2): it claims
// due dispatch records with an expiring claim (FOR UPDATE SKIP LOCKED, so
// many replicas are safe), publishes them to the execution topic keyed by
// execution id, and deletes the published rows.
//
// # Failure modes
//
//   - A failed publish leaves the row claimed; it is published again after
//     the claim expires.
//   - Publish then a failed delete (or a crash between them) publishes the
//     same dispatch twice; the consumer's guarded attempt start absorbs it.
//   - A lost nudge only delays a record until the next scheduled pass, which
//     comes at most PassInterval later, or earlier when a record falls due.
package dispatcher

import (
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/daemon"
	"github.com/capstan-dev/capstan/internal/kafka"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/telemetry"
	dispatchv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/dispatch/v1"
)

// Dispatcher moves due dispatch records onto the execution topic.
type Dispatcher struct {
	store  *pgstore.Store
	client *kgo.Client
	cfg    config.Dispatcher
	topic  string
	owner  string
	logger *slog.Logger
	wake   chan struct{}

	published atomic.Int64
	passes    atomic.Int64
	lastPass  atomic.Int64 // unix nanos of the last successful pass: the heartbeat

	mp metric.MeterProvider
	m  metrics
}

// New returns a dispatcher that publishes to topic with client.
func New(store *pgstore.Store, client *kgo.Client, cfg config.Dispatcher, topic, owner string, logger *slog.Logger, opts ...Option) *Dispatcher {
	d := &Dispatcher{store: store, client: client, cfg: cfg, topic: topic, owner: owner, logger: logger,
		wake: make(chan struct{}, 1)}
	for _, o := range opts {
		o(d)
	}
	if err := d.initMetrics(); err != nil {
		logger.Warn("metrics not fully registered", "error", err)
	}
	return d
}

// Nudge asks for a pass now; nudges made while one is pending coalesce.
func (d *Dispatcher) Nudge() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// Stats are the dispatcher's counters.
type Stats struct {
	Published int64
	Passes    int64
	LastPass  time.Time // zero before the first successful pass
}

// Stats returns the counters.
func (d *Dispatcher) Stats() Stats {
	s := Stats{Published: d.published.Load(), Passes: d.passes.Load()}
	if n := d.lastPass.Load(); n > 0 {
		s.LastPass = time.Unix(0, n)
	}
	return s
}

// Run passes until ctx ends. Database and Kafka errors are logged and ridden
// out with a capped backoff; Run returns only when ctx ends.
func (d *Dispatcher) Run(ctx context.Context) error {
	failures := 0
	for ctx.Err() == nil {
		// A pass runs under a detached context, bounded by passTimeout: a
		// SIGTERM that lands between the claim and the delete must not
		// leave claimed records unpublished until their claims expire.
		pctx, pcancel := daemon.Detach(ctx, passDrain, passTimeout)
		n, err := d.pass(pctx)
		pcancel()
		if err != nil {
			if ctx.Err() != nil {
				break
			}
			failures++
			wait := min(time.Duration(failures)*200*time.Millisecond, 5*time.Second)
			d.logger.Warn("dispatch pass failed", "error", err, "retry_in", wait)
			d.sleep(ctx, wait, false)
			continue
		}
		failures = 0
		if n >= d.cfg.BatchSize {
			continue // more may be due now
		}
		d.sleep(ctx, d.untilNextDue(ctx), true)
	}
	return nil
}

// untilNextDue returns how long to wait for the next record to fall due,
// at most PassInterval.
func (d *Dispatcher) untilNextDue(ctx context.Context) time.Duration {
	due, now, err := d.store.DispatchNextDue(ctx)
	if err != nil || due.IsZero() {
		return d.cfg.PassInterval
	}
	wait := due.Sub(now) - d.cfg.Lookahead
	return max(min(wait, d.cfg.PassInterval), 0)
}

func (d *Dispatcher) sleep(ctx context.Context, wait time.Duration, wakeable bool) {
	if wait <= 0 {
		return
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	var wake <-chan struct{}
	if wakeable {
		wake = d.wake
	}
	select {
	case <-ctx.Done():
	case <-t.C:
	case <-wake:
	}
}

// tracer names the dispatcher's spans (the global tracer provider).
var tracer = otel.Tracer("capstan/dispatcher")

// pass claims one batch, publishes it and deletes what was published. It
// returns how many records it claimed. Each record is published under a
// "dispatch" span, child of the trace context stored with the record, and
// that span's context travels in the Kafka record's headers.
func (d *Dispatcher) pass(ctx context.Context) (int, error) {
	recs, token, err := d.store.DispatchClaim(ctx, pgstore.DispatchClaimParams{
		Owner: d.owner, Limit: d.cfg.BatchSize, ClaimFor: d.cfg.ClaimTTL, Lookahead: d.cfg.Lookahead,
	})
	if err != nil {
		return 0, err
	}
	d.passes.Add(1)
	d.lastPass.Store(time.Now().UnixNano())
	if len(recs) == 0 {
		return 0, nil
	}
	krecs := make([]*kgo.Record, 0, len(recs))
	spans := make([]trace.Span, 0, len(recs))
	defer func() {
		for _, sp := range spans {
			sp.End() // no-op for spans already ended with their result
		}
	}()
	for _, r := range recs {
		v, err := proto.Marshal(&dispatchv1.ExecutionDispatch{
			DispatchId: r.ID.String(), ExecutionId: r.ExecutionID.String(),
			Attempt: int32(r.Attempt), DueAt: timestamppb.New(r.DueAt),
		})
		if err != nil {
			return len(recs), err
		}
		kr := &kgo.Record{Topic: d.topic, Key: []byte(r.ExecutionID.String()), Value: v}
		sctx, span := tracer.Start(telemetry.ContextWithTraceparent(ctx, r.TraceContext), "dispatch",
			trace.WithSpanKind(trace.SpanKindProducer),
			trace.WithAttributes(attribute.String("execution_id", r.ExecutionID.String()),
				attribute.Int("attempt", r.Attempt), attribute.String("messaging.destination.name", d.topic)))
		otel.GetTextMapPropagator().Inject(sctx, kafka.HeaderCarrier{Record: kr})
		krecs = append(krecs, kr)
		spans = append(spans, span)
	}
	spanOf := make(map[*kgo.Record]trace.Span, len(recs))
	for i, kr := range krecs {
		spanOf[kr] = spans[i]
	}
	idOf := make(map[*kgo.Record]uuid.UUID, len(recs))
	dueOf := make(map[*kgo.Record]time.Time, len(recs))
	for i, kr := range krecs {
		idOf[kr] = recs[i].ID
		dueOf[kr] = recs[i].DueAt
	}
	// ProduceSync returns results in completion order, not send order: map
	// each result back through its record, so only what was published is
	// deleted.
	results := d.client.ProduceSync(ctx, krecs...)
	published := make([]uuid.UUID, 0, len(recs))
	var firstErr error
	for _, res := range results {
		if sp := spanOf[res.Record]; sp != nil {
			if res.Err != nil {
				sp.RecordError(res.Err)
				sp.SetStatus(codes.Error, "publish failed")
			}
			sp.End()
		}
		if res.Err != nil {
			if firstErr == nil {
				firstErr = res.Err
			}
			continue
		}
		if id, ok := idOf[res.Record]; ok {
			published = append(published, id)
			d.m.lag.Record(ctx, max(time.Since(dueOf[res.Record]), 0).Seconds())
		}
	}
	if len(published) > 0 {
		// Delete under a detached context: the records are on the topic,
		// and deleting them now avoids publishing them again after the claim.
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		deleted, err := d.store.DispatchDelete(dctx, published, token)
		cancel()
		d.published.Add(int64(len(published)))
		d.m.dispatched.Add(ctx, int64(len(published)))
		if err != nil {
			return len(recs), errors.Join(err, firstErr)
		}
		if deleted < int64(len(published)) {
			d.logger.Info("dispatch claim expired before delete; records may be published twice",
				"published", len(published), "deleted", deleted)
		}
	}
	if firstErr != nil {
		return len(recs), firstErr
	}
	return len(recs), nil
}

// passTimeout bounds one pass (claim, publish, delete), which runs detached
// from the shutdown signal so that it finishes what it claimed; passDrain
// is how long it may go on after the signal (inside daemon.Grace).
const (
	passTimeout = 30 * time.Second
	passDrain   = 5 * time.Second
)
