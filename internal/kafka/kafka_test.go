package kafka_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/capstan-dev/capstan/internal/kafka"
)

func TestHeaderCarrier(t *testing.T) {
	t.Parallel()
	r := &kgo.Record{Headers: []kgo.RecordHeader{{Key: "webhook-id", Value: []byte("ev-1")}}}
	c := kafka.HeaderCarrier{Record: r}
	require.Empty(t, c.Get("traceparent"))
	c.Set("traceparent", "one")
	c.Set("traceparent", "two") // replaces, never duplicates
	require.Equal(t, "two", c.Get("traceparent"))
	require.Equal(t, "ev-1", c.Get("webhook-id"), "other headers are kept")
	require.ElementsMatch(t, []string{"webhook-id", "traceparent"}, c.Keys())

	// A span context survives injection into a record and extraction.
	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID:    trace.TraceID{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16},
		SpanID:     trace.SpanID{1, 2, 3, 4, 5, 6, 7, 8},
		TraceFlags: trace.FlagsSampled,
	})
	var p propagation.TraceContext
	out := &kgo.Record{}
	p.Inject(trace.ContextWithSpanContext(context.Background(), sc), kafka.HeaderCarrier{Record: out})
	got := trace.SpanContextFromContext(p.Extract(context.Background(), kafka.HeaderCarrier{Record: out}))
	require.Equal(t, sc.TraceID(), got.TraceID())
	require.Equal(t, sc.SpanID(), got.SpanID())
	require.True(t, got.IsRemote())
}
