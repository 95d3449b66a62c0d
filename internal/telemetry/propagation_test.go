package telemetry_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/capstan-dev/capstan/internal/telemetry"
)

// TestTraceparentRoundTrip sets the global propagator (as Install does), so
// it is not parallel; no other test of this package reads it.
func TestTraceparentRoundTrip(t *testing.T) {
	prev := otel.GetTextMapPropagator()
	otel.SetTextMapPropagator(propagation.TraceContext{})
	t.Cleanup(func() { otel.SetTextMapPropagator(prev) })

	require.Empty(t, telemetry.Traceparent(context.Background()), "no span, no traceparent")
	require.Equal(t, context.Background(), telemetry.ContextWithTraceparent(context.Background(), ""))

	tp := sdktrace.NewTracerProvider()
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	ctx, span := tp.Tracer("test").Start(context.Background(), "accept")
	defer span.End()
	parent := telemetry.Traceparent(ctx)
	require.Regexp(t, `^00-[0-9a-f]{32}-[0-9a-f]{16}-01$`, parent)

	// A span started from the stored context continues the trace.
	_, child := tp.Tracer("test").Start(telemetry.ContextWithTraceparent(context.Background(), parent), "dispatch")
	defer child.End()
	ro := child.(sdktrace.ReadOnlySpan)
	require.Equal(t, span.SpanContext().TraceID(), ro.SpanContext().TraceID())
	require.Equal(t, span.SpanContext().SpanID(), ro.Parent().SpanID())
	require.True(t, ro.Parent().IsRemote())

	// A malformed value leaves the context without a span context.
	bad := telemetry.ContextWithTraceparent(context.Background(), "not-a-traceparent")
	require.False(t, trace.SpanContextFromContext(bad).IsValid())
}
