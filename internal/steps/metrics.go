package steps

import (
	"context"
	"errors"
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
)

// Metric names (OpenTelemetry; the meter is
// "github.com/capstan-dev/capstan/internal/steps"). The Prometheus names
// follow each.
const (
	// MetricItems counts items of live sessions by what happened to them:
	// sent (a request went out), replayed (fed from a completion stored
	// before the session started) and consumed (published)
	// (capstan_steps_items_total).
	MetricItems = "capstan.steps.items"
	// MetricItemsInFlight is the number of items open and not yet consumed
	// across this process's sessions; per session it never exceeds the
	// release's window (capstan_steps_items_in_flight).
	MetricItemsInFlight = "capstan.steps.items.in_flight"
)

type metrics struct {
	items    metric.Int64Counter
	inFlight metric.Int64UpDownCounter
}

func newMetrics(mp metric.MeterProvider) (metrics, error) {
	m := mp.Meter("github.com/capstan-dev/capstan/internal/steps")
	var out metrics
	var err, e error
	out.items, e = m.Int64Counter(MetricItems, metric.WithUnit("{item}"),
		metric.WithDescription("Items of live sessions: sent, replayed from stored completions, consumed."))
	err = errors.Join(err, e)
	out.inFlight, e = m.Int64UpDownCounter(MetricItemsInFlight, metric.WithUnit("{item}"),
		metric.WithDescription("Items open and not yet consumed in this process's live sessions."))
	err = errors.Join(err, e)
	if err != nil {
		return out, fmt.Errorf("steps metrics: %w", err)
	}
	return out, nil
}

// Instrument records the runner's metrics on mp (by default they go
// nowhere). Call it before the first Run.
func (r *Runner) Instrument(mp metric.MeterProvider) error {
	m, err := newMetrics(mp)
	if err != nil {
		return err
	}
	r.m = m
	return nil
}

func (r *Runner) count(ctx context.Context, kind string, n int) {
	if n > 0 {
		r.m.items.Add(ctx, int64(n), metric.WithAttributes(attribute.String("kind", kind)))
	}
}

func noopMetrics() metrics {
	m, _ := newMetrics(noop.NewMeterProvider())
	return m
}
