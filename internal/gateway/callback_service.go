package gateway

import (
	"context"
	"fmt"
	"log/slog"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/capstan-dev/capstan/internal/admission"
	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/token"
	"github.com/capstan-dev/capstan/pkg/adapter"
	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
	callbackv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/callback/v1"
)

// CallbackService implements callbackv1.AdapterCallbackServiceServer
// (SYSTEM §4 hop 4): RenewLease, ReportProgress and CompleteExecution,
// each authenticated by the adapter's key and the attempt's callback
// token. Refusals change nothing; their codes are documented on the proto.
type CallbackService struct {
	callbackv1.UnimplementedAdapterCallbackServiceServer
	store  *pgstore.Store
	cfg    *config.Config
	auth   *adapterAuth
	logger *slog.Logger
}

// NewCallbackService returns the service. It fails when an adapter key
// hash or the callback secret does not decode.
func NewCallbackService(store *pgstore.Store, cfg *config.Config, logger *slog.Logger) (*CallbackService, error) {
	auth, err := newAdapterAuth(cfg)
	if err != nil {
		return nil, err
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &CallbackService{store: store, cfg: cfg, auth: auth, logger: logger}, nil
}

// attempt authenticates the caller, verifies the token and loads the
// execution it names, checking the adapter serves its capability.
func (s *CallbackService) attempt(ctx context.Context, tok string) (token.Claims, execution.Execution, map[string]bool, error) {
	caps, err := s.auth.capabilities(ctx)
	if err != nil {
		return token.Claims{}, execution.Execution{}, nil, err
	}
	c, err := s.auth.callback(tok)
	if err != nil {
		return token.Claims{}, execution.Execution{}, nil, err
	}
	e, err := s.store.ExecutionGet(ctx, c.ApplicationID, c.ExecutionID)
	if err != nil {
		return c, e, nil, err
	}
	if !caps[e.Capability] {
		return c, e, nil, fmt.Errorf("%w: this adapter does not serve %q", execution.ErrPermissionDenied, e.Capability)
	}
	if e.Mode == execution.ModeSync {
		return c, e, nil, fmt.Errorf("%w: execution %s is SYNC; only the gateway settles it", execution.ErrCompletionRefused, e.ID)
	}
	return c, e, caps, nil
}

// RenewLease extends the attempt's lease by the release's lease duration.
func (s *CallbackService) RenewLease(ctx context.Context, req *callbackv1.RenewLeaseRequest) (*callbackv1.RenewLeaseResponse, error) {
	c, e, _, err := s.attempt(ctx, req.GetCallbackToken())
	if err != nil {
		return nil, err
	}
	exp, err := s.store.LeaseRenew(ctx, e.ID, c.Attempt, c.Subject, policyFor(s.cfg)(e.Capability).LeaseDuration)
	if err != nil {
		return nil, err
	}
	return &callbackv1.RenewLeaseResponse{LeaseExpiresAt: timestamppb.New(exp)}, nil
}

// ReportProgress stores a progress report.
func (s *CallbackService) ReportProgress(ctx context.Context, req *callbackv1.ReportProgressRequest) (*callbackv1.ReportProgressResponse, error) {
	if p := req.GetPercent(); p < 0 || p > 100 {
		return nil, &execution.InvalidArgumentError{Field: "percent", Reason: fmt.Sprintf("%d: want 0..100", p)}
	}
	if err := checkText("message", req.GetMessage(), false, 1024); err != nil {
		return nil, err
	}
	c, e, _, err := s.attempt(ctx, req.GetCallbackToken())
	if err != nil {
		return nil, err
	}
	if err := s.store.ExecutionProgress(ctx, e.ID, c.Attempt, c.Subject, int(req.GetPercent()), req.GetMessage()); err != nil {
		return nil, err
	}
	return &callbackv1.ReportProgressResponse{}, nil
}

// CompleteExecution admits the attempt's completion (first writer wins).
func (s *CallbackService) CompleteExecution(ctx context.Context, req *callbackv1.CompleteExecutionRequest) (*callbackv1.CompleteExecutionResponse, error) {
	out, err := outcomeOf(req.GetResult(), req.GetFailure())
	if err != nil {
		return nil, err
	}
	c, e, caps, err := s.attempt(ctx, req.GetCallbackToken())
	if err != nil {
		return nil, err
	}
	cp, _ := s.cfg.Lookup(e.Capability)
	res, err := s.store.CompleteInteraction(ctx, pgstore.CompleteParams{
		Open: &pgstore.AwaitOpen{ExecutionID: e.ID, ApplicationID: e.ApplicationID, Attempt: c.Attempt,
			Step: pgstore.StepAdapter, Capability: e.Capability, Transport: pgstore.TransportInteractionAPI,
			Timeout: cp.AwaitDeadline(), Request: e.Input, ContentType: e.ContentType},
		Fence:         &pgstore.Fence{Attempt: c.Attempt, LeaseToken: c.Subject},
		ApplicationID: c.ApplicationID,
		Capabilities:  caps,
		Outcome:       out,
		PolicyFor:     policyFor(s.cfg),
	})
	if err != nil {
		s.logger.Info("completion refused", "execution_id", e.ID, "attempt", c.Attempt, "error", err)
		return nil, err
	}
	return &callbackv1.CompleteExecutionResponse{Status: pgstore.StatusToProto(res.Execution.Status), Duplicate: res.Duplicate}, nil
}

// outcomeOf validates a gRPC completion's outcome: the gRPC edge refuses
// what the await transports would only bound (an over-long output, class or
// message, invalid UTF-8, NUL), then admission.Outcome, shared with the
// webhook and kafka transports, builds it.
func outcomeOf(r *adapterv1.Result, f *adapterv1.Failure) (execution.Outcome, error) {
	var c adapter.InteractionCompletion
	switch {
	case r != nil:
		if len(r.GetOutput()) > maxOutputBytes {
			return execution.Outcome{}, &execution.InvalidArgumentError{Field: "result.output",
				Reason: fmt.Sprintf("%d bytes, at most %d allowed", len(r.GetOutput()), maxOutputBytes)}
		}
		c.Result = &adapter.CompletionResult{Output: r.GetOutput(), ContentType: r.GetContentType()}
	case f != nil:
		if err := checkText("failure.class", f.GetClass(), true, execution.MaxClassBytes); err != nil {
			return execution.Outcome{}, err
		}
		if err := checkText("failure.message", f.GetMessage(), false, execution.MaxMessageBytes); err != nil {
			return execution.Outcome{}, err
		}
		c.Failure = &adapter.CompletionFailure{Class: f.GetClass(), Message: f.GetMessage(), Retryable: f.GetRetryable()}
	}
	return admission.Outcome(c)
}

// maxOutputBytes bounds a completion's output (4 MiB).
const maxOutputBytes = 4 << 20
