package adapter

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
)

// CompletionPath is the gateway's HTTP endpoint for webhook-transport
// completions; InteractionRequest.CompletionURL points at it.
const CompletionPath = "/v1/interactions/complete"

// InteractionRequest is what Capstan sends out for one interaction on the
// webhook transport (the body of a signed POST) and the kafka transport
// (the value of a record on the request topic, keyed by CorrelationID).
type InteractionRequest struct {
	// InteractionID (UUID) identifies the interaction; stable across resends.
	InteractionID string `json:"interaction_id"`
	// CorrelationID is the key of the kafka records; echo it back.
	CorrelationID string `json:"correlation_id"`
	ExecutionID   string `json:"execution_id"`
	Capability    string `json:"capability"`
	// Request is the payload: the execution's input.
	Request     []byte `json:"request"`
	ContentType string `json:"content_type"`
	// Deadline after which a completion is refused (RFC 3339).
	Deadline time.Time `json:"deadline"`
	// ResumeToken must accompany the completion. It is signed by Capstan and
	// bound to the application, execution, interaction and deadline.
	ResumeToken string `json:"resume_token"`
	// CompletionURL is where the webhook transport's completion is POSTed.
	CompletionURL string `json:"completion_url,omitempty"`
}

// InteractionCompletion completes one interaction: exactly one of Result
// and Failure. On the webhook transport it is the body of a POST to
// InteractionRequest.CompletionURL, signed per Standard Webhooks with the
// transport's shared secret; on the kafka transport it is the value of a
// record on the response topic, keyed by the correlation id.
type InteractionCompletion struct {
	ResumeToken   string             `json:"resume_token"`
	CorrelationID string             `json:"correlation_id,omitempty"`
	Result        *CompletionResult  `json:"result,omitempty"`
	Failure       *CompletionFailure `json:"failure,omitempty"`
}

// CompletionResult is a successful completion.
type CompletionResult struct {
	Output      []byte `json:"output"`
	ContentType string `json:"content_type,omitempty"`
}

// CompletionFailure is an unsuccessful completion.
type CompletionFailure struct {
	Class     string `json:"class"`
	Message   string `json:"message,omitempty"`
	Retryable bool   `json:"retryable,omitempty"`
}

// Errors of the interaction codecs.
var (
	ErrCompletion = errors.New("invalid interaction completion")
	ErrSignature  = errors.New("invalid webhook signature")
)

// MaxCompletionBytes bounds a completion's encoded size (4 MiB plus room
// for the envelope).
const MaxCompletionBytes = 5 << 20

// DecodeCompletion parses and checks a completion: the resume token is
// present, and exactly one of result and failure (with a class) is set.
// Errors wrap ErrCompletion and name the field.
func DecodeCompletion(b []byte) (InteractionCompletion, error) {
	var c InteractionCompletion
	if len(b) > MaxCompletionBytes {
		return c, fmt.Errorf("%w: %d bytes, at most %d", ErrCompletion, len(b), MaxCompletionBytes)
	}
	if err := json.Unmarshal(b, &c); err != nil {
		return c, fmt.Errorf("%w: %w", ErrCompletion, err)
	}
	switch {
	case c.ResumeToken == "":
		return c, fmt.Errorf("%w: resume_token: required", ErrCompletion)
	case (c.Result == nil) == (c.Failure == nil):
		return c, fmt.Errorf("%w: want exactly one of result and failure", ErrCompletion)
	case c.Failure != nil && c.Failure.Class == "":
		return c, fmt.Errorf("%w: failure.class: required", ErrCompletion)
	}
	return c, nil
}

// SignWebhook sets the Standard Webhooks headers (webhook-id,
// webhook-timestamp, webhook-signature) on h for body, with secret
// ("whsec_" + base64).
func SignWebhook(h http.Header, secret, id string, now time.Time, body []byte) error {
	wh, err := standardwebhooks.NewWebhook(secret)
	if err != nil {
		return fmt.Errorf("webhook secret: %w", err)
	}
	sig, err := wh.Sign(id, now, body)
	if err != nil {
		return err
	}
	h.Set("webhook-id", id)
	h.Set("webhook-timestamp", strconv.FormatInt(now.Unix(), 10))
	h.Set("webhook-signature", sig)
	return nil
}

// VerifyWebhook checks the Standard Webhooks signature of body in constant
// time, and that its timestamp is within tolerance of now. Errors wrap
// ErrSignature.
func VerifyWebhook(h http.Header, secret string, body []byte, now time.Time, tolerance time.Duration) error {
	wh, err := standardwebhooks.NewWebhook(secret)
	if err != nil {
		return fmt.Errorf("webhook secret: %w", err)
	}
	if err := wh.VerifyIgnoringTimestamp(body, h); err != nil {
		return fmt.Errorf("%w: %w", ErrSignature, err)
	}
	ts, err := strconv.ParseInt(h.Get("webhook-timestamp"), 10, 64)
	if err != nil {
		return fmt.Errorf("%w: webhook-timestamp", ErrSignature)
	}
	if d := now.Sub(time.Unix(ts, 0)); d > tolerance || d < -tolerance {
		return fmt.Errorf("%w: timestamp outside the %v window", ErrSignature, tolerance)
	}
	return nil
}
