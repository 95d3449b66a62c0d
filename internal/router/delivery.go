package router

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/telemetry"
)

// Limits on what a delivery reads back and records.
const (
	// MaxResponseExcerpt is the most bytes of a receiver's response body
	// that are kept in the recorded error of a failed delivery.
	MaxResponseExcerpt = 256
	// maxDrain is how much of a response body is read (and discarded) so
	// the connection can be reused.
	maxDrain = 64 << 10
	// maxErrorBytes bounds the recorded error as a whole.
	maxErrorBytes = 512
	userAgent     = "capstan-router"
)

// Reasons of failed attempts that are not answers of the consumer.
const (
	errNoConsumer = "no consumer registered"
	errNoSecret   = "no webhook secret registered"
	errBadSecret  = "invalid webhook secret: want whsec_<base64>"
	errBadURL     = "invalid webhook url"
	errBadScheme  = "webhook url scheme not allowed: want http or https"
)

// attemptResult is the outcome of one delivery attempt.
type attemptResult struct {
	Delivered  bool
	StatusCode int // HTTP status; 0 when there was no HTTP response
	// Gone reports an HTTP 410: the event is DEAD at once and the consumer
	// is disabled.
	Gone bool
	// RetryAfter is the receiver's Retry-After (429 and 503 only), 0 when
	// absent or unparsable; the schedule clamps it (see nextDelay).
	RetryAfter time.Duration
	// Reason says why the attempt failed; it never holds response data,
	// URLs or secrets, so it may be logged.
	Reason string
	// Error is what is recorded: Reason plus at most MaxResponseExcerpt
	// bytes of the response body, valid UTF-8 without control characters.
	Error string
}

func failed(code int, reason string) attemptResult {
	return attemptResult{StatusCode: code, Reason: reason, Error: reason}
}

// tracer names the router's spans (the global tracer provider).
var tracer = otel.Tracer("capstan/router")

// deliver makes one delivery attempt of ev to its application's consumer as
// claimed, bounded by config.Router.Timeout. It never returns an error;
// every problem is a failed attempt.
//
// The attempt is a "deliver" span, child of the trace context stored with
// the event (the execution's trace); the consumer receives the span's
// context as the traceparent header (webhooks), record header (Kafka) or
// gRPC metadata.
func (r *Router) deliver(ctx context.Context, ev pgstore.EventDelivery) attemptResult {
	ctx, span := tracer.Start(telemetry.ContextWithTraceparent(ctx, ev.TraceContext), "deliver",
		trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(attribute.String("event_id", ev.ID.String()),
			attribute.String("execution_id", ev.ExecutionID.String()),
			attribute.String("consumer_kind", string(ev.ConsumerKind)),
			attribute.Int("delivery_attempt", ev.Attempts+1)))
	defer span.End()
	res := r.deliverTo(ctx, ev)
	if res.StatusCode != 0 {
		span.SetAttributes(attribute.Int("http.response.status_code", res.StatusCode))
	}
	span.SetAttributes(attribute.Bool("delivered", res.Delivered))
	if !res.Delivered {
		span.SetStatus(codes.Error, res.Reason)
	}
	return res
}

// deliverTo is deliver without the span.
func (r *Router) deliverTo(ctx context.Context, ev pgstore.EventDelivery) attemptResult {
	if ev.SecretErr != nil {
		return failed(0, ev.SecretErr.Error())
	}
	switch ev.ConsumerKind {
	case pgstore.ConsumerWebhook:
		return r.deliverWebhook(ctx, ev)
	case pgstore.ConsumerKafka:
		return r.deliverKafka(ctx, ev)
	case pgstore.ConsumerGRPC:
		return r.deliverGRPC(ctx, ev)
	case "":
		return failed(0, errNoConsumer)
	}
	return failed(0, fmt.Sprintf("unknown consumer kind %q", ev.ConsumerKind))
}

// deliverWebhook POSTs ev's payload to the webhook URL, signed per Standard
// Webhooks with every active secret. Only a 2xx answer is a success;
// redirects are not followed; 410 is Gone; 429 and 503 carry Retry-After.
func (r *Router) deliverWebhook(ctx context.Context, ev pgstore.EventDelivery) attemptResult {
	u, err := url.Parse(ev.ConsumerTarget)
	if err != nil || u.Host == "" {
		return failed(0, errBadURL)
	}
	if s := strings.ToLower(u.Scheme); s != "http" && s != "https" {
		return failed(0, errBadScheme)
	}
	if len(ev.Secrets) == 0 {
		return failed(0, errNoSecret)
	}
	id := ev.ID.String()
	ts := r.now().Unix()
	sig, err := signatures(id, ts, ev.Payload, ev.Secrets)
	if err != nil {
		return failed(0, errBadSecret)
	}

	ctx, cancel := context.WithTimeout(ctx, r.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u.String(), bytes.NewReader(ev.Payload))
	if err != nil {
		return failed(0, errBadURL)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", userAgent)
	req.Header.Set(HeaderWebhookID, id)
	req.Header.Set(HeaderWebhookTimestamp, strconv.FormatInt(ts, 10))
	req.Header.Set(HeaderWebhookSignature, sig)
	otel.GetTextMapPropagator().Inject(ctx, propagation.HeaderCarrier(req.Header)) // traceparent

	resp, err := r.client.Do(req)
	if err != nil {
		return failed(0, r.transportReason(err))
	}
	defer resp.Body.Close()
	excerpt, _ := io.ReadAll(io.LimitReader(resp.Body, MaxResponseExcerpt))
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxDrain))

	code := resp.StatusCode
	if code >= 200 && code <= 299 {
		return attemptResult{Delivered: true, StatusCode: code}
	}
	reason := fmt.Sprintf("HTTP %d", code)
	switch {
	case code >= 300 && code <= 399:
		reason += ": redirect not followed"
	case code == http.StatusGone:
		reason += ": consumer gone, disabled"
	}
	res := failed(code, reason)
	res.Gone = code == http.StatusGone
	if code == http.StatusTooManyRequests || code == http.StatusServiceUnavailable {
		res.RetryAfter = parseRetryAfter(resp.Header.Get("Retry-After"), r.now())
	}
	if ex := truncate(sanitize(excerpt), MaxResponseExcerpt); ex != "" {
		res.Error = truncate(reason+": "+ex, maxErrorBytes)
	}
	return res
}

// parseRetryAfter reads a Retry-After value: delay-seconds or an HTTP date
// (relative to now). It returns 0 when v is empty, malformed or in the past.
func parseRetryAfter(v string, now time.Time) time.Duration {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0
	}
	if secs, err := strconv.ParseInt(v, 10, 64); err == nil {
		if secs <= 0 {
			return 0
		}
		return time.Duration(min(secs, int64(MaxRetryDelay/time.Second))) * time.Second
	}
	t, err := http.ParseTime(v)
	if err != nil {
		return 0
	}
	return min(max(t.Sub(now), 0), MaxRetryDelay)
}

// transportReason describes a failed request without the URL (which may
// carry credentials in its query) that *url.Error would add.
func (r *Router) transportReason(err error) string {
	var addrErr *AddressError
	switch {
	case errors.As(err, &addrErr):
		return "refused: " + addrErr.Error()
	case errors.Is(err, ErrForbiddenAddress):
		return "refused: " + ErrForbiddenAddress.Error()
	case errors.Is(err, context.DeadlineExceeded):
		return fmt.Sprintf("timeout after %v", r.cfg.Timeout)
	}
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	return truncate(sanitize([]byte("transport: "+err.Error())), maxErrorBytes)
}

// sanitize makes b safe to store and show: valid UTF-8, no NUL or other
// control characters (each becomes a space), surrounding space trimmed.
func sanitize(b []byte) string {
	s := strings.ToValidUTF8(string(b), "\uFFFD")
	s = strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return ' '
		}
		return r
	}, s)
	return strings.TrimSpace(s)
}

// truncate cuts s to at most n bytes at a rune boundary.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}
