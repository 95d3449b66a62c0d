package router

import (
	"net/http"
	"time"

	"go.opentelemetry.io/otel/metric"
	"google.golang.org/grpc"

	"github.com/capstan-dev/capstan/internal/store/pgstore"
)

// Option configures a Router.
type Option func(*Router)

// WithClock sets the clock that stamps the webhook-timestamp header and the
// recorded start of each attempt. Default time.Now; nil is ignored.
func WithClock(now func() time.Time) Option {
	return func(r *Router) {
		if now != nil {
			r.now = now
		}
	}
}

// WithHTTPClient replaces the delivery client, for tests. The client is used
// as given: the default client's redirect refusal and private-address guard
// (config.Router.AllowPrivateAddresses) do not apply to it, while
// config.Router.Timeout still bounds every delivery. nil is ignored.
func WithHTTPClient(c *http.Client) Option {
	return func(r *Router) {
		if c != nil {
			r.client = c
		}
	}
}

// WithWorkerID names this router in its claims and logs. Default
// "<hostname>-<pid>"; "" is ignored.
func WithWorkerID(id string) Option {
	return func(r *Router) {
		if id != "" {
			r.workerID = id
		}
	}
}

// WithKafkaProducer sets the client that delivers to Kafka consumers
// (Main passes a *kgo.Client for config.Kafka.Brokers). Without one, every
// attempt to a Kafka consumer fails and is retried. nil is ignored.
func WithKafkaProducer(p KafkaProducer) Option {
	return func(r *Router) {
		if p != nil {
			r.kafka = p
		}
	}
}

// WithGRPCDialOptions replaces the dial options of gRPC consumers, for
// tests: the default plaintext transport and private-address guard
// (config.Router.AllowPrivateAddresses) do not apply unless included.
func WithGRPCDialOptions(opts ...grpc.DialOption) Option {
	return func(r *Router) {
		if len(opts) > 0 {
			r.grpc.opts = opts
		}
	}
}

// WithMeterProvider sets where the router's OpenTelemetry metrics go
// (MetricDeliveries, MetricDeliveryLatency, MetricDead,
// MetricPendingOldestAge, MetricPendingEvents). Default: a no-op provider.
// nil is ignored.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(r *Router) {
		if mp != nil {
			r.meter = mp
		}
	}
}

// withRand replaces the uniform random source of the schedule's jitter,
// for tests.
func withRand(f func() float64) Option {
	return func(r *Router) { r.rand = f }
}

// withVanish sets the vanish test signal (see Router.vanish).
func withVanish(f func(pgstore.EventDelivery) bool) Option {
	return func(r *Router) { r.vanish = f }
}
