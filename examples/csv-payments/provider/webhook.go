package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v5"

	"github.com/capstan-dev/capstan/pkg/adapter"
)

// Webhook transport limits and timing.
const (
	// requestsPath is where Capstan POSTs interaction requests.
	requestsPath = "/requests"
	// maxRequestBytes bounds a request body: Capstan's largest input
	// (16 MiB) base64-encoded in JSON, plus room for the envelope.
	maxRequestBytes = 24 << 20
	// webhookTolerance is the accepted clock skew of signed requests.
	webhookTolerance = 5 * time.Minute
	// postTimeout bounds one completion POST.
	postTimeout = 10 * time.Second
)

// errCompletionRefused is wrapped when the completion endpoint answers
// with a status that another try will not change (4xx other than 408 and
// 429): late, superseded, badly signed or unknown.
var errCompletionRefused = errors.New("completion refused")

// webhookTransport serves the webhook transport's requests (POST
// /requests, Standard Webhooks signed with the shared secret), answers 202
// at once and POSTs each completion, signed with the same secret, to the
// request's completion_url, retrying transient failures with backoff until
// the interaction's deadline.
type webhookTransport struct {
	p      *provider
	secret string
	client *http.Client
	logger *slog.Logger
	now    func() time.Time
	// work outlives the HTTP requests: answers run under it and it ends
	// a grace period after shutdown starts.
	work context.Context
	wg   sync.WaitGroup
}

// serveWebhook serves the webhook transport on lis until ctx ends, then
// stops accepting requests and lets answers in flight finish for up to
// cfg.grace(). It closes lis.
func serveWebhook(ctx context.Context, cfg config, p *provider, lis net.Listener, logger *slog.Logger) error {
	work, cancelWork := drainContext(ctx, cfg.grace())
	defer cancelWork()
	transport := http.DefaultTransport.(*http.Transport).Clone()
	transport.MaxIdleConnsPerHost = 64 // completions go to one gateway, many at once
	w := &webhookTransport{p: p, secret: cfg.WebhookSecret, logger: logger, now: time.Now, work: work,
		client: &http.Client{Transport: transport, Timeout: postTimeout,
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
	srv := &http.Server{Handler: w.handler(), ReadHeaderTimeout: 5 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(lis) }()
	logger.InfoContext(ctx, "webhook transport listening", slog.String("addr", lis.Addr().String()),
		slog.String("path", requestsPath))
	var err error
	select {
	case err = <-errc:
		err = fmt.Errorf("provider: webhook server: %w", err)
		cancelWork() // nobody is left to wait for
	case <-ctx.Done():
		sctx, stop := context.WithTimeout(context.WithoutCancel(ctx), adapter.ShutdownGrace)
		_ = srv.Shutdown(sctx) // handlers are quick; answers are awaited below
		stop()
		<-errc
	}
	w.wg.Wait() // bounded by work, which ends cfg.grace() after ctx
	w.client.CloseIdleConnections()
	return err
}

// handler serves POST /requests.
func (w *webhookTransport) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST "+requestsPath, w.handleRequest)
	return mux
}

// handleRequest verifies, parses and admits one request: 401 for a bad
// signature, 400 for a malformed request, 413 for one too large, 202 for
// an accepted request (also when it is a resend of one being or already
// answered, which is not answered twice).
func (w *webhookTransport) handleRequest(rw http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(http.MaxBytesReader(rw, r.Body, maxRequestBytes))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			w.reply(rw, http.StatusRequestEntityTooLarge, "request body too large")
			return
		}
		w.reply(rw, http.StatusBadRequest, "read body: "+err.Error())
		return
	}
	if err := adapter.VerifyWebhook(r.Header, w.secret, body, w.now(), webhookTolerance); err != nil {
		w.logger.WarnContext(r.Context(), "request refused: bad signature", slog.Any("error", err))
		w.reply(rw, http.StatusUnauthorized, "signature: "+err.Error())
		return
	}
	var req adapter.InteractionRequest
	if err := json.Unmarshal(body, &req); err != nil {
		w.reply(rw, http.StatusBadRequest, "body is not an interaction request: "+err.Error())
		return
	}
	if err := checkRequest(req, true); err != nil {
		w.reply(rw, http.StatusBadRequest, err.Error())
		return
	}
	if u, err := url.Parse(req.CompletionURL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		w.reply(rw, http.StatusBadRequest, "completion_url: want an http(s) URL")
		return
	}
	if w.p.admitInteraction(req, w.now()) {
		w.wg.Go(func() {
			_ = w.p.answer(w.work, req, w.post(req.CompletionURL, "cmpl_"+req.InteractionID))
		})
	} else {
		w.logger.DebugContext(r.Context(), "resent request ignored", slog.String("interaction_id", req.InteractionID))
	}
	w.reply(rw, http.StatusAccepted, "")
}

// webhookReply is the body of the provider's answers.
type webhookReply struct {
	Status string `json:"status,omitempty"`
	Error  string `json:"error,omitempty"`
}

func (w *webhookTransport) reply(rw http.ResponseWriter, code int, errMsg string) {
	rw.Header().Set("Content-Type", "application/json")
	rw.WriteHeader(code)
	a := webhookReply{Status: "accepted", Error: errMsg}
	if errMsg != "" {
		a.Status = ""
	}
	_ = json.NewEncoder(rw).Encode(a)
}

// completionAnswer is the completion endpoint's 200 body.
type completionAnswer struct {
	Status    string `json:"status"`
	Duplicate bool   `json:"duplicate"`
	Error     string `json:"error"`
}

// post returns a deliverFunc that POSTs a completion to completionURL,
// signed with the shared secret under message id msgID (the same for every
// try and copy: Standard Webhooks receivers may deduplicate by it). 5xx,
// 408, 429 and connection failures are retried with exponential backoff
// until ctx ends; other statuses wrap errCompletionRefused.
func (w *webhookTransport) post(completionURL, msgID string) deliverFunc {
	return func(ctx context.Context, c adapter.InteractionCompletion) (bool, error) {
		body, err := json.Marshal(c)
		if err != nil {
			return false, fmt.Errorf("encode completion: %w", err)
		}
		ans, err := backoff.Retry(ctx, func() (completionAnswer, error) {
			return w.postOnce(ctx, completionURL, msgID, body)
		}, backoff.WithBackOff(newBackOff()), backoff.WithMaxElapsedTime(0),
			backoff.WithNotify(func(err error, next time.Duration) {
				w.logger.InfoContext(ctx, "completion POST failed; retrying", slog.Any("error", err), slog.Duration("retry_in", next))
			}))
		if err != nil {
			return false, fmt.Errorf("post completion: %w", err)
		}
		return ans.Duplicate, nil
	}
}

// postOnce makes one signed POST; permanent failures are wrapped in
// backoff.Permanent.
func (w *webhookTransport) postOnce(ctx context.Context, completionURL, msgID string, body []byte) (completionAnswer, error) {
	var ans completionAnswer
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, completionURL, bytes.NewReader(body))
	if err != nil {
		return ans, backoff.Permanent(err)
	}
	hr.Header.Set("Content-Type", "application/json")
	if err := adapter.SignWebhook(hr.Header, w.secret, msgID, w.now(), body); err != nil {
		return ans, backoff.Permanent(err)
	}
	resp, err := w.client.Do(hr)
	if err != nil {
		return ans, err // connection refused, reset, timeout: transient
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if err != nil {
		return ans, fmt.Errorf("read answer: %w", err)
	}
	_ = json.Unmarshal(b, &ans) // best effort: only the 200 body matters
	switch code := resp.StatusCode; {
	case code >= 200 && code <= 299:
		return ans, nil
	case code >= 500, code == http.StatusRequestTimeout, code == http.StatusTooManyRequests:
		return ans, fmt.Errorf("status %d: %s", code, describe(ans.Error, b))
	default:
		return ans, backoff.Permanent(fmt.Errorf("%w: status %d: %s", errCompletionRefused, code, describe(ans.Error, b)))
	}
}

// describe returns msg, or a short excerpt of body when msg is empty.
func describe(msg string, body []byte) string {
	if msg != "" {
		return msg
	}
	s := strings.TrimSpace(string(body))
	if len(s) > 200 {
		s = s[:200] + "…"
	}
	return s
}

// newBackOff is the completion POSTs' retry schedule: 100ms doubling up to
// 5s, ±50% jitter.
func newBackOff() backoff.BackOff {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval = 100 * time.Millisecond
	b.MaxInterval = 5 * time.Second
	b.Multiplier = 2
	return b
}
