package client

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	"google.golang.org/protobuf/encoding/protojson"

	eventv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/event/v1"
)

// DefaultWebhookTolerance is how far a webhook's "webhook-timestamp" may lie
// from the receiver's clock, in either direction, before Verify refuses it.
// It matches the Standard Webhooks recommendation.
const DefaultWebhookTolerance = 5 * time.Minute

// Webhook header names (Standard Webhooks).
const (
	// HeaderWebhookID carries the event id (CompletionEvent.event_id).
	HeaderWebhookID = standardwebhooks.HeaderWebhookID
	// HeaderWebhookTimestamp carries the signing time in Unix seconds.
	HeaderWebhookTimestamp = standardwebhooks.HeaderWebhookTimestamp
	// HeaderWebhookSignature carries "v1,<base64 HMAC-SHA256>" entries,
	// separated by spaces.
	HeaderWebhookSignature = standardwebhooks.HeaderWebhookSignature
)

var (
	// ErrInvalidSecret is returned by NewEventVerifier when the secret is not
	// "whsec_" followed by non-empty standard base64 (the prefix is optional).
	ErrInvalidSecret = errors.New("client: invalid webhook secret")
	// ErrSignature is wrapped by Verify when the webhook headers are missing
	// or malformed or no signature matches: the request is not authentic
	// (HTTP 401 is the fitting answer).
	ErrSignature = errors.New("client: webhook signature not verified")
	// ErrTimestamp is wrapped by Verify when the signature is valid but the
	// timestamp is outside the tolerance (a replay or a skewed clock; HTTP 401
	// is the fitting answer).
	ErrTimestamp = errors.New("client: webhook timestamp outside tolerance")
	// ErrEventBody is wrapped by Verify when the signature is valid but the
	// body is not a CompletionEvent in protobuf JSON, lacks an event_id, or
	// its event_id differs from the webhook-id header (HTTP 400).
	ErrEventBody = errors.New("client: webhook body is not a valid completion event")
)

// EventVerifier verifies Capstan completion webhooks and decodes their body.
// It is safe for concurrent use.
type EventVerifier struct {
	wh        *standardwebhooks.Webhook
	tolerance time.Duration
	now       func() time.Time
}

// VerifierOption configures an EventVerifier.
type VerifierOption func(*EventVerifier)

// WithTolerance sets how far the webhook timestamp may lie from now, in
// either direction. Values <= 0 are ignored (the default,
// DefaultWebhookTolerance, stays).
func WithTolerance(d time.Duration) VerifierOption {
	return func(v *EventVerifier) {
		if d > 0 {
			v.tolerance = d
		}
	}
}

// WithClock sets the clock Verify compares timestamps with; nil is ignored.
// Meant for tests.
func WithClock(now func() time.Time) VerifierOption {
	return func(v *EventVerifier) {
		if now != nil {
			v.now = now
		}
	}
}

// NewEventVerifier returns a verifier for webhooks signed with secret, the
// application's webhook secret in the form "whsec_<base64 key>".
//
// Errors: ErrInvalidSecret (wrapping the decoding error, if any).
func NewEventVerifier(secret string, opts ...VerifierOption) (*EventVerifier, error) {
	raw := strings.TrimPrefix(strings.TrimSpace(secret), "whsec_")
	if raw == "" {
		return nil, ErrInvalidSecret
	}
	wh, err := standardwebhooks.NewWebhook(raw)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidSecret, err)
	}
	v := &EventVerifier{wh: wh, tolerance: DefaultWebhookTolerance, now: time.Now}
	for _, o := range opts {
		o(v)
	}
	return v, nil
}

// Verify checks that body and headers form an authentic, fresh Standard
// Webhooks message signed with the verifier's secret, then decodes body as a
// CompletionEvent in protobuf JSON (unknown fields are ignored, so newer
// senders stay compatible).
//
// Errors: ErrSignature (missing/malformed headers or no matching signature),
// ErrTimestamp (older or newer than the tolerance), ErrEventBody (the
// authentic body does not decode, has no event_id, or its event_id differs
// from the webhook-id header). Each wraps the underlying cause.
func (v *EventVerifier) Verify(headers http.Header, body []byte) (*eventv1.CompletionEvent, error) {
	// The library's own Verify enforces a fixed tolerance; verify the
	// signature with it and apply the configured tolerance here.
	if err := v.wh.VerifyIgnoringTimestamp(body, headers); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrSignature, err)
	}
	secs, err := strconv.ParseInt(headers.Get(HeaderWebhookTimestamp), 10, 64)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrSignature, err)
	}
	ts := time.Unix(secs, 0)
	now := v.now()
	if now.Sub(ts) > v.tolerance || ts.Sub(now) > v.tolerance {
		return nil, fmt.Errorf("%w: timestamp %d, now %d, tolerance %s", ErrTimestamp, secs, now.Unix(), v.tolerance)
	}

	ev := &eventv1.CompletionEvent{}
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(body, ev); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrEventBody, err)
	}
	if ev.GetEventId() == "" {
		return nil, fmt.Errorf("%w: event_id is empty", ErrEventBody)
	}
	if id := headers.Get(HeaderWebhookID); ev.GetEventId() != id {
		return nil, fmt.Errorf("%w: event_id %q differs from %s %q", ErrEventBody, ev.GetEventId(), HeaderWebhookID, id)
	}
	return ev, nil
}
