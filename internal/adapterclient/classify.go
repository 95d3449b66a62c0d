package adapterclient

import (
	"context"
	"errors"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/capstan-dev/capstan/internal/execution"
	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
)

// Classify maps an adapter's answer (or the gRPC error of the call) to an
// attempt outcome. It is the one place where adapter answers and gRPC codes
// become failure classes:
//
//	answer / code                                     class                        retryable
//	result                                            —                            (success)
//	accepted                                          —                            (parks on an await unit)
//	failure                                           as the adapter reported      as reported
//	neither result nor failure                        adapter.protocol             yes
//	DEADLINE_EXCEEDED, context deadline               adapter.deadline_exceeded    yes
//	INVALID_ARGUMENT, FAILED_PRECONDITION,
//	UNIMPLEMENTED, PERMISSION_DENIED,
//	UNAUTHENTICATED, NOT_FOUND, OUT_OF_RANGE          adapter.rejected             no
//	anything else (UNAVAILABLE, INTERNAL, …)          adapter.unavailable          yes
func Classify(resp *adapterv1.ExecuteResponse, err error) execution.Outcome {
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return failed(execution.ClassAdapterDeadlineExceeded, "adapter did not answer before the attempt timeout", true)
		}
		st, _ := status.FromError(err)
		switch st.Code() {
		case codes.DeadlineExceeded:
			return failed(execution.ClassAdapterDeadlineExceeded, st.Message(), true)
		case codes.InvalidArgument, codes.FailedPrecondition, codes.Unimplemented, codes.PermissionDenied,
			codes.Unauthenticated, codes.NotFound, codes.OutOfRange:
			return failed(execution.ClassAdapterRejected, st.Code().String()+": "+st.Message(), false)
		default:
			return failed(execution.ClassAdapterUnavailable, st.Code().String()+": "+st.Message(), true)
		}
	}
	switch o := resp.GetOutcome().(type) {
	case *adapterv1.ExecuteResponse_Result:
		ct := o.Result.GetContentType()
		if ct == "" {
			ct = "application/json"
		}
		return execution.Outcome{Succeeded: true, Output: o.Result.GetOutput(), OutputType: ct}
	case *adapterv1.ExecuteResponse_Failure:
		return failed(o.Failure.GetClass(), o.Failure.GetMessage(), o.Failure.GetRetryable())
	case *adapterv1.ExecuteResponse_Accepted:
		// Bounded like a failure message: at a rune boundary, valid UTF-8,
		// no NUL, so the park can always store it.
		ref := execution.Failure{Class: "x", Message: o.Accepted.GetExternalReference()}.Bounded().Message
		if len(ref) > 256 {
			ref = strings.ToValidUTF8(ref[:256], "")
		}
		return execution.Outcome{Accepted: true, ExternalReference: ref}
	}
	return failed(execution.ClassAdapterProtocol, "adapter answered with neither a result nor a failure", true)
}

func failed(class, msg string, retryable bool) execution.Outcome {
	return execution.Outcome{Failure: execution.Failure{Class: class, Message: msg, Retryable: retryable}.Bounded()}
}
