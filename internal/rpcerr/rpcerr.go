// Package rpcerr translates domain errors into gRPC status codes. It is the
// only place that does: handlers return domain errors (wrapped with %w) and
// the interceptor here turns them into codes.
package rpcerr

import (
	"context"
	"errors"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/capstan-dev/capstan/internal/execution"
)

// Code returns the gRPC code for err.
func Code(err error) codes.Code {
	var inv *execution.InvalidArgumentError
	switch {
	case err == nil:
		return codes.OK
	case errors.As(err, &inv):
		return codes.InvalidArgument
	case errors.Is(err, execution.ErrUnauthenticated):
		return codes.Unauthenticated
	case errors.Is(err, execution.ErrNotFound), errors.Is(err, execution.ErrUnknownCapability):
		return codes.NotFound
	case errors.Is(err, execution.ErrIdempotencyConflict):
		return codes.AlreadyExists
	case errors.Is(err, execution.ErrConflict), errors.Is(err, execution.ErrLeaseLost),
		errors.Is(err, execution.ErrCompletionRefused):
		return codes.FailedPrecondition
	case errors.Is(err, execution.ErrPermissionDenied):
		return codes.PermissionDenied
	case errors.Is(err, execution.ErrUnavailable):
		return codes.Unavailable
	case errors.Is(err, context.DeadlineExceeded):
		return codes.DeadlineExceeded
	case errors.Is(err, context.Canceled):
		return codes.Canceled
	}
	if s, ok := status.FromError(err); ok {
		return s.Code()
	}
	return codes.Internal
}

// Status converts err to a gRPC status error. Internal errors get a generic
// message so that no SQL or internals leak to callers; the rest keep their
// message, which names the field or the object.
func Status(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	c := Code(err)
	msg := err.Error()
	switch c {
	case codes.Internal:
		msg = "internal error"
	case codes.Unavailable:
		msg = "temporarily unavailable; retry with the same idempotency key"
	}
	return status.Error(c, msg)
}

// UnaryServerInterceptor translates handler errors with Status.
func UnaryServerInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		resp, err := h(ctx, req)
		return resp, Status(err)
	}
}
