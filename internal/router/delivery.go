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
	"unicode"
	"unicode/utf8"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"

	"github.com/capstan-dev/capstan/internal/store/pgstore"
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

// Reasons of failed attempts that are not HTTP answers.
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
	StatusCode int // 0 when there was no HTTP response
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

// deliver makes one delivery attempt of ev: a signed POST of its payload to
// the application's webhook, bounded by config.Router.Timeout. It never
// returns an error; every problem is a failed attempt.
func (r *Router) deliver(ctx context.Context, ev pgstore.EventDelivery) attemptResult {
	if ev.WebhookURL == "" {
		return failed(0, errNoConsumer)
	}
	u, err := url.Parse(ev.WebhookURL)
	if err != nil || u.Host == "" {
		return failed(0, errBadURL)
	}
	if s := strings.ToLower(u.Scheme); s != "http" && s != "https" {
		return failed(0, errBadScheme)
	}
	if strings.TrimPrefix(ev.WebhookSecret, "whsec_") == "" {
		return failed(0, errNoSecret)
	}
	wh, err := standardwebhooks.NewWebhook(ev.WebhookSecret)
	if err != nil {
		return failed(0, errBadSecret)
	}
	id := ev.ID.String()
	ts := r.now()
	sig, err := wh.Sign(id, ts, ev.Payload)
	if err != nil {
		return failed(0, "sign: "+err.Error())
	}

	ctx, cancel := context.WithTimeout(ctx, r.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u.String(), bytes.NewReader(ev.Payload))
	if err != nil {
		return failed(0, errBadURL)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", userAgent)
	req.Header.Set(standardwebhooks.HeaderWebhookID, id)
	req.Header.Set(standardwebhooks.HeaderWebhookTimestamp, strconv.FormatInt(ts.Unix(), 10))
	req.Header.Set(standardwebhooks.HeaderWebhookSignature, sig)

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
	if code >= 300 && code <= 399 {
		reason += ": redirect not followed"
	}
	res := failed(code, reason)
	if ex := truncate(sanitize(excerpt), MaxResponseExcerpt); ex != "" {
		res.Error = truncate(reason+": "+ex, maxErrorBytes)
	}
	return res
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
