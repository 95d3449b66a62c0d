package router

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/daemon"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
)

// Backoff bounds for riding out database errors.
const (
	// claimBackoffMin and claimBackoffMax bound the wait after a failed
	// claim (exponential, ±50 % randomised).
	claimBackoffMin = 250 * time.Millisecond
	claimBackoffMax = 30 * time.Second
	// recordBackoffMin and recordBackoffMax bound the wait between tries
	// to record one attempt.
	recordBackoffMin = 100 * time.Millisecond
	recordBackoffMax = 5 * time.Second
	// recordMinWindow is the least time given to recording an attempt,
	// even when the local estimate of the claim's expiry has passed (the
	// database clock decides).
	recordMinWindow = 5 * time.Second
	// sealInterval is how often plaintext signing secrets are looked for
	// and encrypted when a secret key is configured.
	sealInterval = time.Minute
)

// Router delivers completion events to the applications' consumers. Create
// it with New; it is safe for concurrent use, but Run must not run twice at
// once.
type Router struct {
	store    *pgstore.Store
	cfg      config.Router
	logger   *slog.Logger
	client   *http.Client
	kafka    KafkaProducer
	grpc     grpcConns
	box      *pgstore.SecretBox
	meter    metric.MeterProvider
	metrics  *metrics
	now      func() time.Time
	rand     func() float64
	workerID string
	// sem holds one token per delivery in flight, shared across batches;
	// its capacity is cfg.Concurrency.
	sem chan struct{}
	// freed is signalled (without blocking) whenever a delivery finishes,
	// so a claim limited by per-application bounds is retried at once
	// rather than after PollInterval.
	freed chan struct{}
	stats counters
	// recorded, when non-nil, is called at the end of every attempt with
	// what was recorded and the record's error. It is a test signal.
	recorded func(p pgstore.EventResultParams, err error)
	// vanish, when non-nil and true for an event, drops the attempt after
	// the delivery without recording it: a test signal that simulates a
	// router killed between the consumer's answer and the record.
	vanish func(ev pgstore.EventDelivery) bool
}

// New returns a router that claims events from store and delivers them as
// cfg says (see config.Router for every field and its default). cfg must
// pass config.Validate: New panics, naming the field, when Concurrency,
// BatchSize, PollInterval, Timeout or PerApplicationConcurrency is not
// positive, ClaimTTL does not exceed Timeout, or SecretKey is malformed. A
// nil logger discards logs.
func New(store *pgstore.Store, cfg config.Router, logger *slog.Logger, opts ...Option) *Router {
	switch {
	case cfg.Concurrency <= 0:
		panic(fmt.Sprintf("router: concurrency %d: want > 0", cfg.Concurrency))
	case cfg.BatchSize <= 0:
		panic(fmt.Sprintf("router: batch_size %d: want > 0", cfg.BatchSize))
	case cfg.PollInterval <= 0:
		panic(fmt.Sprintf("router: poll_interval %v: want > 0", cfg.PollInterval))
	case cfg.Timeout <= 0:
		panic(fmt.Sprintf("router: timeout %v: want > 0", cfg.Timeout))
	case cfg.ClaimTTL <= cfg.Timeout:
		panic(fmt.Sprintf("router: claim_ttl %v: must exceed timeout %v", cfg.ClaimTTL, cfg.Timeout))
	case cfg.PerApplicationConcurrency <= 0:
		panic(fmt.Sprintf("router: per_application_concurrency %d: want > 0", cfg.PerApplicationConcurrency))
	}
	box, err := pgstore.NewSecretBox(cfg.SecretKey)
	if err != nil {
		panic("router: secret_key: " + err.Error())
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	r := &Router{
		store:    store,
		cfg:      cfg,
		logger:   logger,
		box:      box,
		meter:    noop.NewMeterProvider(),
		now:      time.Now,
		rand:     rand.Float64,
		workerID: defaultWorkerID(),
		sem:      make(chan struct{}, cfg.Concurrency),
		freed:    make(chan struct{}, 1),
	}
	for _, o := range opts {
		o(r)
	}
	if r.client == nil {
		r.client = newHTTPClient(cfg.AllowPrivateAddresses)
	}
	if r.grpc.opts == nil {
		r.grpc.opts = grpcDialOptions(cfg.AllowPrivateAddresses)
	}
	if r.metrics, err = newMetrics(r.meter); err != nil {
		logger.Warn("router metrics disabled", "error", err)
		r.meter = noop.NewMeterProvider()
		r.metrics, _ = newMetrics(r.meter)
	}
	return r
}

func defaultWorkerID() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "router"
	}
	return host + "-" + strconv.Itoa(os.Getpid())
}

// Stats returns the counters since New.
func (r *Router) Stats() Stats { return r.stats.snapshot() }

// Run claims and delivers events until ctx ends, then stops claiming, lets
// the deliveries in flight finish (each bounded by cfg.Timeout) and returns
// nil. Database errors never end it: a failed claim is logged and retried
// with exponential backoff (250ms up to 30s).
//
// Each pass claims as many events as there are free delivery slots (at most
// cfg.BatchSize), fairly across applications and at most
// cfg.PerApplicationConcurrency in flight per application (see
// pgstore.EventClaim), and starts a goroutine per event. When the claim was
// full, the next pass starts as soon as a slot is free; otherwise it waits
// cfg.PollInterval or until a delivery finishes, whichever is first.
//
// With a secret key configured, a pass every sealInterval (1 min) also
// encrypts signing secrets still stored in plaintext (migrated from the
// applications table, or registered by a client without the key).
func (r *Router) Run(ctx context.Context) error {
	r.logger.InfoContext(ctx, "router started", "worker_id", r.workerID,
		"concurrency", r.cfg.Concurrency, "per_application_concurrency", r.cfg.PerApplicationConcurrency,
		"batch_size", r.cfg.BatchSize, "secrets_encrypted", r.box.Encrypts())
	if !r.box.Encrypts() {
		r.logger.WarnContext(ctx, "router.secret_key is not set: signing secrets are stored in plaintext (development only)")
	}
	unregister := r.metrics.observePending(r.meter, r.store, r.logger)
	defer unregister()
	var wg sync.WaitGroup
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval, bo.MaxInterval = claimBackoffMin, claimBackoffMax
	var sealedAt time.Time
	for ctx.Err() == nil {
		n := r.acquire(ctx)
		if n == 0 {
			break
		}
		if r.box.Encrypts() && time.Since(sealedAt) >= sealInterval && r.sealSecrets(ctx) {
			sealedAt = time.Now()
		}
		claimedAt := time.Now()
		// The claim runs under a detached context: a SIGTERM that lands
		// while it commits must not leave claimed events undelivered until
		// their claims expire. The deliveries it starts drain on shutdown.
		cctx, ccancel := daemon.Detach(ctx, claimDrain, claimTimeout)
		events, err := r.store.EventClaim(cctx, pgstore.EventClaimParams{
			Owner: r.workerID, Limit: n, ClaimFor: r.cfg.ClaimTTL,
			PerApplication: r.cfg.PerApplicationConcurrency, Box: r.box,
		})
		ccancel()
		if err != nil {
			// Events claimed by a failed call are not delivered; their
			// claims expire and they are claimed again.
			r.release(n)
			if ctx.Err() != nil {
				break
			}
			pause := bo.NextBackOff()
			r.logger.WarnContext(ctx, "claim events failed; backing off", "error", err, "backoff", pause)
			if !sleep(ctx, pause) {
				break
			}
			continue
		}
		bo.Reset()
		r.release(n - len(events))
		claimEnds := claimedAt.Add(r.cfg.ClaimTTL)
		for _, ev := range events {
			wg.Go(func() {
				defer r.finish()
				r.handle(ctx, ev, claimEnds)
			})
		}
		if len(events) < n && !r.idle(ctx) {
			break
		}
	}
	r.logger.InfoContext(ctx, "router stopping; draining deliveries in flight")
	wg.Wait()
	r.client.CloseIdleConnections()
	r.grpc.closeAll()
	r.logger.InfoContext(ctx, "router stopped")
	return nil
}

// sealSecrets encrypts plaintext signing secrets; it reports whether it
// reached the database (a failure is retried on the next pass).
func (r *Router) sealSecrets(ctx context.Context) bool {
	n, err := r.store.ConsumerSealSecrets(ctx, r.box)
	if err != nil {
		r.logger.WarnContext(ctx, "encrypting plaintext signing secrets failed; retrying on the next pass", "error", err)
		return false
	}
	if n > 0 {
		r.logger.InfoContext(ctx, "encrypted plaintext signing secrets", "count", n)
	}
	return true
}

// acquire takes one delivery slot, waiting for it, then every further free
// slot up to cfg.BatchSize without waiting. It returns how many it took, 0
// when ctx ended first.
func (r *Router) acquire(ctx context.Context) int {
	select {
	case r.sem <- struct{}{}:
	case <-ctx.Done():
		return 0
	}
	n := 1
	for n < r.cfg.BatchSize {
		select {
		case r.sem <- struct{}{}:
			n++
		default:
			return n
		}
	}
	return n
}

// release gives n slots back.
func (r *Router) release(n int) {
	for range n {
		<-r.sem
	}
}

// finish gives a finished delivery's slot back and wakes an idle claim loop.
func (r *Router) finish() {
	r.release(1)
	select {
	case r.freed <- struct{}{}:
	default:
	}
}

// idle waits cfg.PollInterval or until a delivery finishes; it reports
// whether ctx is still live.
func (r *Router) idle(ctx context.Context) bool {
	t := time.NewTimer(r.cfg.PollInterval)
	defer t.Stop()
	select {
	case <-t.C:
	case <-r.freed:
	case <-ctx.Done():
		return false
	}
	return true
}

// handle makes one delivery attempt of ev and records it. The attempt is
// not cut short when ctx ends (it is bounded by cfg.Timeout), so a graceful
// stop records what consumers answered.
func (r *Router) handle(ctx context.Context, ev pgstore.EventDelivery, claimEnds time.Time) {
	started := r.now()
	res := r.deliver(context.WithoutCancel(ctx), ev)
	if r.vanish != nil && r.vanish(ev) {
		return
	}
	p := pgstore.EventResultParams{
		ID:              ev.ID,
		ClaimToken:      ev.ClaimToken,
		Attempt:         ev.Attempts + 1,
		StartedAt:       started,
		StatusCode:      res.StatusCode,
		Error:           res.Error,
		Delivered:       res.Delivered,
		ConsumerKind:    ev.ConsumerKind,
		ConsumerVersion: ev.ConsumerVersion,
	}
	switch {
	case res.Delivered:
	case res.Gone:
		p.Dead, p.DisableConsumer, p.DisableReason = true, true, fmt.Sprintf("HTTP %d Gone", res.StatusCode)
	default:
		p.RetryAfter, p.Dead = nextDelay(ev.RoundAttempts+1, r.cfg.RetryDelays, r.cfg.Jitter, r.rand(), res.RetryAfter)
	}
	rec, err := r.record(ctx, p, claimEnds)
	r.report(ctx, ev, p, res, rec, err)
	if r.recorded != nil {
		r.recorded(p, err)
	}
}

// record stores the attempt, retrying database errors with backoff until
// the claim would have expired. It does not retry a lost claim
// (execution.ErrConflict), nor anything once ctx has ended.
func (r *Router) record(ctx context.Context, p pgstore.EventResultParams, claimEnds time.Time) (pgstore.EventRecorded, error) {
	deadline := claimEnds
	if least := time.Now().Add(recordMinWindow); deadline.Before(least) {
		deadline = least
	}
	rctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), deadline)
	defer cancel()
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval, bo.MaxInterval = recordBackoffMin, recordBackoffMax
	rec, err := backoff.Retry(rctx, func() (pgstore.EventRecorded, error) {
		rec, err := r.store.EventRecordResult(rctx, p)
		if err != nil && (errors.Is(err, execution.ErrConflict) || ctx.Err() != nil) {
			return rec, backoff.Permanent(err)
		}
		return rec, err
	}, backoff.WithBackOff(bo), backoff.WithNotify(func(err error, wait time.Duration) {
		r.logger.WarnContext(ctx, "record delivery attempt failed; retrying", "event_id", p.ID,
			"attempt", p.Attempt, "error", err, "backoff", wait)
	}))
	if err != nil {
		return pgstore.EventRecorded{}, fmt.Errorf("record attempt %d of event %s: %w", p.Attempt, p.ID, err)
	}
	return rec, nil
}

// report logs, counts and measures one recorded (or unrecorded) attempt.
// It logs no payload, URL, secret or response data.
func (r *Router) report(ctx context.Context, ev pgstore.EventDelivery, p pgstore.EventResultParams, res attemptResult,
	rec pgstore.EventRecorded, err error) {
	attrs := []any{"event_id", ev.ID, "application_id", ev.ApplicationID, "execution_id", ev.ExecutionID,
		"attempt", p.Attempt, "consumer_kind", kindLabel(ev.ConsumerKind), "status_code", res.StatusCode}
	kind := ev.ConsumerKind
	switch {
	case errors.Is(err, execution.ErrConflict):
		r.stats.conflicts.Add(1)
		r.metrics.attempt(ctx, outcomeConflict, kind, res.StatusCode)
		r.logger.InfoContext(ctx, "delivery attempt not recorded: claim lost to another router", attrs...)
	case err != nil:
		r.metrics.attempt(ctx, outcomeUnrecorded, kind, res.StatusCode)
		r.logger.WarnContext(ctx, "delivery attempt not recorded; the event is retried after its claim expires",
			append(attrs, "error", err)...)
	case p.Delivered:
		r.stats.delivered.Add(1)
		r.metrics.attempt(ctx, outcomeDelivered, kind, res.StatusCode)
		r.metrics.latency.Record(ctx, rec.Age.Seconds(), metric.WithAttributes(attribute.String("consumer_kind", kindLabel(kind))))
		r.logger.DebugContext(ctx, "event delivered", append(attrs, "age", rec.Age)...)
	case p.DisableConsumer:
		r.stats.failed.Add(1)
		r.stats.dead.Add(1)
		r.stats.gone.Add(1)
		r.metrics.attempt(ctx, outcomeGone, kind, res.StatusCode)
		r.metrics.dead.Add(ctx, 1, metric.WithAttributes(attribute.String("reason", "gone")))
		r.logger.WarnContext(ctx, "event dead: the webhook answered 410 Gone",
			append(attrs, "consumer_disabled", rec.ConsumerDisabled)...)
	case p.Dead:
		r.stats.failed.Add(1)
		r.stats.dead.Add(1)
		r.metrics.attempt(ctx, outcomeDead, kind, res.StatusCode)
		r.metrics.dead.Add(ctx, 1, metric.WithAttributes(attribute.String("reason", "exhausted")))
		r.logger.WarnContext(ctx, "event dead: delivery failed too often", append(attrs, "reason", res.Reason)...)
	default:
		r.stats.failed.Add(1)
		r.metrics.attempt(ctx, outcomeRetry, kind, res.StatusCode)
		r.logger.InfoContext(ctx, "event delivery failed; retry scheduled",
			append(attrs, "reason", res.Reason, "retry_after", p.RetryAfter)...)
	}
}

// sleep waits d or until ctx ends; it reports whether ctx is still live.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// claimTimeout bounds one claim query, which runs detached from the
// shutdown signal; claimDrain is how long it may go on after it.
const (
	claimTimeout = 30 * time.Second
	claimDrain   = 5 * time.Second
)
