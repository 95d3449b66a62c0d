// Package consumer implements cmd/consumer, the execution consumer (SYSTEM
// §4 hop 3, §5): a Kafka consumer-group member that, for every dispatch on
// the execution topic, starts the attempt with a guarded update, calls the
// adapter under a renewed, token-fenced lease, and settles or schedules the
// next attempt. A reaper in the same process fails attempts whose lease
// expired and settles executions whose async budget passed; it is safe on
// any number of replicas because every write it makes is fenced.
//
// # Offsets
//
// Many attempts run at once (MaxInFlight), so records finish out of order.
// The committed offset of a partition never passes a record whose outcome is
// not yet durable: a crash re-delivers at most the records in flight, and
// the guarded attempt start turns those re-deliveries into skips.
package consumer

import (
	"cmp"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"sync"
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

	"github.com/capstan-dev/capstan/internal/adapterclient"
	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/kafka"
	"github.com/capstan-dev/capstan/internal/steps"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/token"
	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
	dispatchv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/dispatch/v1"
)

// tracer names the consumer's spans (the global tracer provider).
var tracer = otel.Tracer("capstan/consumer")

// Consumer runs attempts from the execution topic.
type Consumer struct {
	store    *pgstore.Store
	client   *kgo.Client
	cfg      *config.Config
	adapters *adapterclient.Pool
	offsets  *offsetTracker
	owner    string
	logger   *slog.Logger
	stats    counters
	// signer issues callback tokens; nil when no callback_secret is set.
	signer *token.Signer
	// steps runs the releases declared as steps; nil when none is.
	steps *steps.Runner
	// shutdown is closed when Run's context ends: live sessions stop at
	// once (they are resumable) instead of using the drain time.
	shutdown <-chan struct{}

	mp metric.MeterProvider
	m  metrics
}

type counters struct {
	started, skipped, undecodable, succeeded, failed, retried, lost, reaped, budgetTimeouts, parked atomic.Int64
}

// Stats are the consumer's counters since start.
type Stats struct {
	Started, Skipped, Undecodable, Succeeded, Failed, Retried, Lost, Reaped, BudgetTimeouts, Parked int64
}

// Stats returns the counters.
func (c *Consumer) Stats() Stats {
	s := &c.stats
	return Stats{s.started.Load(), s.skipped.Load(), s.undecodable.Load(), s.succeeded.Load(), s.failed.Load(),
		s.retried.Load(), s.lost.Load(), s.reaped.Load(), s.budgetTimeouts.Load(), s.parked.Load()}
}

// New returns a consumer. client must be a consumer-group client built with
// the options from ClientOpts; owner names this worker in leases.
// A configuration whose callback_secret does not decode gets no signer
// (config.Validate refuses it first).
func New(store *pgstore.Store, client *kgo.Client, cfg *config.Config, offsets *offsetTracker, owner string, logger *slog.Logger, opts ...Option) *Consumer {
	c := &Consumer{store: store, client: client, cfg: cfg, adapters: adapterclient.NewPool(), offsets: offsets,
		owner: owner, logger: logger}
	for _, o := range opts {
		o(c)
	}
	if err := c.initMetrics(); err != nil {
		logger.Warn("metrics not fully registered", "error", err)
	}
	if key, err := base64.StdEncoding.DecodeString(cfg.CallbackSecret); err == nil && cfg.CallbackSecret != "" {
		c.signer, _ = token.NewSigner(key)
	}
	return c
}

// ClientOpts returns the kgo options of the consumer-group client: manual
// marks committed by the autocommitter, and a synchronous commit of the
// marks when partitions are revoked.
func ClientOpts(cfg *config.Config, offsets *offsetTracker, logger *slog.Logger) []kgo.Opt {
	return append(sessionOpts(cfg),
		kgo.ConsumerGroup(cfg.Consumer.Group),
		kgo.ConsumeTopics(cfg.Kafka.ExecutionTopic),
		kgo.AutoCommitMarks(),
		kgo.AutoCommitInterval(time.Second),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.OnPartitionsRevoked(func(ctx context.Context, cl *kgo.Client, revoked map[string][]int32) {
			if err := cl.CommitMarkedOffsets(ctx); err != nil {
				logger.Warn("commit on revoke failed; in-flight records may be redelivered", "error", err)
			}
			offsets.forget(revoked)
		}),
	)
}

// sessionOpts are the group-session options of both of the consumer's
// groups: consumer.session_timeout (default 45 s), so that the partitions of
// a dead consumer move to a live one that soon, and a heartbeat well inside
// it (kgo's default of 3 s would exceed a short one).
func sessionOpts(cfg *config.Config) []kgo.Opt {
	session := cmp.Or(cfg.Consumer.SessionTimeout, 45*time.Second)
	return []kgo.Opt{kgo.SessionTimeout(session), kgo.HeartbeatInterval(min(session/3, 3*time.Second))}
}

// NewOffsetTracker returns the tracker shared by ClientOpts and New.
func NewOffsetTracker() *offsetTracker { return newOffsetTracker() }

// DrainTimeout bounds how long Run lets attempts in flight finish after its
// context ends; attempts still running then are abandoned to their lease.
const DrainTimeout = 10 * time.Second

// Run consumes until ctx ends, then stops polling, lets the attempts in
// flight finish (at most DrainTimeout; the rest are cancelled and left to
// their lease) and commits the offsets of every durable outcome.
func (c *Consumer) Run(ctx context.Context) error {
	sem := make(chan struct{}, c.cfg.Consumer.MaxInFlight)
	var wg sync.WaitGroup
	c.shutdown = ctx.Done()
	work, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	go func() {
		select {
		case <-ctx.Done():
		case <-work.Done():
			return
		}
		t := time.NewTimer(DrainTimeout)
		defer t.Stop()
		select {
		case <-t.C:
			cancelWork()
		case <-work.Done():
		}
	}()
	defer func() {
		wg.Wait()
		cancelWork()
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if err := c.client.CommitMarkedOffsets(cctx); err != nil {
			c.logger.Warn("final offset commit failed", "error", err)
		}
		c.adapters.Close()
	}()
	for {
		// Wait for at least one free slot, then poll at most as many
		// records as there are free slots.
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return nil
		}
		free := 1 + (cap(sem) - len(sem))
		fetches := c.client.PollRecords(ctx, free)
		if ctx.Err() != nil {
			<-sem
			return nil
		}
		fetches.EachError(func(t string, p int32, err error) {
			c.logger.Warn("fetch error", "topic", t, "partition", p, "error", err)
		})
		recs := fetches.Records()
		if len(recs) == 0 {
			<-sem
			continue
		}
		for i, r := range recs {
			if i > 0 {
				sem <- struct{}{} // cannot block: len(recs) ≤ free
			}
			c.offsets.start(r)
			wg.Add(1)
			go func(r *kgo.Record) {
				defer wg.Done()
				defer func() { <-sem }()
				if c.handle(work, r) {
					c.offsets.markDone(c.client, r)
				}
			}(r)
		}
	}
}

// handle processes one record and reports whether its outcome is durable
// (so its offset may be committed). It returns false only when ctx ended
// before the outcome could be written; the record is then redelivered.
//
// The work runs under an "attempt" span, child of the dispatcher's span
// whose context the record's headers carry; the adapter call inside it is
// a gRPC client span that passes the trace on to the adapter.
func (c *Consumer) handle(ctx context.Context, r *kgo.Record) bool {
	ctx = otel.GetTextMapPropagator().Extract(ctx, kafka.HeaderCarrier{Record: r})
	ctx, span := tracer.Start(ctx, "attempt", trace.WithSpanKind(trace.SpanKindConsumer))
	defer span.End()
	var d dispatchv1.ExecutionDispatch
	if err := proto.Unmarshal(r.Value, &d); err != nil {
		c.stats.undecodable.Add(1)
		c.logger.Error("undecodable execution record skipped", "partition", r.Partition, "offset", r.Offset, "error", err)
		return true
	}
	id, err := uuid.Parse(d.GetExecutionId())
	if err != nil || d.GetAttempt() < 1 {
		c.stats.undecodable.Add(1)
		c.logger.Error("invalid execution record skipped", "partition", r.Partition, "offset", r.Offset,
			"execution_id", d.GetExecutionId(), "attempt", d.GetAttempt())
		return true
	}
	span.SetAttributes(attribute.String("execution_id", id.String()), attribute.Int("attempt", int(d.GetAttempt())))
	log := c.logger.With("execution_id", id, "attempt", d.GetAttempt())
	var e execution.Execution
	err = retryStore(ctx, log, func() error {
		var err error
		e, err = c.store.AttemptStart(ctx, pgstore.AttemptStartParams{
			ExecutionID: id, Attempt: int(d.GetAttempt()), Owner: c.owner, LeaseFor: c.leaseFor(""),
		})
		return err
	})
	switch {
	case errors.Is(err, execution.ErrConflict):
		c.stats.skipped.Add(1)
		span.SetAttributes(attribute.Bool("skipped", true))
		log.Debug("obsolete or duplicate dispatch skipped")
		return true
	case err != nil && ctx.Err() != nil:
		return false // shutting down: leave the record to be redelivered
	case err != nil:
		c.stats.skipped.Add(1)
		span.RecordError(err)
		span.SetStatus(codes.Error, "attempt refused")
		log.Error("attempt refused; dispatch skipped", "error", err)
		return true
	}
	span.SetAttributes(attribute.String("capability", e.Capability))
	c.stats.started.Add(1)
	c.runAttempt(ctx, log, e)
	return true
}

// leaseFor returns the lease duration of a capability (the default policy's
// when it is not configured).
func (c *Consumer) leaseFor(capability string) time.Duration {
	if cp, ok := c.cfg.Lookup(capability); ok {
		return cp.Policy().LeaseDuration
	}
	// The capability is not known yet at attempt start (the record names
	// only the execution); use the longest configured lease, and the
	// default only when nothing is configured. The first heartbeat then
	// renews with the capability's own lease.
	var d time.Duration
	for _, cp := range c.cfg.Capabilities {
		d = max(d, cp.Policy().LeaseDuration)
	}
	if d == 0 {
		d = execution.DefaultLeaseDuration
	}
	return d
}

// runAttempt calls the adapter for a started attempt under its lease and
// writes the outcome, fenced by attempt and lease token.
func (c *Consumer) runAttempt(ctx context.Context, log *slog.Logger, e execution.Execution) {
	fence := pgstore.Fence{Attempt: e.Attempt, LeaseToken: e.LeaseToken}
	capb, ok := c.cfg.Lookup(e.Capability)
	if !ok {
		c.attempt(ctx, outcomeFailed, execution.ClassConfigMissing)
		c.settle(ctx, log, e, fence, execution.StatusFailed, execution.Outcome{Failure: execution.Failure{
			Class: execution.ClassConfigMissing, Message: fmt.Sprintf("capability %q is not configured", e.Capability)}})
		return
	}
	policy := capb.Policy()
	if capb.Steps != nil {
		c.runSteps(ctx, log, e, capb, fence)
		return
	}
	if capb.Await != nil {
		// The release's step is an await: send the input out over the
		// transport and park, without calling the adapter.
		c.attempt(ctx, outcomeParked, "")
		c.park(ctx, log, e, capb, policy, "")
		return
	}

	callCtx, cancelCall := context.WithTimeout(ctx, policy.AttemptTimeout)
	defer cancelCall()
	var leaseLost atomic.Bool
	hbDone := make(chan struct{})
	go func() {
		defer close(hbDone)
		c.store.LeaseKeep(callCtx, log, e.ID, e.Attempt, e.LeaseToken, policy.LeaseDuration, func() { leaseLost.Store(true); cancelCall() })
	}()
	var callbackToken string
	if c.signer != nil {
		callbackToken = c.signer.Issue(token.Claims{Kind: token.KindCallback, ApplicationID: e.ApplicationID,
			ExecutionID: e.ID, Subject: e.LeaseToken, Attempt: e.Attempt, ExpiresAt: e.BudgetDeadline})
	}
	resp, callErr := c.adapters.Execute(callCtx, capb.Adapter, &adapterv1.ExecuteRequest{
		ExecutionId: e.ID.String(), Attempt: int32(e.Attempt), Capability: e.Capability, Release: e.Release,
		Input: e.Input, ContentType: e.ContentType, ApplicationId: e.ApplicationID.String(),
		Deadline: timestamppb.New(time.Now().Add(policy.AttemptTimeout)), CallbackToken: callbackToken,
	})
	cancelCall()
	<-hbDone
	if leaseLost.Load() {
		c.stats.lost.Add(1)
		c.attempt(ctx, outcomeLeaseLost, "")
		log.Info("lease lost during the adapter call; outcome discarded")
		return
	}
	if ctx.Err() != nil {
		// Shutting down mid-call: leave the attempt to its lease; the
		// reaper retries it after expiry.
		log.Info("shutdown during the adapter call; attempt left to lease expiry")
		return
	}
	out := adapterclient.Classify(resp, callErr)
	switch {
	case out.Accepted:
		c.attempt(ctx, outcomeAccepted, "")
		c.park(ctx, log, e, capb, policy, out.ExternalReference)
	case out.Succeeded:
		c.attempt(ctx, outcomeSucceeded, "")
		c.settle(ctx, log, e, fence, execution.StatusSucceeded, out)
	case !out.Failure.Retryable:
		c.attempt(ctx, outcomeFailed, out.Failure.Class)
		c.settle(ctx, log, e, fence, execution.StatusFailed, out)
	default:
		c.attempt(ctx, outcomeRetryable, out.Failure.Class)
		c.retry(ctx, log, e, fence, out.Failure, policy, "RETRYABLE_FAILURE")
	}
}

// runSteps runs an attempt of a release declared as steps: a live session
// over the step's await unit (package steps), which writes its own outcome.
func (c *Consumer) runSteps(ctx context.Context, log *slog.Logger, e execution.Execution, capb config.Capability, fence pgstore.Fence) {
	if c.steps == nil {
		f := execution.Failure{Class: execution.ClassConfigMissing, Message: "this consumer has no object store for releases with steps"}
		c.attempt(ctx, outcomeFailed, f.Class)
		c.settle(ctx, log, e, fence, execution.StatusFailed, execution.Outcome{Failure: f})
		return
	}
	c.stats.parked.Add(1)
	// A file may take hours: at shutdown its session hands the execution
	// to the next attempt at once rather than running out the drain time.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-c.shutdown:
			cancel()
		case <-ctx.Done():
		}
	}()
	res, sum := c.steps.Run(ctx, e, capb)
	switch res {
	case steps.Succeeded:
		c.attempt(ctx, outcomeSucceeded, "")
		c.stats.succeeded.Add(1)
		c.settledAs(ctx, execution.StatusSucceeded)
		log.Info("steps published", "object", sum.Object, "items", sum.Items, "rows", sum.Rows,
			"sent", sum.Sent, "replayed", sum.Replayed, "max_in_flight", sum.MaxInFlight)
	case steps.Failed:
		c.attempt(ctx, outcomeFailed, sum.FailureClass)
		c.stats.failed.Add(1)
		c.settledAs(ctx, execution.StatusFailed)
	case steps.Retried:
		c.attempt(ctx, outcomeRetryable, sum.FailureClass)
		c.stats.retried.Add(1)
	case steps.Lost:
		c.attempt(ctx, outcomeLeaseLost, "")
		c.stats.lost.Add(1)
	}
}

func (c *Consumer) settle(ctx context.Context, log *slog.Logger, e execution.Execution, fence pgstore.Fence, st execution.Status, out execution.Outcome) {
	p := pgstore.SettleParams{ExecutionID: e.ID, Fence: fence, Status: st}
	if st == execution.StatusSucceeded {
		p.Output, p.OutputType, p.AttemptOutcome = out.Output, out.OutputType, "SUCCEEDED"
	} else {
		f := out.Failure
		p.Failure, p.AttemptOutcome, p.AttemptFailure = &f, "FAILED", &f
	}
	err := retryStore(ctx, log, func() error { _, err := c.store.ExecutionSettle(ctx, p); return err })
	switch {
	case errors.Is(err, execution.ErrConflict):
		c.stats.lost.Add(1)
		log.Info("settlement lost: the execution moved on meanwhile", "status", st)
	case err != nil:
		log.Warn("settlement not written before shutdown; the lease will expire and the attempt retry", "error", err)
	case st == execution.StatusSucceeded:
		c.stats.succeeded.Add(1)
		c.settledAs(ctx, st)
	default:
		c.stats.failed.Add(1)
		c.settledAs(ctx, st)
	}
}

func (c *Consumer) retry(ctx context.Context, log *slog.Logger, e execution.Execution, fence pgstore.Fence, f execution.Failure, policy execution.Policy, outcome string) {
	var res pgstore.RetryResult
	err := retryStore(ctx, log, func() error {
		var err error
		res, err = c.store.AttemptRetry(ctx, pgstore.RetryParams{
			ExecutionID: e.ID, Fence: fence, Failure: f, Policy: policy, AttemptOutcome: outcome,
		})
		return err
	})
	switch {
	case errors.Is(err, execution.ErrLeaseLost), errors.Is(err, execution.ErrConflict):
		c.stats.lost.Add(1)
		log.Info("retry not scheduled: the attempt was superseded or settled meanwhile")
	case err != nil:
		log.Warn("retry not written before shutdown; the lease will expire", "error", err)
	case res.Released:
		c.stats.succeeded.Add(1)
		c.settledAs(ctx, res.Execution.Status)
		log.Info("a completion recorded before the park settled the attempt instead of a retry", "status", res.Execution.Status)
	case res.Decision == execution.RetrySchedule:
		c.stats.retried.Add(1)
		log.Debug("retry scheduled", "class", f.Class, "due_at", res.DueAt)
	case res.Decision == execution.RetryExhausted:
		c.stats.failed.Add(1)
		c.settledAs(ctx, execution.StatusFailed)
		log.Info("attempts exhausted", "class", f.Class)
	default:
		c.stats.budgetTimeouts.Add(1)
		c.settledAs(ctx, execution.StatusTimedOut)
		log.Info("async budget exhausted", "class", f.Class)
	}
}

// park opens the attempt's ONE_TO_ONE await unit and parks the execution in
// WAITING_EXTERNAL (SYSTEM §6). After an adapter's "accepted" the unit is on
// the interaction-api transport and the lease becomes the callback lease,
// renewed by the adapter's RenewLease; for an await step the unit is on the
// release's transport and the interaction sender pushes it out. A
// completion that arrived before the park is released here, once.
func (c *Consumer) park(ctx context.Context, log *slog.Logger, e execution.Execution, capb config.Capability, policy execution.Policy, ref string) {
	step, transport, leaseFor := pgstore.StepAdapter, pgstore.TransportInteractionAPI, policy.LeaseDuration
	if capb.Await != nil {
		// Nobody renews the lease of an await step: it lasts as long as the
		// interaction's deadline, whose sweep fails the execution.
		step, transport, leaseFor = "await", capb.Await.Transport, capb.AwaitDeadline()+policy.LeaseDuration
	}
	var res pgstore.ParkResult
	err := retryStore(ctx, log, func() error {
		var err error
		res, err = c.store.AwaitPark(ctx, pgstore.ParkParams{
			AwaitOpen: pgstore.AwaitOpen{ExecutionID: e.ID, ApplicationID: e.ApplicationID, Attempt: e.Attempt,
				Step: step, Capability: e.Capability, Transport: transport,
				Timeout: capb.AwaitDeadline(), Request: e.Input, ContentType: e.ContentType, ExternalReference: ref},
			LeaseToken: e.LeaseToken, LeaseFor: leaseFor, Policy: policy,
		})
		return err
	})
	switch {
	case errors.Is(err, execution.ErrLeaseLost), errors.Is(err, execution.ErrConflict):
		c.stats.lost.Add(1)
		log.Info("park lost: the attempt was superseded or settled meanwhile")
	case err != nil:
		log.Warn("park not written before shutdown; the lease will expire", "error", err)
	case res.Released:
		c.settledAs(ctx, res.Execution.Status)
		log.Info("completion recorded before the park released", "status", res.Execution.Status)
	default:
		c.stats.parked.Add(1)
		log.Debug("parked on await unit", "await_unit_id", res.UnitID)
	}
}

// retryStore runs fn until it succeeds, fails with a final error, or ctx
// ends (pgstore.Retry).
func retryStore(ctx context.Context, log *slog.Logger, fn func() error) error {
	return pgstore.Retry(ctx, log, fn)
}
