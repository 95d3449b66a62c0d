package telemetry_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"

	"github.com/capstan-dev/capstan/internal/telemetry"
)

func TestTraceHandler(t *testing.T) {
	t.Parallel()
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	withSpan := trace.ContextWithSpanContext(context.Background(),
		trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled}))
	tests := []struct {
		name      string
		ctx       context.Context
		wantTrace string
		wantSpan  string
	}{
		{"no span", context.Background(), "", ""},
		{"span", withSpan, tid.String(), sid.String()},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var buf bytes.Buffer
			log := slog.New(telemetry.NewTraceHandler(slog.NewJSONHandler(&buf, nil))).With("component", "x").WithGroup("g")
			log.InfoContext(tt.ctx, "hello", "k", "v")
			var rec map[string]any
			require.NoError(t, json.Unmarshal(buf.Bytes(), &rec))
			require.Equal(t, "x", rec["component"])
			g, _ := rec["g"].(map[string]any)
			require.Equal(t, "v", g["k"])
			if tt.wantTrace == "" {
				require.NotContains(t, buf.String(), "trace_id")
				return
			}
			require.Equal(t, tt.wantTrace, g["trace_id"])
			require.Equal(t, tt.wantSpan, g["span_id"])
		})
	}
}
