// Package gateway implements cmd/gateway: the ExecutionService that
// applications call (SYSTEM §4 hop 1). It authenticates the application,
// validates the call, commits the execution and its first dispatch record
// in one transaction, answers only after the commit, and nudges the
// dispatcher on a best-effort basis.
package gateway

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/capstan-dev/capstan/internal/adapterclient"
	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/rpcerr"
	"github.com/capstan-dev/capstan/internal/steps"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/telemetry"
	executionv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/execution/v1"
)

// DefaultContentType is used when InvokeCapability gives none.
const DefaultContentType = "application/json"

// ExecutionService implements executionv1.ExecutionServiceServer.
type ExecutionService struct {
	executionv1.UnimplementedExecutionServiceServer
	store    *pgstore.Store
	adapters *adapterclient.Pool
	owner    string // lease owner of SYNC attempts
	cfg      *config.Config
	nudge    func()
	logger   *slog.Logger
	mp       metric.MeterProvider
	accepted metric.Int64Counter
}

// NewExecutionService returns the service; nudge (may be nil) is called
// after every commit of new work; a nil logger discards.
func NewExecutionService(store *pgstore.Store, cfg *config.Config, nudge func(), logger *slog.Logger, opts ...ServiceOption) *ExecutionService {
	if nudge == nil {
		nudge = func() {}
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	host, _ := os.Hostname()
	s := &ExecutionService{store: store, cfg: cfg, nudge: nudge, logger: logger, adapters: adapterclient.NewPool(),
		owner: fmt.Sprintf("gateway-%s-%d", host, os.Getpid())}
	for _, o := range opts {
		o(s)
	}
	if err := s.initMetrics(); err != nil {
		logger.Warn("metrics not fully registered", "error", err)
	}
	return s
}

// Close releases the adapter connections of SYNC releases.
func (s *ExecutionService) Close() { s.adapters.Close() }

// requestHash identifies "the same request" for an idempotency key:
// SHA-256 over capability, content type and input, NUL-separated.
func requestHash(capability, contentType string, input []byte) []byte {
	h := sha256.New()
	h.Write([]byte(capability))
	h.Write([]byte{0})
	h.Write([]byte(contentType))
	h.Write([]byte{0})
	h.Write(input)
	return h.Sum(nil)
}

// InvokeCapability implements SYSTEM §4 hop 1; see the proto for codes.
func (s *ExecutionService) InvokeCapability(ctx context.Context, req *executionv1.InvokeCapabilityRequest) (*executionv1.InvokeCapabilityResponse, error) {
	app, ok := applicationFrom(ctx)
	if !ok {
		return nil, execution.ErrUnauthenticated
	}
	if err := checkText("capability", req.GetCapability(), true, maxCapabilityBytes); err != nil {
		return nil, err
	}
	if err := checkText("content_type", req.GetContentType(), false, maxContentTypeBytes); err != nil {
		return nil, err
	}
	if err := checkText("idempotency_key", req.GetIdempotencyKey(), false, maxIdempotencyBytes); err != nil {
		return nil, err
	}
	if n := len(req.GetInput()); n > s.cfg.Gateway.MaxInputBytes {
		return nil, &execution.InvalidArgumentError{Field: "input",
			Reason: fmt.Sprintf("%d bytes, at most %d allowed", n, s.cfg.Gateway.MaxInputBytes)}
	}
	capb, ok := s.cfg.Lookup(req.GetCapability())
	if !ok {
		return nil, fmt.Errorf("%w: %q", execution.ErrUnknownCapability, req.GetCapability())
	}
	if capb.Steps != nil {
		// A release declared as steps takes {"source": …, "output": …}:
		// refuse anything else here, naming the field, rather than fail
		// the execution later.
		in, err := steps.ParseInput(req.GetInput())
		if err != nil {
			return nil, err
		}
		if err := steps.CheckOwner(in, app.Name); err != nil {
			return nil, err
		}
	}
	policy := capb.Policy()
	contentType := req.GetContentType()
	if contentType == "" {
		contentType = DefaultContentType
	}
	status, leaseFor := execution.StatusQueued, time.Duration(0)
	if policy.Mode == execution.ModeSync {
		status, leaseFor = execution.StatusRunning, policy.AttemptTimeout+policy.LeaseDuration
	}
	e, created, err := s.store.ExecutionInsert(ctx, pgstore.ExecutionInsertParams{
		ApplicationID:  app.ID,
		Capability:     capb.Name,
		Release:        capb.Release,
		Mode:           policy.Mode,
		MaxAttempts:    policy.MaxAttempts,
		Input:          req.GetInput(),
		ContentType:    contentType,
		IdempotencyKey: req.GetIdempotencyKey(),
		RequestHash:    requestHash(capb.Name, contentType, req.GetInput()),
		AsyncBudget:    policy.AsyncBudget,
		Status:         status,
		LeaseOwner:     s.owner,
		LeaseFor:       leaseFor,
		// The RPC's span (otelgrpc): dispatch, attempts and the completion
		// event continue its trace.
		TraceContext: telemetry.Traceparent(ctx),
	})
	if err != nil {
		if !errors.Is(err, execution.ErrIdempotencyConflict) {
			s.logger.Warn("invoke not accepted", "application_id", app.ID, "capability", capb.Name, "error", err)
		}
		return nil, err
	}
	acceptance := executionv1.InvokeAcceptance_INVOKE_ACCEPTANCE_DUPLICATE
	label := "duplicate"
	if created {
		label = "accepted"
	}
	s.accepted.Add(ctx, 1, metric.WithAttributes(attribute.String("capability", capb.Name),
		attribute.String("mode", string(policy.Mode)), attribute.String("acceptance", label)))
	if created {
		acceptance = executionv1.InvokeAcceptance_INVOKE_ACCEPTANCE_ACCEPTED
		if policy.Mode == execution.ModeSync {
			if e, err = s.executeSync(ctx, e, capb.Adapter, policy); err != nil {
				return nil, err
			}
		} else {
			s.nudge()
		}
	}
	return &executionv1.InvokeCapabilityResponse{
		ExecutionId: e.ID.String(),
		Acceptance:  acceptance,
		Status:      pgstore.StatusToProto(e.Status),
		Execution:   ToProto(e),
	}, nil
}

// GetExecution returns one execution of the calling application.
func (s *ExecutionService) GetExecution(ctx context.Context, req *executionv1.GetExecutionRequest) (*executionv1.GetExecutionResponse, error) {
	app, ok := applicationFrom(ctx)
	if !ok {
		return nil, execution.ErrUnauthenticated
	}
	id, err := uuid.Parse(req.GetExecutionId())
	if err != nil {
		return nil, &execution.InvalidArgumentError{Field: "execution_id", Reason: "not a UUID"}
	}
	if app.ID == uuid.Nil { // never: uuid.Nil would disable the tenancy filter
		return nil, execution.ErrUnauthenticated
	}
	e, err := s.store.ExecutionGet(ctx, app.ID, id)
	if err != nil {
		return nil, err
	}
	return &executionv1.GetExecutionResponse{Execution: s.withAwait(ctx, e)}, nil
}

// withAwait maps e to its API form with its await unit's state.
func (s *ExecutionService) withAwait(ctx context.Context, e execution.Execution) *executionv1.Execution {
	out := ToProto(e)
	if e.AwaitUnitID != uuid.Nil {
		if u, err := s.store.AwaitUnitGet(ctx, e.AwaitUnitID); err == nil {
			out.Await = &executionv1.AwaitState{AwaitUnitId: u.ID.String(), Transport: u.Transport, Status: u.Status,
				Deadline: timestamppb.New(u.Deadline)}
		}
	}
	return out
}

// WatchInterval is how often WatchExecution looks for changes.
const WatchInterval = 200 * time.Millisecond

// WatchExecution streams the execution at once and on every change of its
// version, until it is terminal or the caller goes away.
func (s *ExecutionService) WatchExecution(req *executionv1.WatchExecutionRequest, stream executionv1.ExecutionService_WatchExecutionServer) error {
	ctx := stream.Context()
	app, ok := applicationFrom(ctx)
	if !ok || app.ID == uuid.Nil {
		return rpcStatus(execution.ErrUnauthenticated)
	}
	id, err := uuid.Parse(req.GetExecutionId())
	if err != nil {
		return rpcStatus(&execution.InvalidArgumentError{Field: "execution_id", Reason: "not a UUID"})
	}
	var last int64 = -1
	t := time.NewTicker(WatchInterval)
	defer t.Stop()
	for {
		e, err := s.store.ExecutionGet(ctx, app.ID, id)
		if err != nil {
			return rpcStatus(err)
		}
		if e.Version != last {
			last = e.Version
			if err := stream.Send(&executionv1.WatchExecutionResponse{Execution: s.withAwait(ctx, e)}); err != nil {
				return err
			}
		}
		if e.Status.Terminal() {
			return nil
		}
		select {
		case <-ctx.Done():
			return rpcStatus(ctx.Err())
		case <-t.C:
		}
	}
}

// ToProto maps a stored execution to its API form.
func ToProto(e execution.Execution) *executionv1.Execution {
	out := &executionv1.Execution{
		ExecutionId:       e.ID.String(),
		Capability:        e.Capability,
		Release:           e.Release,
		Status:            pgstore.StatusToProto(e.Status),
		Attempts:          int32(e.Attempt),
		IdempotencyKey:    e.IdempotencyKey,
		CreatedAt:         timestamppb.New(e.CreatedAt),
		UpdatedAt:         timestamppb.New(e.UpdatedAt),
		Output:            e.Output,
		OutputContentType: e.OutputType,
		ProgressPercent:   int32(e.ProgressPercent),
		ProgressMessage:   e.ProgressMessage,
	}
	if !e.SettledAt.IsZero() {
		out.SettledAt = timestamppb.New(e.SettledAt)
	}
	if e.Failure != nil && e.Status.Terminal() {
		out.Failure = &executionv1.Failure{Class: e.Failure.Class, Reason: e.Failure.Reason, Message: e.Failure.Message}
	}
	return out
}

// maxCancelReasonBytes bounds CancelExecutionRequest.reason.
const maxCancelReasonBytes = 1024

// ClassCancelled is the failure class of a cancelled execution.
const ClassCancelled = "execution.cancelled"

// CancelExecution settles the execution CANCELLED (SYSTEM §3: any
// non-terminal → terminal, guarded by the version as read). When a
// concurrent writer moves the execution between the read and the
// settlement, it reads again, up to a few times.
func (s *ExecutionService) CancelExecution(ctx context.Context, req *executionv1.CancelExecutionRequest) (*executionv1.CancelExecutionResponse, error) {
	app, ok := applicationFrom(ctx)
	if !ok || app.ID == uuid.Nil {
		return nil, execution.ErrUnauthenticated
	}
	id, err := uuid.Parse(req.GetExecutionId())
	if err != nil {
		return nil, &execution.InvalidArgumentError{Field: "execution_id", Reason: "not a UUID"}
	}
	if err := checkText("reason", req.GetReason(), false, maxCancelReasonBytes); err != nil {
		return nil, err
	}
	msg := req.GetReason()
	if msg == "" {
		msg = "cancelled by the application"
	}
	for range 5 {
		e, err := s.store.ExecutionGet(ctx, app.ID, id)
		if err != nil {
			return nil, err
		}
		if e.Status == execution.StatusCancelled {
			return &executionv1.CancelExecutionResponse{Execution: ToProto(e)}, nil
		}
		if e.Status.Terminal() {
			return nil, fmt.Errorf("%w: execution %s already settled as %s", execution.ErrConflict, id, e.Status)
		}
		settled, err := s.store.ExecutionSettle(ctx, pgstore.SettleParams{
			ExecutionID: id, Fence: pgstore.Fence{Version: e.Version, Attempt: e.Attempt},
			Status:  execution.StatusCancelled,
			Failure: &execution.Failure{Class: ClassCancelled, Reason: execution.ReasonByCaller, Message: msg},
			// A running attempt is closed as abandoned: its later answer is fenced out.
			AttemptOutcome: "ABANDONED",
		})
		if errors.Is(err, execution.ErrConflict) {
			continue // moved meanwhile: read again
		}
		if err != nil {
			return nil, err
		}
		s.logger.Info("execution cancelled", "execution_id", id, "application_id", app.ID)
		return &executionv1.CancelExecutionResponse{Execution: ToProto(settled)}, nil
	}
	return nil, fmt.Errorf("%w: execution %s kept changing; try again", execution.ErrUnavailable, id)
}

// rpcStatus translates errors of streaming handlers, which the unary
// interceptor does not see.
func rpcStatus(err error) error { return rpcerr.Status(err) }
