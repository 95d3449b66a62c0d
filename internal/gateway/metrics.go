package gateway

import (
	"fmt"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
)

// MetricAccepted counts InvokeCapability calls the gateway accepted, by
// capability, mode (SYNC, ASYNC) and acceptance ("accepted": a new
// execution; "duplicate": an idempotency-key replay) (OpenTelemetry; the
// meter is "github.com/capstan-dev/capstan/internal/gateway"; scraped as
// capstan_gateway_executions_accepted_total).
const MetricAccepted = "capstan.gateway.executions.accepted"

// ServiceOption configures an ExecutionService.
type ServiceOption func(*ExecutionService)

// WithMeterProvider records the service's metrics on mp (default: the
// global provider, otel.GetMeterProvider()).
func WithMeterProvider(mp metric.MeterProvider) ServiceOption {
	return func(s *ExecutionService) { s.mp = mp }
}

func (s *ExecutionService) initMetrics() error {
	if s.mp == nil {
		s.mp = otel.GetMeterProvider()
	}
	var err error
	s.accepted, err = s.mp.Meter("github.com/capstan-dev/capstan/internal/gateway").Int64Counter(MetricAccepted,
		metric.WithUnit("{execution}"),
		metric.WithDescription("Invocations accepted, by capability, mode and acceptance (accepted or duplicate)."))
	if err != nil {
		return fmt.Errorf("gateway metrics: %w", err)
	}
	return nil
}
