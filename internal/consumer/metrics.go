package consumer

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/steps"
)

// Metric names (OpenTelemetry; the meter is
// "github.com/capstan-dev/capstan/internal/consumer"). The Prometheus names,
// as scraped from /metrics, follow each.
const (
	// MetricAttempts counts attempts this consumer finished, by outcome
	// (succeeded, failed, retryable_failure, accepted, parked, lease_lost,
	// lease_expired) and failure_class ("none" without a failure)
	// (capstan_consumer_attempts_total).
	MetricAttempts = "capstan.consumer.attempts"
	// MetricSettled counts executions this consumer settled (its reaper
	// included), by status: SUCCEEDED, FAILED or TIMED_OUT
	// (capstan_consumer_settled_total). Settlements written by the gateway
	// (SYNC calls, adapter callbacks) are not counted here.
	MetricSettled = "capstan.consumer.settled"
	// MetricLeaseReaps counts expired leases the reaper turned into
	// lease.expired failures (capstan_consumer_lease_reaps_total).
	MetricLeaseReaps = "capstan.consumer.lease_reaps"
	// MetricLag is a gauge of records on the execution topic not yet
	// committed by the consumer group, per topic, partition and group,
	// read from Kafka at each collection (every consumer replica reports
	// the whole group's lag) (capstan_consumer_lag_records).
	MetricLag = "capstan.consumer.lag.records"
)

const meterName = "github.com/capstan-dev/capstan/internal/consumer"

// lagQueryTimeout bounds the Kafka requests behind the lag gauge.
const lagQueryTimeout = 5 * time.Second

// Attempt outcomes (the "outcome" attribute of MetricAttempts).
const (
	outcomeSucceeded    = "succeeded"
	outcomeFailed       = "failed"
	outcomeRetryable    = "retryable_failure"
	outcomeAccepted     = "accepted"
	outcomeParked       = "parked"
	outcomeLeaseLost    = "lease_lost"
	outcomeLeaseExpired = "lease_expired"
)

// Option configures a Consumer.
type Option func(*Consumer)

// WithSteps runs the releases declared as steps with r (without it such an
// attempt fails with config.missing).
func WithSteps(r *steps.Runner) Option {
	return func(c *Consumer) { c.steps = r }
}

// WithMeterProvider records the consumer's metrics on mp (default: the
// global provider, otel.GetMeterProvider()).
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(c *Consumer) { c.mp = mp }
}

type metrics struct {
	attempts metric.Int64Counter
	settled  metric.Int64Counter
	reaps    metric.Int64Counter
	lag      metric.Int64ObservableGauge
}

func (c *Consumer) initMetrics() error {
	if c.mp == nil {
		c.mp = otel.GetMeterProvider()
	}
	m := c.mp.Meter(meterName)
	var err, e error
	c.m.attempts, e = m.Int64Counter(MetricAttempts, metric.WithUnit("{attempt}"),
		metric.WithDescription("Attempts finished by this consumer, by outcome and failure class."))
	err = errors.Join(err, e)
	c.m.settled, e = m.Int64Counter(MetricSettled, metric.WithUnit("{execution}"),
		metric.WithDescription("Executions settled by this consumer, by status."))
	err = errors.Join(err, e)
	c.m.reaps, e = m.Int64Counter(MetricLeaseReaps, metric.WithUnit("{lease}"),
		metric.WithDescription("Expired leases reaped."))
	err = errors.Join(err, e)
	c.m.lag, e = m.Int64ObservableGauge(MetricLag, metric.WithUnit("{record}"),
		metric.WithDescription("Records on the execution topic not yet committed by the consumer group."))
	err = errors.Join(err, e)
	if err != nil {
		return fmt.Errorf("consumer metrics: %w", err)
	}
	return nil
}

// ObserveLag registers the lag gauge's callback: one kadm Lag request per
// collection. The returned function unregisters it.
func (c *Consumer) ObserveLag() (func(), error) {
	if c.client == nil || c.cfg.Consumer.Group == "" {
		return func() {}, nil
	}
	adm := kadm.NewClient(c.client)
	group := c.cfg.Consumer.Group
	reg, err := c.mp.Meter(meterName).RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		ctx, cancel := context.WithTimeout(ctx, lagQueryTimeout)
		defer cancel()
		lags, err := adm.Lag(ctx, group)
		if err != nil {
			return fmt.Errorf("consumer lag: %w", err)
		}
		for _, gl := range lags {
			for topic, parts := range gl.Lag {
				for p, l := range parts {
					if l.Err != nil || l.Lag < 0 {
						continue
					}
					o.ObserveInt64(c.m.lag, l.Lag, metric.WithAttributes(
						attribute.String("topic", topic),
						attribute.String("partition", strconv.Itoa(int(p))),
						attribute.String("group", gl.Group)))
				}
			}
		}
		return nil
	}, c.m.lag)
	if err != nil {
		return nil, fmt.Errorf("consumer lag gauge: %w", err)
	}
	return func() { _ = reg.Unregister() }, nil
}

// attempt counts one finished attempt; class is "" without a failure.
func (c *Consumer) attempt(ctx context.Context, outcome, class string) {
	if class == "" {
		class = "none"
	}
	c.m.attempts.Add(ctx, 1, metric.WithAttributes(
		attribute.String("outcome", outcome), attribute.String("failure_class", class)))
	// The attempt span (if ctx carries one) records the outcome too.
	trace.SpanFromContext(ctx).SetAttributes(attribute.String("outcome", outcome), attribute.String("failure_class", class))
}

// settledAs counts one settlement.
func (c *Consumer) settledAs(ctx context.Context, st execution.Status) {
	c.m.settled.Add(ctx, 1, metric.WithAttributes(attribute.String("status", string(st))))
}
