package router

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/capstan-dev/capstan/internal/store/pgstore"
)

// Metric names (OpenTelemetry; the meter is "github.com/capstan-dev/capstan/internal/router").
const (
	// MetricDeliveries counts recorded delivery attempts (and unrecorded
	// ones, outcome "unrecorded" or "conflict"), by outcome, consumer_kind
	// and status_code (the HTTP status as a decimal string, "none" without
	// an HTTP answer).
	MetricDeliveries = "capstan.router.deliveries"
	// MetricDeliveryLatency is a histogram, in seconds, of the time from
	// settlement (the event's creation) to its successful delivery, by
	// consumer_kind (database clock).
	MetricDeliveryLatency = "capstan.router.delivery.latency"
	// MetricDead counts events that became DEAD, by reason ("exhausted":
	// the sixth failure; "gone": HTTP 410).
	MetricDead = "capstan.router.events.dead"
	// MetricPendingOldestAge is a gauge, in seconds, of the age of the
	// oldest PENDING event per application_id, read from the database at
	// each collection.
	MetricPendingOldestAge = "capstan.router.pending.oldest_age"
	// MetricPendingEvents is a gauge of PENDING events per application_id,
	// read with MetricPendingOldestAge.
	MetricPendingEvents = "capstan.router.pending.events"
)

// Outcomes of delivery attempts (the "outcome" attribute).
const (
	outcomeDelivered  = "delivered"
	outcomeRetry      = "retry"
	outcomeDead       = "dead"
	outcomeGone       = "gone"
	outcomeConflict   = "conflict"
	outcomeUnrecorded = "unrecorded"
)

// pendingQueryTimeout bounds the database read behind the pending gauges.
const pendingQueryTimeout = 5 * time.Second

// metrics are a Router's OpenTelemetry instruments.
type metrics struct {
	deliveries metric.Int64Counter
	latency    metric.Float64Histogram
	dead       metric.Int64Counter
	oldest     metric.Float64ObservableGauge
	pending    metric.Int64ObservableGauge
}

func newMetrics(mp metric.MeterProvider) (*metrics, error) {
	m := mp.Meter("github.com/capstan-dev/capstan/internal/router")
	var out metrics
	var err, e error
	out.deliveries, e = m.Int64Counter(MetricDeliveries, metric.WithUnit("{attempt}"),
		metric.WithDescription("Event delivery attempts by outcome, consumer kind and status code."))
	err = errors.Join(err, e)
	out.latency, e = m.Float64Histogram(MetricDeliveryLatency, metric.WithUnit("s"),
		metric.WithDescription("Time from settlement to successful delivery."),
		metric.WithExplicitBucketBoundaries(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 7200, 21600, 43200))
	err = errors.Join(err, e)
	out.dead, e = m.Int64Counter(MetricDead, metric.WithUnit("{event}"),
		metric.WithDescription("Events that became DEAD, by reason."))
	err = errors.Join(err, e)
	out.oldest, e = m.Float64ObservableGauge(MetricPendingOldestAge, metric.WithUnit("s"),
		metric.WithDescription("Age of the oldest PENDING event per application."))
	err = errors.Join(err, e)
	out.pending, e = m.Int64ObservableGauge(MetricPendingEvents, metric.WithUnit("{event}"),
		metric.WithDescription("PENDING events per application."))
	err = errors.Join(err, e)
	if err != nil {
		return nil, fmt.Errorf("router metrics: %w", err)
	}
	return &out, nil
}

// observePending registers the callback behind the pending gauges: one
// EventPendingByApplication query per collection. The returned function
// unregisters it.
func (m *metrics) observePending(mp metric.MeterProvider, store *pgstore.Store, logger *slog.Logger) func() {
	reg, err := mp.Meter("github.com/capstan-dev/capstan/internal/router").RegisterCallback(
		func(ctx context.Context, o metric.Observer) error {
			ctx, cancel := context.WithTimeout(ctx, pendingQueryTimeout)
			defer cancel()
			list, err := store.EventPendingByApplication(ctx)
			if err != nil {
				return fmt.Errorf("pending events: %w", err)
			}
			for _, p := range list {
				attrs := metric.WithAttributes(attribute.String("application_id", p.ApplicationID.String()))
				o.ObserveFloat64(m.oldest, p.OldestAge.Seconds(), attrs)
				o.ObserveInt64(m.pending, p.Count, attrs)
			}
			return nil
		}, m.oldest, m.pending)
	if err != nil {
		logger.Warn("pending-events gauges not registered", "error", err)
		return func() {}
	}
	return func() { _ = reg.Unregister() }
}

// attempt counts one attempt.
func (m *metrics) attempt(ctx context.Context, outcome string, kind pgstore.ConsumerKind, code int) {
	sc := "none"
	if code > 0 {
		sc = strconv.Itoa(code)
	}
	m.deliveries.Add(ctx, 1, metric.WithAttributes(
		attribute.String("outcome", outcome),
		attribute.String("consumer_kind", kindLabel(kind)),
		attribute.String("status_code", sc)))
}

func kindLabel(k pgstore.ConsumerKind) string {
	if k == "" {
		return "none"
	}
	return string(k)
}
