// Package telemetry builds the OpenTelemetry providers every daemon runs
// with: a MeterProvider exported in the Prometheus text format (served at
// /metrics on the admin port) and a TracerProvider whose exporter is chosen
// by the standard OTEL_* environment variables.
//
// Each Telemetry has its own Prometheus registry (never the client
// library's global default), so tests can build one per test and run in
// parallel. Install makes one Telemetry the process's: it sets the
// OpenTelemetry global providers and propagator and the handler that
// MetricsHandler returns.
package telemetry

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// Environment variables read by New (the OpenTelemetry SDK's standard
// names; the exporters read their own OTEL_EXPORTER_OTLP_* endpoint,
// header and timeout variables, and the SDK reads OTEL_TRACES_SAMPLER).
const (
	// EnvTracesExporter selects the span exporter: "none" (the default:
	// a no-op TracerProvider, nothing recorded), "otlp" or "console"
	// (JSON spans on standard output).
	EnvTracesExporter = "OTEL_TRACES_EXPORTER"
	// EnvOTLPTracesProtocol, or else EnvOTLPProtocol, selects the OTLP
	// transport: "http/protobuf" (the default) or "grpc".
	EnvOTLPTracesProtocol = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
	// EnvOTLPProtocol is the protocol for every OTLP signal.
	EnvOTLPProtocol = "OTEL_EXPORTER_OTLP_PROTOCOL"
)

// Telemetry is one process's (or one test's) providers.
type Telemetry struct {
	// Registry holds the Prometheus collectors behind Handler: the
	// OpenTelemetry metrics, and the Go runtime and process collectors.
	Registry *prometheus.Registry
	// MeterProvider exports to Registry.
	MeterProvider *sdkmetric.MeterProvider
	// TracerProvider is a no-op provider unless OTEL_TRACES_EXPORTER
	// chose an exporter.
	TracerProvider trace.TracerProvider

	handler        http.Handler
	shutdownTracer func(context.Context) error
}

// Options tune New. The zero value reads the environment of the process.
type Options struct {
	// Getenv reads the OTEL_* variables; nil means os.Getenv.
	Getenv func(string) string
	// Console is where the "console" exporter writes; nil means os.Stdout.
	Console io.Writer
}

// New builds the providers for service (the OpenTelemetry service.name,
// e.g. "capstan-dispatcher"; OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
// override it). Call Shutdown when done.
func New(ctx context.Context, service string, o Options) (*Telemetry, error) {
	getenv := o.Getenv
	if getenv == nil {
		getenv = os.Getenv
	}
	res, err := resource.New(ctx,
		resource.WithAttributes(attribute.String("service.name", service)),
		resource.WithTelemetrySDK(),
		resource.WithFromEnv(),
	)
	if err != nil {
		return nil, fmt.Errorf("telemetry resource: %w", err)
	}
	reg := prometheus.NewRegistry()
	if err := errors.Join(
		reg.Register(collectors.NewGoCollector()),
		reg.Register(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})),
	); err != nil {
		return nil, fmt.Errorf("telemetry runtime collectors: %w", err)
	}
	mp, err := NewMeterProvider(reg, res)
	if err != nil {
		return nil, err
	}
	t := &Telemetry{Registry: reg, MeterProvider: mp,
		handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg})}
	tp, shutdown, err := newTracerProvider(ctx, res, getenv, o.Console)
	if err != nil {
		_ = mp.Shutdown(ctx)
		return nil, err
	}
	t.TracerProvider, t.shutdownTracer = tp, shutdown
	return t, nil
}

// NewMeterProvider returns a MeterProvider whose metrics are collected by
// reg in Prometheus form: an instrument "a.b.c" with unit "s" is scraped
// as a_b_c_seconds, a counter gains _total, and units in braces ("{event}")
// add nothing. res may be nil.
func NewMeterProvider(reg prometheus.Registerer, res *resource.Resource) (*sdkmetric.MeterProvider, error) {
	exp, err := otelprom.New(otelprom.WithRegisterer(reg))
	if err != nil {
		return nil, fmt.Errorf("prometheus exporter: %w", err)
	}
	opts := []sdkmetric.Option{sdkmetric.WithReader(exp)}
	if res != nil {
		opts = append(opts, sdkmetric.WithResource(res))
	}
	return sdkmetric.NewMeterProvider(opts...), nil
}

func newTracerProvider(ctx context.Context, res *resource.Resource, getenv func(string) string, console io.Writer) (trace.TracerProvider, func(context.Context) error, error) {
	none := func(context.Context) error { return nil }
	var exp sdktrace.SpanExporter
	var err error
	switch kind := strings.ToLower(strings.TrimSpace(getenv(EnvTracesExporter))); kind {
	case "", "none":
		return noop.NewTracerProvider(), none, nil
	case "console":
		if console == nil {
			console = os.Stdout
		}
		exp, err = stdouttrace.New(stdouttrace.WithWriter(console))
	case "otlp":
		proto := getenv(EnvOTLPTracesProtocol)
		if proto == "" {
			proto = getenv(EnvOTLPProtocol)
		}
		switch proto {
		case "", "http/protobuf":
			exp, err = otlptracehttp.New(ctx)
		case "grpc":
			exp, err = otlptracegrpc.New(ctx)
		default:
			return nil, none, fmt.Errorf("telemetry: %s=%q is not supported (want http/protobuf or grpc)", EnvOTLPTracesProtocol, proto)
		}
	default:
		return nil, none, fmt.Errorf("telemetry: %s=%q is not supported (want otlp, console or none)", EnvTracesExporter, kind)
	}
	if err != nil {
		return nil, none, fmt.Errorf("trace exporter: %w", err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	return tp, tp.Shutdown, nil
}

// Handler serves the Registry in the Prometheus exposition formats.
func (t *Telemetry) Handler() http.Handler { return t.handler }

// Meter returns the named meter of t's MeterProvider.
func (t *Telemetry) Meter(name string) metric.Meter { return t.MeterProvider.Meter(name) }

// Shutdown flushes and stops both providers.
func (t *Telemetry) Shutdown(ctx context.Context) error {
	return errors.Join(t.MeterProvider.Shutdown(ctx), t.shutdownTracer(ctx))
}

var installed atomic.Pointer[Telemetry]

// Install makes t the process's telemetry: the OpenTelemetry global meter
// and tracer providers, the W3C trace-context and baggage propagator, and
// the registry MetricsHandler serves. Only a daemon's main calls it.
func Install(t *Telemetry) {
	otel.SetMeterProvider(t.MeterProvider)
	otel.SetTracerProvider(t.TracerProvider)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	installed.Store(t)
}

// MetricsHandler serves the installed Telemetry's registry, or 404 when
// none is installed (a daemon started by a test rather than by its main).
func MetricsHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t := installed.Load()
		if t == nil {
			http.Error(w, "metrics are not enabled in this process", http.StatusNotFound)
			return
		}
		t.Handler().ServeHTTP(w, r)
	})
}
