package e2e_test

// The trace test: one execution through the daemons as processes, every
// one exporting its spans as JSON on standard output, must form one trace.

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/examples/csv-payments/payment"
)

// exportedSpan is the part of a span that the console exporter
// (stdouttrace) writes which the test reads.
type exportedSpan struct {
	Name        string
	SpanContext struct{ TraceID, SpanID string }
	Parent      struct{ TraceID, SpanID string }
	Resource    []struct {
		Key   string
		Value struct{ Value any }
	}
	InstrumentationScope struct{ Name string }

	process string // the stack's name of the process that wrote it
}

// service returns the span's service.name resource attribute.
func (sp exportedSpan) service() string {
	for _, kv := range sp.Resource {
		if kv.Key == "service.name" {
			s, _ := kv.Value.Value.(string)
			return s
		}
	}
	return ""
}

// hasParent reports whether the span has a (local or remote) parent.
func (sp exportedSpan) hasParent() bool {
	return strings.Trim(sp.Parent.SpanID, "0") != ""
}

// readSpans decodes the JSON spans the console exporter wrote to path.
func readSpans(t *testing.T, path, process string) []exportedSpan {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	var out []exportedSpan
	dec := json.NewDecoder(f)
	for {
		var sp exportedSpan
		err := dec.Decode(&sp)
		if errors.Is(err, io.EOF) {
			return out
		}
		require.NoError(t, err, "span %d on the standard output of %s", len(out)+1, process)
		sp.process = process
		out = append(out, sp)
	}
}

// stopAll stops every running process of s with SIGTERM and waits until it
// has exited, so the daemons flush their span batches on the way out.
func (s *stack) stopAll(t *testing.T) {
	t.Helper()
	s.mu.Lock()
	procs := slices.Clone(s.procs)
	s.mu.Unlock()
	for _, p := range slices.Backward(procs) {
		if !p.exited() {
			p.signal(t, syscall.SIGTERM)
		}
	}
	for _, p := range procs {
		<-p.done
	}
}

// TestTraceFollowsOneExecution invokes one execution with every process
// exporting spans to standard output (OTEL_TRACES_EXPORTER=console) and
// checks that the execution's spans — the gateway's InvokeCapability, the
// dispatcher's dispatch, the consumer's attempt and adapter call, the
// provider's server span and the router's delivery — share one trace id and
// form one tree: every span's parent is in the trace, except the root's.
func TestTraceFollowsOneExecution(t *testing.T) {
	if testing.Short() {
		t.Skip("starts every daemon as a process")
	}
	s := newStack(t, stackOptions{
		RetryableFraction: -1, // one attempt
		Env:               []string{"OTEL_TRACES_EXPORTER=console", "OTEL_TRACES_SAMPLER=always_on"},
		SeparateStdout:    true,
	})
	s.startAll("consumer-1")

	ctx := t.Context()
	p := samplePayments(t, 1)[0]
	ictx, cancel := context.WithTimeout(ctx, 30*time.Second)
	resp, err := s.client.Invoke(ictx, capability, payment.EncodeJSON(p), "application/json", "trace-"+p.ID)
	cancel()
	require.NoError(t, err)
	executionID := resp.GetExecutionId()
	s.waitAllSettled(t, 1, 60*time.Second)

	// Stopping flushes every process's batch of spans.
	s.stopAll(t)
	var spans []exportedSpan
	s.mu.Lock()
	procs := slices.Clone(s.procs)
	s.mu.Unlock()
	for _, pr := range procs {
		spans = append(spans, readSpans(t, pr.stdoutPath, pr.name)...)
	}

	// The trace is the one whose root is the InvokeCapability span.
	var traceID string
	for _, sp := range spans {
		if strings.HasSuffix(sp.Name, "/InvokeCapability") && sp.service() == "capstan-gateway" {
			require.Empty(t, traceID, "one InvokeCapability span")
			traceID = sp.SpanContext.TraceID
		}
	}
	require.NotEmpty(t, traceID, "the gateway exported the InvokeCapability span; %d spans in all", len(spans))

	var trace []exportedSpan
	ids := map[string]bool{}
	for _, sp := range spans {
		if sp.SpanContext.TraceID == traceID {
			trace = append(trace, sp)
			ids[sp.SpanContext.SpanID] = true
		}
	}
	describe := func() string {
		var b strings.Builder
		for _, sp := range trace {
			b.WriteString("\n  " + sp.process + " " + sp.Name + " " + sp.SpanContext.SpanID + " parent " + sp.Parent.SpanID)
		}
		return b.String()
	}

	// Spans of every component.
	byProcess := map[string][]string{}
	for _, sp := range trace {
		byProcess[sp.process] = append(byProcess[sp.process], sp.Name)
	}
	for _, want := range []struct{ process, span string }{
		{"gateway", "capstan.execution.v1.ExecutionService/InvokeCapability"},
		{"dispatcher", "dispatch"},
		{"consumer-1", "attempt"},
		{"consumer-1", "capstan.adapter.v1.AdapterService/Execute"},
		{"provider", "capstan.adapter.v1.AdapterService/Execute"},
		{"router", "deliver"},
	} {
		require.Contains(t, byProcess[want.process], want.span,
			"execution %s: %s exported %q in the trace:%s", executionID, want.process, want.span, describe())
	}

	// One tree: a single root, every other span's parent in the trace.
	roots := 0
	for _, sp := range trace {
		if !sp.hasParent() {
			roots++
			continue
		}
		require.Equal(t, traceID, sp.Parent.TraceID, "span %s (%s) has its parent in the trace", sp.Name, sp.process)
		require.True(t, ids[sp.Parent.SpanID], "the parent of %s (%s) is a span of the trace:%s", sp.Name, sp.process, describe())
	}
	require.Equal(t, 1, roots, "one root span:%s", describe())
	t.Logf("trace %s of execution %s:%s", traceID, executionID, describe())
}
