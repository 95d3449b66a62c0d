package dispatcher

import (
	"context"

	dispatchv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/dispatch/v1"
)

// NudgeServer implements DispatcherService over a Dispatcher.
type NudgeServer struct {
	dispatchv1.UnimplementedDispatcherServiceServer
	d *Dispatcher
}

// NewNudgeServer returns the gRPC service that nudges d.
func NewNudgeServer(d *Dispatcher) *NudgeServer { return &NudgeServer{d: d} }

// Nudge requests a pass now. It never fails.
func (s *NudgeServer) Nudge(context.Context, *dispatchv1.NudgeRequest) (*dispatchv1.NudgeResponse, error) {
	s.d.Nudge()
	return &dispatchv1.NudgeResponse{}, nil
}
