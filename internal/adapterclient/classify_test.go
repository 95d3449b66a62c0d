package adapterclient

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/capstan-dev/capstan/internal/execution"
	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestClassify(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		resp      *adapterv1.ExecuteResponse
		err       error
		succeeded bool
		class     string
		retryable bool
	}{
		{"result", &adapterv1.ExecuteResponse{Outcome: &adapterv1.ExecuteResponse_Result{Result: &adapterv1.Result{Output: []byte("{}")}}}, nil, true, "", false},
		{"declared terminal", &adapterv1.ExecuteResponse{Outcome: &adapterv1.ExecuteResponse_Failure{Failure: &adapterv1.Failure{Class: "payment.declined"}}}, nil, false, "payment.declined", false},
		{"declared retryable", &adapterv1.ExecuteResponse{Outcome: &adapterv1.ExecuteResponse_Failure{Failure: &adapterv1.Failure{Class: "provider.unavailable", Retryable: true}}}, nil, false, "provider.unavailable", true},
		{"empty answer", &adapterv1.ExecuteResponse{}, nil, false, execution.ClassAdapterProtocol, true},
		{"unavailable", nil, status.Error(codes.Unavailable, "down"), false, execution.ClassAdapterUnavailable, true},
		{"internal", nil, status.Error(codes.Internal, "boom"), false, execution.ClassAdapterUnavailable, true},
		{"deadline code", nil, status.Error(codes.DeadlineExceeded, "slow"), false, execution.ClassAdapterDeadlineExceeded, true},
		{"deadline ctx", nil, fmt.Errorf("call: %w", context.DeadlineExceeded), false, execution.ClassAdapterDeadlineExceeded, true},
		{"invalid argument", nil, status.Error(codes.InvalidArgument, "bad"), false, execution.ClassAdapterRejected, false},
		{"unimplemented", nil, status.Error(codes.Unimplemented, "no"), false, execution.ClassAdapterRejected, false},
		{"plain error", nil, errors.New("dial tcp: refused"), false, execution.ClassAdapterUnavailable, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			out := Classify(tc.resp, tc.err)
			require.Equal(t, tc.succeeded, out.Succeeded)
			if !tc.succeeded {
				require.Equal(t, tc.class, out.Failure.Class)
				require.Equal(t, tc.retryable, out.Failure.Retryable)
			} else {
				require.Equal(t, "application/json", out.OutputType)
			}
		})
	}
}
