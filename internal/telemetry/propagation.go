package telemetry

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
)

// TraceparentHeader is the W3C trace-context header (and Kafka record
// header) that carries a span context between processes.
const TraceparentHeader = "traceparent"

// Traceparent returns the W3C traceparent of the span in ctx, as the global
// propagator writes it, or "" when ctx carries no valid span context (for
// example when tracing is off). It is what the store keeps with an
// execution, its dispatch records and its completion event.
func Traceparent(ctx context.Context) string {
	c := propagation.MapCarrier{}
	otel.GetTextMapPropagator().Inject(ctx, c)
	return c.Get(TraceparentHeader)
}

// ContextWithTraceparent returns ctx with the remote span context of the
// W3C traceparent tp, so that spans started from it continue that trace.
// An empty or malformed tp returns ctx unchanged.
func ContextWithTraceparent(ctx context.Context, tp string) context.Context {
	if tp == "" {
		return ctx
	}
	return otel.GetTextMapPropagator().Extract(ctx, propagation.MapCarrier{TraceparentHeader: tp})
}
