package router

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
)

// newSecret returns a fresh Standard Webhooks secret, "whsec_<base64>".
func newSecret(t testing.TB) string {
	t.Helper()
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	return "whsec_" + base64.StdEncoding.EncodeToString(key)
}

// verifySignature checks a received webhook twice: with an HMAC computed
// here from the spec (v1, HMAC-SHA256 over "id.timestamp.body" keyed with
// the decoded secret) and with the library's Verify.
func verifySignature(t testing.TB, secret string, h http.Header, body []byte) {
	t.Helper()
	key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(secret, "whsec_"))
	require.NoError(t, err)
	mac := hmac.New(sha256.New, key)
	_, _ = fmt.Fprintf(mac, "%s.%s.%s", h.Get("webhook-id"), h.Get("webhook-timestamp"), body)
	want := "v1," + base64.StdEncoding.EncodeToString(mac.Sum(nil))
	require.Equal(t, want, h.Get("webhook-signature"), "independently computed signature")

	wh, err := standardwebhooks.NewWebhook(secret)
	require.NoError(t, err)
	require.NoError(t, wh.Verify(body, h), "library verification")
}

func TestDeliver(t *testing.T) {
	t.Parallel()
	secret := newSecret(t)
	clock := time.Now().Add(-time.Minute).Truncate(time.Second)
	payload := []byte(`{"eventId":"x","type":"execution.succeeded"}`)
	longBody := strings.Repeat("é", 200) + "\x00tail-beyond-the-limit"

	var redirectTargetHits atomic.Int64
	target := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		redirectTargetHits.Add(1)
	}))
	t.Cleanup(target.Close)
	// Parent cleanups run after every parallel subtest has finished.
	t.Cleanup(func() { require.Zero(t, redirectTargetHits.Load(), "redirect followed") })

	tests := []struct {
		name           string
		handler        http.HandlerFunc // nil: no server
		url            func(srvURL string) string
		secret         string
		guard          bool // AllowPrivateAddresses false
		timeout        time.Duration
		kind           pgstore.ConsumerKind // default webhook; "-" for none
		wantOK         bool
		wantGone       bool
		wantRetryAfter time.Duration
		wantCode       int
		wantErr        string // substring of the recorded error
		wantNoErrIn    string // must not appear in the recorded error
	}{
		{name: "200 delivered", handler: func(w http.ResponseWriter, _ *http.Request) {}, wantOK: true, wantCode: 200},
		{name: "204 delivered", handler: func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(204) }, wantOK: true, wantCode: 204},
		{name: "500 keeps a bounded body excerpt", handler: func(w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(500)
			_, _ = io.WriteString(w, longBody)
		}, wantCode: 500, wantErr: "HTTP 500: éé", wantNoErrIn: "tail-beyond-the-limit"},
		{name: "410 is gone", handler: func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(410) },
			wantCode: 410, wantErr: "HTTP 410: consumer gone, disabled", wantGone: true},
		{name: "429 with Retry-After seconds", handler: func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Retry-After", "120")
			w.WriteHeader(429)
		}, wantCode: 429, wantErr: "HTTP 429", wantRetryAfter: 2 * time.Minute},
		{name: "503 with Retry-After date", handler: func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Retry-After", clock.Add(90*time.Second).UTC().Format(http.TimeFormat))
			w.WriteHeader(503)
		}, wantCode: 503, wantErr: "HTTP 503", wantRetryAfter: 90 * time.Second},
		{name: "500 ignores Retry-After", handler: func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Retry-After", "120")
			w.WriteHeader(500)
		}, wantCode: 500, wantErr: "HTTP 500"},
		{name: "302 is not followed", handler: func(w http.ResponseWriter, r *http.Request) {
			http.Redirect(w, r, target.URL, http.StatusFound)
		}, wantCode: 302, wantErr: "HTTP 302: redirect not followed"},
		{name: "hanging receiver times out", handler: func(w http.ResponseWriter, r *http.Request) {
			<-r.Context().Done()
		}, timeout: 100 * time.Millisecond, wantErr: "timeout after 100ms"},
		{name: "no consumer", kind: "-", wantErr: "no consumer registered"},
		{name: "ftp scheme refused", url: func(string) string { return "ftp://example.com/hook" }, wantErr: errBadScheme},
		{name: "file scheme refused", url: func(string) string { return "file:///etc/passwd" }, wantErr: errBadURL},
		{name: "unparsable url", url: func(string) string { return "http://[::1" }, wantErr: errBadURL},
		{name: "no secret refused", handler: func(w http.ResponseWriter, _ *http.Request) {}, secret: "-",
			wantErr: errNoSecret},
		{name: "empty secret refused", handler: func(w http.ResponseWriter, _ *http.Request) {}, secret: "whsec_",
			wantErr: errBadSecret},
		{name: "malformed secret refused", handler: func(w http.ResponseWriter, _ *http.Request) {},
			secret: "whsec_not*base64", wantErr: errBadSecret, wantNoErrIn: "not*base64"},
		{name: "loopback refused by the guard", handler: func(w http.ResponseWriter, _ *http.Request) {},
			guard: true, wantErr: "refused: webhook address not allowed: 127.0.0.1 is loopback"},
		{name: "localhost refused after resolution", handler: func(w http.ResponseWriter, _ *http.Request) {},
			url:   func(u string) string { return strings.Replace(u, "127.0.0.1", "localhost", 1) + "/p?token=s3cret" },
			guard: true, wantErr: "is loopback", wantNoErrIn: "s3cret"},
		{name: "connection refused names no url", url: func(string) string { return "http://127.0.0.1:1/p?token=s3cret" },
			wantErr: "transport: dial tcp 127.0.0.1:1", wantNoErrIn: "s3cret"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var (
				mu     sync.Mutex
				got    []*http.Request
				bodies [][]byte
			)
			srvURL := ""
			if tt.handler != nil {
				srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					b, _ := io.ReadAll(r.Body)
					mu.Lock()
					got, bodies = append(got, r.Clone(context.Background())), append(bodies, b)
					mu.Unlock()
					tt.handler(w, r)
				}))
				t.Cleanup(srv.Close)
				srvURL = srv.URL
			}
			cfg := compressedConfig()
			cfg.AllowPrivateAddresses = !tt.guard
			if tt.timeout > 0 {
				cfg.Timeout = tt.timeout
			}
			r := New(nil, cfg, nil, WithClock(func() time.Time { return clock }))
			t.Cleanup(r.client.CloseIdleConnections)
			ev := pgstore.EventDelivery{
				ID: uuid.New(), ApplicationID: uuid.New(), Payload: payload,
				ConsumerKind: pgstore.ConsumerWebhook, ConsumerTarget: srvURL, Secrets: []string{secret},
			}
			if tt.url != nil {
				ev.ConsumerTarget = tt.url(srvURL)
			}
			switch tt.secret {
			case "":
			case "-":
				ev.Secrets = nil
			default:
				ev.Secrets = []string{tt.secret}
			}
			if tt.kind == "-" {
				ev.ConsumerKind = ""
			}

			res := r.deliver(t.Context(), ev)
			mu.Lock()
			defer mu.Unlock()

			require.Equal(t, tt.wantOK, res.Delivered, "result %+v", res)
			require.Equal(t, tt.wantCode, res.StatusCode)
			require.Equal(t, tt.wantGone, res.Gone)
			require.Equal(t, tt.wantRetryAfter, res.RetryAfter)
			if tt.wantOK {
				require.Empty(t, res.Error)
				require.Len(t, got, 1)
				h := got[0].Header
				require.Equal(t, http.MethodPost, got[0].Method)
				require.Equal(t, "application/json", h.Get("Content-Type"))
				require.Equal(t, ev.ID.String(), h.Get("webhook-id"))
				require.Equal(t, strconv.FormatInt(clock.Unix(), 10), h.Get("webhook-timestamp"))
				require.Equal(t, payload, bodies[0])
				verifySignature(t, secret, h, bodies[0])
				return
			}
			require.Contains(t, res.Error, tt.wantErr)
			require.LessOrEqual(t, len(res.Error), maxErrorBytes)
			require.NotContains(t, res.Error, "\x00")
			require.NotContains(t, res.Reason, "é", "the loggable reason holds no response data")
			if tt.wantNoErrIn != "" {
				require.NotContains(t, res.Error, tt.wantNoErrIn)
			}
			if tt.guard || tt.secret != "" || tt.kind != "" {
				require.Empty(t, got, "the receiver must not be reached")
			}
		})
	}
}

func TestDeliverExcerptBound(t *testing.T) {
	t.Parallel()
	body := strings.Repeat("a", MaxResponseExcerpt) + "SECRET-AFTER-LIMIT"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(503)
		_, _ = io.WriteString(w, body)
	}))
	t.Cleanup(srv.Close)
	r := New(nil, compressedConfig(), nil)
	t.Cleanup(r.client.CloseIdleConnections)

	res := r.deliver(t.Context(), pgstore.EventDelivery{
		ID: uuid.New(), Payload: []byte(`{}`), ConsumerKind: pgstore.ConsumerWebhook, ConsumerTarget: srv.URL,
		Secrets: []string{newSecret(t)},
	})

	require.Equal(t, 503, res.StatusCode)
	require.Equal(t, "HTTP 503", res.Reason)
	require.Equal(t, "HTTP 503: "+strings.Repeat("a", MaxResponseExcerpt), res.Error)
}

func TestNewRejectsInvalidConfig(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		mutate func(*config.Router)
		want   string
	}{
		{"concurrency", func(c *config.Router) { c.Concurrency = 0 }, "concurrency"},
		{"batch size", func(c *config.Router) { c.BatchSize = -1 }, "batch_size"},
		{"poll interval", func(c *config.Router) { c.PollInterval = 0 }, "poll_interval"},
		{"timeout", func(c *config.Router) { c.Timeout = 0 }, "timeout"},
		{"claim ttl", func(c *config.Router) { c.ClaimTTL = c.Timeout }, "claim_ttl"},
		{"per application concurrency", func(c *config.Router) { c.PerApplicationConcurrency = 0 }, "per_application_concurrency"},
		{"secret key", func(c *config.Router) { c.SecretKey = "c2hvcnQ=" }, "secret_key"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := compressedConfig()
			tt.mutate(&cfg)
			var msg string
			func() {
				defer func() { msg, _ = recover().(string) }()
				New(nil, cfg, nil)
			}()
			require.Contains(t, msg, tt.want)
		})
	}
}
