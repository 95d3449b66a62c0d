// Package telemetrytest gives tests a private MeterProvider with its own
// Prometheus registry, and a reader of the /metrics exposition.
package telemetrytest

import (
	"bufio"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/capstan-dev/capstan/internal/telemetry"
)

// Metrics is one test's MeterProvider and the /metrics handler over its
// registry.
type Metrics struct {
	MeterProvider *sdkmetric.MeterProvider
	Handler       http.Handler
}

// New returns a MeterProvider exporting to a fresh registry; it is shut
// down when the test ends.
func New(t testing.TB) *Metrics {
	t.Helper()
	reg := prometheus.NewRegistry()
	mp, err := telemetry.NewMeterProvider(reg, nil)
	if err != nil {
		t.Fatalf("meter provider: %v", err)
	}
	t.Cleanup(func() { _ = mp.Shutdown(t.Context()) })
	return &Metrics{MeterProvider: mp, Handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{})}
}

// Sample is one line of the text exposition.
type Sample struct {
	Name   string
	Labels map[string]string
	Value  float64
}

// Samples are a scrape's lines.
type Samples []Sample

// Scrape GETs /metrics from h (a daemon's admin handler or Metrics.Handler)
// and parses the text exposition; it fails the test on a non-200 answer.
func Scrape(t testing.TB, h http.Handler) Samples {
	t.Helper()
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodGet, "/metrics", nil)
	req.Header.Set("Accept", "text/plain")
	h.ServeHTTP(rec, req)
	if rec.Code != http.StatusOK {
		t.Fatalf("GET /metrics: %d %s", rec.Code, rec.Body.String())
	}
	var out Samples
	sc := bufio.NewScanner(rec.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		s, ok := parseLine(line)
		if !ok {
			t.Fatalf("unparsable /metrics line %q", line)
		}
		out = append(out, s)
	}
	return out
}

// parseLine parses `name{k="v",...} value [timestamp]`.
func parseLine(line string) (Sample, bool) {
	s := Sample{Labels: map[string]string{}}
	i := strings.IndexAny(line, "{ ")
	if i < 0 {
		return s, false
	}
	s.Name, line = line[:i], line[i:]
	if line[0] == '{' {
		line = line[1:]
		for {
			line = strings.TrimLeft(line, ", ")
			if strings.HasPrefix(line, "}") {
				line = line[1:]
				break
			}
			eq := strings.Index(line, `="`)
			if eq < 0 {
				return s, false
			}
			key := line[:eq]
			line = line[eq+2:]
			var b strings.Builder
			j := 0
			for ; j < len(line) && line[j] != '"'; j++ {
				if line[j] == '\\' && j+1 < len(line) {
					j++
					if line[j] == 'n' {
						b.WriteByte('\n')
						continue
					}
				}
				b.WriteByte(line[j])
			}
			if j == len(line) {
				return s, false
			}
			s.Labels[key] = b.String()
			line = line[j+1:]
		}
	}
	fields := strings.Fields(line)
	if len(fields) == 0 {
		return s, false
	}
	v, err := strconv.ParseFloat(fields[0], 64)
	if err != nil {
		return s, false
	}
	s.Value = v
	return s, true
}

// Find returns the samples named name whose labels include every pair of
// match.
func (ss Samples) Find(name string, match map[string]string) Samples {
	var out Samples
next:
	for _, s := range ss {
		if s.Name != name {
			continue
		}
		for k, v := range match {
			if s.Labels[k] != v {
				continue next
			}
		}
		out = append(out, s)
	}
	return out
}

// Sum adds the values of Find(name, match); ok is false when none matched.
func (ss Samples) Sum(name string, match map[string]string) (sum float64, ok bool) {
	for _, s := range ss.Find(name, match) {
		sum += s.Value
		ok = true
	}
	return sum, ok
}
