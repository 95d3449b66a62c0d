package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"time"

	"github.com/capstan-dev/capstan/internal/admission"
	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/pkg/adapter"
)

// WebhookTolerance is the timestamp window of signed webhook completions.
const WebhookTolerance = 5 * time.Minute

// CompletionHandler serves the webhook transport's completion endpoint
// (POST adapter.CompletionPath): the body is an adapter.InteractionCompletion
// signed per Standard Webhooks with the release's await secret. It verifies
// the resume token, then the signature (constant time, timestamp window),
// then admits the completion. Answers: 200 {"status","duplicate"}; 400
// malformed (the message names the field); 401 bad token or signature; 403
// another application; 404 unknown interaction; 409 late, conflicting or
// superseded; 503 database unavailable (retry).
type CompletionHandler struct {
	store    *pgstore.Store
	cfg      *config.Config
	admitter *admission.Admitter
	logger   *slog.Logger
	now      func() time.Time
}

// NewCompletionHandler returns the handler, or nil when no callback_secret
// is configured (no transport issues resume tokens then).
func NewCompletionHandler(store *pgstore.Store, cfg *config.Config, logger *slog.Logger) *CompletionHandler {
	a, err := admission.New(store, cfg)
	if err != nil {
		return nil
	}
	return &CompletionHandler{store: store, cfg: cfg, admitter: a, logger: logger, now: time.Now}
}

type completionAnswer struct {
	Status    string `json:"status,omitempty"`
	Duplicate bool   `json:"duplicate,omitempty"`
	Error     string `json:"error,omitempty"`
}

// ServeHTTP implements the endpoint.
func (h *CompletionHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		w.Header().Set("allow", http.MethodPost)
		h.answer(w, http.StatusMethodNotAllowed, completionAnswer{Error: "POST only"})
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, adapter.MaxCompletionBytes+1))
	if err != nil {
		h.answer(w, http.StatusBadRequest, completionAnswer{Error: "body: " + err.Error()})
		return
	}
	comp, err := adapter.DecodeCompletion(body)
	if err != nil {
		h.answer(w, http.StatusBadRequest, completionAnswer{Error: err.Error()})
		return
	}
	claims, err := h.admitter.Claims(comp.ResumeToken)
	if err != nil {
		h.fail(w, err)
		return
	}
	capability, err := h.store.InteractionCapability(r.Context(), claims.Subject)
	if err != nil {
		h.fail(w, err)
		return
	}
	cp, ok := h.cfg.Lookup(capability)
	if !ok || cp.AwaitStep() == nil || cp.AwaitStep().Transport != "webhook" {
		h.answer(w, http.StatusConflict, completionAnswer{Error: "the interaction's release does not use the webhook transport"})
		return
	}
	if err := adapter.VerifyWebhook(r.Header, cp.AwaitStep().Secret, body, h.now(), WebhookTolerance); err != nil {
		h.answer(w, http.StatusUnauthorized, completionAnswer{Error: "signature: " + err.Error()})
		return
	}
	res, err := h.admitter.Admit(r.Context(), comp)
	if err != nil {
		h.fail(w, err)
		return
	}
	h.answer(w, http.StatusOK, completionAnswer{Status: res.InteractionStatus, Duplicate: res.Duplicate})
}

func (h *CompletionHandler) fail(w http.ResponseWriter, err error) {
	var inv *execution.InvalidArgumentError
	code := http.StatusInternalServerError
	switch {
	case errors.As(err, &inv):
		code = http.StatusBadRequest
	case errors.Is(err, execution.ErrUnauthenticated):
		code = http.StatusUnauthorized
	case errors.Is(err, execution.ErrPermissionDenied):
		code = http.StatusForbidden
	case errors.Is(err, execution.ErrNotFound):
		code = http.StatusNotFound
	case errors.Is(err, execution.ErrCompletionRefused), errors.Is(err, execution.ErrLeaseLost), errors.Is(err, execution.ErrConflict):
		code = http.StatusConflict
	case errors.Is(err, execution.ErrUnavailable), errors.Is(err, context.DeadlineExceeded):
		code = http.StatusServiceUnavailable
	}
	msg := err.Error()
	if code == http.StatusInternalServerError {
		h.logger.Error("webhook completion failed", "error", err)
		msg = "internal error"
	} else {
		h.logger.Info("webhook completion refused", "code", code, "error", err)
	}
	h.answer(w, code, completionAnswer{Error: msg})
}

func (h *CompletionHandler) answer(w http.ResponseWriter, code int, a completionAnswer) {
	w.Header().Set("content-type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(a)
}
