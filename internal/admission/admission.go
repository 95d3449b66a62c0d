// Package admission admits completions that arrive with a resume token —
// the webhook transport's HTTP endpoint and the kafka transport's response
// topic share it (SYSTEM §6, admission): the token is verified (HMAC,
// constant time, bound to application, execution, interaction and
// deadline), then the store admits the completion, first writer wins.
package admission

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/token"
	"github.com/capstan-dev/capstan/pkg/adapter"
)

// Admitter admits resume-token completions.
type Admitter struct {
	store  *pgstore.Store
	cfg    *config.Config
	signer *token.Signer
	now    func() time.Time
}

// New returns an admitter; it fails without a valid callback_secret.
func New(store *pgstore.Store, cfg *config.Config) (*Admitter, error) {
	key, err := base64.StdEncoding.DecodeString(cfg.CallbackSecret)
	if err != nil || cfg.CallbackSecret == "" {
		return nil, fmt.Errorf("callback_secret: required to verify resume tokens")
	}
	signer, err := token.NewSigner(key)
	if err != nil {
		return nil, fmt.Errorf("callback_secret: %w", err)
	}
	return &Admitter{store: store, cfg: cfg, signer: signer, now: time.Now}, nil
}

// Signer returns the signer that issues resume tokens.
func (a *Admitter) Signer() *token.Signer { return a.signer }

// Claims verifies a resume token. Errors wrap execution.ErrUnauthenticated.
func (a *Admitter) Claims(resumeToken string) (token.Claims, error) {
	c, err := a.signer.Verify(resumeToken, token.KindResume, a.now())
	if errors.Is(err, token.ErrExpired) {
		// Issued by us but past the interaction's deadline: a late completion.
		return c, fmt.Errorf("%w: resume token past the interaction's deadline", execution.ErrCompletionRefused)
	}
	if err != nil {
		return c, fmt.Errorf("%w: resume_token: %w", execution.ErrUnauthenticated, err)
	}
	return c, nil
}

// Admit verifies c's resume token and admits its outcome. Errors are the
// store's (execution.ErrCompletionRefused, ErrLeaseLost,
// ErrPermissionDenied, ErrNotFound, ErrUnavailable) or
// execution.ErrUnauthenticated for a bad token, and
// execution.InvalidArgumentError for a malformed outcome.
func (a *Admitter) Admit(ctx context.Context, c adapter.InteractionCompletion) (pgstore.CompleteResult, error) {
	claims, err := a.Claims(c.ResumeToken)
	if err != nil {
		return pgstore.CompleteResult{}, err
	}
	out, err := Outcome(c)
	if err != nil {
		return pgstore.CompleteResult{}, err
	}
	return a.store.CompleteInteraction(ctx, pgstore.CompleteParams{
		InteractionID: claims.Subject,
		ApplicationID: claims.ApplicationID,
		Outcome:       out,
		PolicyFor: func(name string) execution.Policy {
			if cp, ok := a.cfg.Lookup(name); ok {
				return cp.Policy()
			}
			return execution.DefaultPolicy()
		},
	})
}

// Outcome converts a completion's outcome, bounding its fields.
func Outcome(c adapter.InteractionCompletion) (execution.Outcome, error) {
	switch {
	case c.Result != nil:
		ct := c.Result.ContentType
		if ct == "" {
			ct = "application/json"
		}
		if len(ct) > 128 || !utf8.ValidString(ct) || strings.IndexByte(ct, 0) >= 0 {
			return execution.Outcome{}, &execution.InvalidArgumentError{Field: "result.content_type",
				Reason: "at most 128 bytes of UTF-8 without NUL"}
		}
		return execution.Outcome{Succeeded: true, Output: c.Result.Output, OutputType: ct}, nil
	case c.Failure != nil:
		if c.Failure.Class == "" {
			return execution.Outcome{}, &execution.InvalidArgumentError{Field: "failure.class", Reason: "required"}
		}
		return execution.Outcome{Failure: execution.Failure{Class: c.Failure.Class, Message: c.Failure.Message,
			Retryable: c.Failure.Retryable}.Bounded()}, nil
	}
	return execution.Outcome{}, &execution.InvalidArgumentError{Field: "outcome", Reason: "one of result and failure is required"}
}

// Permanent reports whether err is an answer that will not change on a
// retry — a refusal, a bad token, a malformed outcome, an unknown
// interaction — so the completion is dropped and counted. Every other error
// (the database unreachable, a deadlock, a timeout) is worth retrying.
func Permanent(err error) bool {
	var inv *execution.InvalidArgumentError
	return errors.Is(err, execution.ErrCompletionRefused) || errors.Is(err, execution.ErrLeaseLost) ||
		errors.Is(err, execution.ErrPermissionDenied) || errors.Is(err, execution.ErrNotFound) ||
		errors.Is(err, execution.ErrUnauthenticated) || errors.Is(err, execution.ErrConflict) || errors.As(err, &inv)
}
