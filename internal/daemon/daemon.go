// Package daemon holds what the four daemons share: logger construction,
// the admin HTTP server (/healthz, /readyz), the gRPC server with the
// standard health service and reflection, and the run loop that stops on
// SIGINT/SIGTERM.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/telemetry"
)

// NewLogger returns a JSON (or text) slog logger at the configured level
// writing to w, with a "component" attribute, and trace_id and span_id on
// records logged with a context that carries a span (telemetry.TraceHandler).
func NewLogger(w io.Writer, c config.Log, component string) *slog.Logger {
	var lvl slog.Level
	_ = lvl.UnmarshalText([]byte(c.Level))
	opts := &slog.HandlerOptions{Level: lvl}
	var h slog.Handler
	if c.Format == "text" {
		h = slog.NewTextHandler(w, opts)
	} else {
		h = slog.NewJSONHandler(w, opts)
	}
	return slog.New(telemetry.NewTraceHandler(h)).With("component", component)
}

// SignalContext returns a context cancelled on SIGINT or SIGTERM.
func SignalContext() (context.Context, context.CancelFunc) {
	return signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
}

// ReadyFunc reports whether the daemon can do its work; nil means ready.
type ReadyFunc func(ctx context.Context) error

// Health tracks readiness for /readyz and the gRPC health service.
type Health struct {
	grpc    *health.Server
	ready   ReadyFunc
	metrics http.Handler
	mu      sync.Mutex
	checked bool
	last    error
}

// MetricReadyzStatus is the readiness gauge (OpenTelemetry name; scraped
// as capstan_readyz_status): 1 when the last readiness check passed, 0
// when it failed or none ran yet, with attribute component.
const MetricReadyzStatus = "capstan.readyz.status"

// Instrument registers the MetricReadyzStatus gauge for component on mp,
// observing the result of the last Check (run by Watch every
// HealthInterval and by every /readyz). It returns a function that
// unregisters the gauge.
func (h *Health) Instrument(mp metric.MeterProvider, component string) (func(), error) {
	m := mp.Meter("github.com/capstan-dev/capstan/internal/daemon")
	g, err := m.Int64ObservableGauge(MetricReadyzStatus,
		metric.WithDescription("1 when the last readiness check passed, 0 otherwise."))
	if err != nil {
		return nil, fmt.Errorf("readyz gauge: %w", err)
	}
	attrs := metric.WithAttributes(attribute.String("component", component))
	reg, err := m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		h.mu.Lock()
		ok := h.checked && h.last == nil
		h.mu.Unlock()
		var v int64
		if ok {
			v = 1
		}
		o.ObserveInt64(g, v, attrs)
		return nil
	}, g)
	if err != nil {
		return nil, fmt.Errorf("readyz gauge: %w", err)
	}
	return func() { _ = reg.Unregister() }, nil
}

// SetMetrics makes Handler serve m at /metrics instead of
// telemetry.MetricsHandler (the process's installed registry).
func (h *Health) SetMetrics(m http.Handler) { h.metrics = m }

// NewHealth returns a Health that asks ready on every /readyz and every
// Refresh.
func NewHealth(ready ReadyFunc) *Health {
	return &Health{grpc: health.NewServer(), ready: ready}
}

// Check runs the readiness function and updates the gRPC health status.
func (h *Health) Check(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	err := h.ready(ctx)
	h.mu.Lock()
	h.checked, h.last = true, err
	h.mu.Unlock()
	st := healthpb.HealthCheckResponse_SERVING
	if err != nil {
		st = healthpb.HealthCheckResponse_NOT_SERVING
	}
	h.grpc.SetServingStatus("", st)
	return err
}

// Watch refreshes the gRPC health status every interval until ctx ends.
func (h *Health) Watch(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		_ = h.Check(ctx)
		select {
		case <-ctx.Done():
			h.grpc.Shutdown()
			return
		case <-t.C:
		}
	}
}

// Handler serves /healthz (always 200 while the process runs), /readyz
// (200 when ready, 503 with the reason otherwise) and /metrics (the
// Prometheus exposition of the handler given to SetMetrics, by default the
// installed telemetry's; 404 when none is installed).
func (h *Health) Handler() http.Handler {
	mux := http.NewServeMux()
	m := h.metrics
	if m == nil {
		m = telemetry.MetricsHandler()
	}
	mux.Handle("GET /metrics", m)
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "ok\n")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		if err := h.Check(r.Context()); err != nil {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = fmt.Fprintf(w, "not ready: %v\n", err)
			return
		}
		_, _ = io.WriteString(w, "ready\n")
	})
	return mux
}

// NewGRPCServer returns a gRPC server with the standard health service (fed
// by h) and server reflection registered.
func NewGRPCServer(h *Health, opts ...grpc.ServerOption) *grpc.Server {
	s := grpc.NewServer(opts...)
	healthpb.RegisterHealthServer(s, h.grpc)
	reflection.Register(s)
	return s
}

// Group runs functions until the first returns, then cancels the rest and
// waits for them. It returns the first non-nil error other than
// context.Canceled.
type Group struct {
	wg     sync.WaitGroup
	cancel context.CancelFunc
	mu     sync.Mutex
	err    error
}

// NewGroup returns a group and its context, cancelled when any member
// returns.
func NewGroup(ctx context.Context) (*Group, context.Context) {
	ctx, cancel := context.WithCancel(ctx)
	return &Group{cancel: cancel}, ctx
}

// Go runs fn in the group.
func (g *Group) Go(fn func() error) {
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		err := fn()
		if err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, http.ErrServerClosed) &&
			!errors.Is(err, grpc.ErrServerStopped) {
			g.mu.Lock()
			if g.err == nil {
				g.err = err
			}
			g.mu.Unlock()
		}
		g.cancel()
	}()
}

// Wait waits for every member and returns the first error.
func (g *Group) Wait() error {
	g.wg.Wait()
	g.cancel()
	return g.err
}

// ServeGRPC serves s on addr until ctx ends, then stops gracefully within
// grace (forcing after). The listener is bound before it returns an error
// or starts serving, so callers learn of a bad address at once.
func ServeGRPC(ctx context.Context, s *grpc.Server, lis net.Listener, grace time.Duration) error {
	errc := make(chan error, 1)
	go func() { errc <- s.Serve(lis) }()
	select {
	case err := <-errc:
		return fmt.Errorf("grpc serve %s: %w", lis.Addr(), err)
	case <-ctx.Done():
	}
	done := make(chan struct{})
	go func() { s.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-time.After(grace):
		s.Stop()
	}
	return nil
}

// ServeHTTP serves h on lis until ctx ends, then shuts down within grace.
func ServeHTTP(ctx context.Context, h http.Handler, lis net.Listener, grace time.Duration) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(lis) }()
	select {
	case err := <-errc:
		return fmt.Errorf("http serve %s: %w", lis.Addr(), err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), grace)
	defer cancel()
	return srv.Shutdown(sctx)
}

// Listen binds addr ("" returns nil, nil: the server is disabled).
func Listen(addr string) (net.Listener, error) {
	if addr == "" {
		return nil, nil
	}
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", addr, err)
	}
	return lis, nil
}

// Grace is the shutdown grace period of every daemon.
const Grace = 10 * time.Second

// HealthInterval is how often the gRPC health status is refreshed.
const HealthInterval = 2 * time.Second

// Addr returns the listener's address, or "" for a nil listener.
func Addr(l net.Listener) string {
	if l == nil {
		return ""
	}
	return l.Addr().String()
}

// Detach returns a context that outlives ctx by at most drain: it is
// cancelled drain after ctx ends, after max in any case, or by cancel. A
// unit of work that must not be cut in half by a shutdown signal (a claim
// and what follows it) runs under it.
func Detach(ctx context.Context, drain, max time.Duration) (context.Context, context.CancelFunc) {
	d, cancel := context.WithTimeout(context.WithoutCancel(ctx), max)
	stop := context.AfterFunc(ctx, func() {
		t := time.AfterFunc(drain, cancel)
		context.AfterFunc(d, func() { t.Stop() })
	})
	return d, func() { stop(); cancel() }
}
