package gateway

import (
	"context"
	"log/slog"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	dispatchv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/dispatch/v1"
)

// nudger sends best-effort nudges to the dispatcher. Nudges coalesce: at
// most one is in flight, and a request made meanwhile is sent after it.
// A lost nudge only delays work until the dispatcher's next scheduled pass.
type nudger struct {
	client  dispatchv1.DispatcherServiceClient
	conn    *grpc.ClientConn
	timeout time.Duration
	logger  *slog.Logger
	pending chan struct{}
}

func newNudger(addr string, timeout time.Duration, logger *slog.Logger) (*nudger, error) {
	if addr == "" {
		return nil, nil
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	return &nudger{client: dispatchv1.NewDispatcherServiceClient(conn), conn: conn, timeout: timeout,
		logger: logger, pending: make(chan struct{}, 1)}, nil
}

// Nudge requests a nudge without blocking.
func (n *nudger) Nudge() {
	if n == nil {
		return
	}
	select {
	case n.pending <- struct{}{}:
	default: // one is already pending: coalesce
	}
}

// run sends pending nudges until ctx ends.
func (n *nudger) run(ctx context.Context) error {
	if n == nil {
		<-ctx.Done()
		return nil
	}
	defer n.conn.Close()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-n.pending:
		}
		nctx, cancel := context.WithTimeout(ctx, n.timeout)
		_, err := n.client.Nudge(nctx, &dispatchv1.NudgeRequest{})
		cancel()
		if err != nil && ctx.Err() == nil {
			n.logger.Debug("nudge lost; the scheduled pass will dispatch", "error", err)
		}
	}
}
