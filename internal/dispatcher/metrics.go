package dispatcher

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
)

// Metric names (OpenTelemetry; the meter is
// "github.com/capstan-dev/capstan/internal/dispatcher"). The Prometheus
// names, as scraped from /metrics, follow each.
const (
	// MetricDispatched counts dispatch records published to the execution
	// topic (capstan_dispatcher_dispatched_total).
	MetricDispatched = "capstan.dispatcher.dispatched"
	// MetricDispatchLag is a histogram, in seconds, of publish time minus
	// the record's due_at (0 for records published ahead of due_at within
	// the lookahead) (capstan_dispatcher_dispatch_lag_seconds).
	MetricDispatchLag = "capstan.dispatcher.dispatch.lag"
	// MetricLastPass is a gauge, in Unix seconds, of the last successful
	// pass: the heartbeat behind the "dispatcher silence" alarm
	// (capstan_dispatcher_last_pass_timestamp_seconds). Nothing is
	// observed before the first successful pass.
	MetricLastPass = "capstan.dispatcher.last_pass.timestamp"
)

const meterName = "github.com/capstan-dev/capstan/internal/dispatcher"

// Option configures a Dispatcher.
type Option func(*Dispatcher)

// WithMeterProvider records the dispatcher's metrics on mp (default: the
// global provider, otel.GetMeterProvider()).
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(d *Dispatcher) { d.mp = mp }
}

type metrics struct {
	dispatched metric.Int64Counter
	lag        metric.Float64Histogram
	lastPass   metric.Float64ObservableGauge
}

func (d *Dispatcher) initMetrics() error {
	if d.mp == nil {
		d.mp = otel.GetMeterProvider()
	}
	m := d.mp.Meter(meterName)
	var err, e error
	d.m.dispatched, e = m.Int64Counter(MetricDispatched, metric.WithUnit("{record}"),
		metric.WithDescription("Dispatch records published to the execution topic."))
	err = errors.Join(err, e)
	d.m.lag, e = m.Float64Histogram(MetricDispatchLag, metric.WithUnit("s"),
		metric.WithDescription("Time from a dispatch record's due_at to its publication."),
		metric.WithExplicitBucketBoundaries(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
	err = errors.Join(err, e)
	d.m.lastPass, e = m.Float64ObservableGauge(MetricLastPass, metric.WithUnit("s"),
		metric.WithDescription("Unix time of the dispatcher's last successful pass (the heartbeat)."),
		metric.WithFloat64Callback(func(_ context.Context, o metric.Float64Observer) error {
			if n := d.lastPass.Load(); n > 0 {
				o.Observe(float64(n) / float64(time.Second))
			}
			return nil
		}))
	err = errors.Join(err, e)
	if err != nil {
		return fmt.Errorf("dispatcher metrics: %w", err)
	}
	return nil
}
