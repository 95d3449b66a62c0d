// Package adapterclient keeps gRPC connections to adapters and calls
// AdapterService.Execute; the consumer (ASYNC) and the gateway (SYNC) share
// it.
package adapterclient

import (
	"context"
	"fmt"
	"sync"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
)

// Pool keeps one gRPC client connection per adapter address. It is safe
// for concurrent use.
type Pool struct {
	mu    sync.Mutex
	conns map[string]*grpc.ClientConn
}

// NewPool returns an empty pool; call Close when done.
func NewPool() *Pool { return &Pool{conns: map[string]*grpc.ClientConn{}} }

func (p *Pool) client(addr string) (adapterv1.AdapterServiceClient, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if cc, ok := p.conns[addr]; ok {
		return adapterv1.NewAdapterServiceClient(cc), nil
	}
	// The otelgrpc client handler makes a span per call and carries the
	// caller's trace context to the adapter in the gRPC metadata.
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithStatsHandler(otelgrpc.NewClientHandler()))
	if err != nil {
		return nil, fmt.Errorf("adapter client %s: %w", addr, err)
	}
	p.conns[addr] = cc
	return adapterv1.NewAdapterServiceClient(cc), nil
}

// Execute calls Execute on the adapter at addr (host:port), as a client
// span child of the span in ctx. Errors are the call's gRPC errors,
// unchanged, for Classify.
func (p *Pool) Execute(ctx context.Context, addr string, req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
	cl, err := p.client(addr)
	if err != nil {
		return nil, err
	}
	return cl.Execute(ctx, req)
}

// Close closes every connection.
func (p *Pool) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for addr, cc := range p.conns {
		_ = cc.Close()
		delete(p.conns, addr)
	}
}
