package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/capstan-dev/capstan/pkg/adapter"
)

// minPruneAt is the smallest number of remembered interactions at which
// admitInteraction sweeps out those whose deadline passed.
const minPruneAt = 1024

// errInvalidRequest is wrapped when an interaction request lacks a field
// the provider needs to answer it.
var errInvalidRequest = errors.New("invalid interaction request")

// checkRequest reports the first missing field of req that answering
// needs: the interaction id (deduplication), the resume token (the
// completion) and, when needURL, the completion URL (webhook transport).
func checkRequest(req adapter.InteractionRequest, needURL bool) error {
	switch {
	case req.InteractionID == "":
		return fmt.Errorf("%w: interaction_id: required", errInvalidRequest)
	case req.ResumeToken == "":
		return fmt.Errorf("%w: resume_token: required", errInvalidRequest)
	case needURL && req.CompletionURL == "":
		return fmt.Errorf("%w: completion_url: required", errInvalidRequest)
	}
	return nil
}

// admitInteraction counts a received interaction request and reports
// whether it is new and must be answered. A request whose interaction is
// being answered or was answered (Capstan may send a request again) is
// counted as resent and not answered twice. Interactions are remembered
// until their deadline; past it Capstan refuses completions and never
// sends the request again, so they are swept out as the table grows.
func (p *provider) admitInteraction(req adapter.InteractionRequest, now time.Time) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	p.perID[req.ExecutionID]++
	if _, ok := p.interactions[req.InteractionID]; ok {
		p.resent++
		return false
	}
	if len(p.interactions) >= p.pruneAt {
		for id, e := range p.interactions {
			if !e.deadline.IsZero() && now.After(e.deadline) {
				delete(p.interactions, id)
			}
		}
		p.pruneAt = max(minPruneAt, 2*len(p.interactions))
	}
	p.interactions[req.InteractionID] = &interactionEntry{deadline: req.Deadline}
	return true
}

// interactionEntry is what the provider remembers of an interaction it
// answers or answered.
type interactionEntry struct {
	deadline time.Time
}

// forgetInteraction drops an interaction whose completion could not be
// delivered, so that a resent request is answered again, and counts it.
func (p *provider) forgetInteraction(id string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.interactions, id)
	p.dropped++
}

// countCompletion counts a delivered completion; duplicate says Capstan
// answered that it had admitted an identical one before.
func (p *provider) countCompletion(duplicate bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.completions++
	if duplicate {
		p.duplicateAcks++
	}
}

// decideInteraction decides an interaction request per the provider's
// rules (as Execute does for an attempt), the retryable draw keyed by the
// execution and interaction ids, and returns its completion.
func (p *provider) decideInteraction(req adapter.InteractionRequest) adapter.InteractionCompletion {
	v := decideInput(failInteractionRetryably(p.seed, req.ExecutionID, req.InteractionID, p.retryableFraction),
		req.ContentType, req.Request)
	c := adapter.InteractionCompletion{ResumeToken: req.ResumeToken, CorrelationID: req.CorrelationID}
	if v.succeeded {
		c.Result = &adapter.CompletionResult{Output: v.output, ContentType: "application/json"}
	} else {
		c.Failure = &adapter.CompletionFailure{Class: v.class, Message: v.message, Retryable: v.retryable}
	}
	return c
}

// deliverFunc delivers one completion over a transport; duplicate reports
// that Capstan answered it as a duplicate (webhook transport only).
type deliverFunc func(ctx context.Context, c adapter.InteractionCompletion) (duplicate bool, err error)

// answer answers an admitted interaction request: it waits the simulated
// latency, decides, and delivers the completion with deliver — twice with
// --duplicate-completions — before the request's deadline. An interaction
// whose completion was not delivered is forgotten (see forgetInteraction).
// It never logs the input or the output.
func (p *provider) answer(ctx context.Context, req adapter.InteractionRequest, deliver deliverFunc) error {
	if !req.Deadline.IsZero() {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, req.Deadline)
		defer cancel()
	}
	log := p.logger.With(slog.String("execution_id", req.ExecutionID), slog.String("interaction_id", req.InteractionID))
	err := p.sleep(ctx)
	if err == nil {
		c := p.decideInteraction(req)
		if f := c.Failure; f != nil {
			log.DebugContext(ctx, "payment failed", slog.String("class", f.Class), slog.Bool("retryable", f.Retryable))
		} else {
			log.DebugContext(ctx, "payment sent")
		}
		copies := 1
		if p.duplicateCompletions {
			copies = 2
		}
		for range copies {
			var dup bool
			if dup, err = deliver(ctx, c); err != nil {
				break
			}
			p.countCompletion(dup)
		}
	}
	if err != nil {
		p.forgetInteraction(req.InteractionID)
		log.WarnContext(ctx, "completion not delivered", slog.Any("error", err))
		return fmt.Errorf("answer interaction %s: %w", req.InteractionID, err)
	}
	return nil
}

// drainContext returns a context that is not cancelled with parent but
// grace after parent ends, so that work in flight at shutdown can finish;
// cancel ends it at once.
func drainContext(parent context.Context, grace time.Duration) (context.Context, context.CancelFunc) {
	ctx, cancelCtx := context.WithCancel(context.WithoutCancel(parent))
	stop := context.AfterFunc(parent, func() {
		t := time.AfterFunc(grace, cancelCtx)
		context.AfterFunc(ctx, func() { t.Stop() })
	})
	return ctx, func() { stop(); cancelCtx() }
}
