package consumer

import (
	"context"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
)

// adapterPool keeps one gRPC client connection per adapter address.
type adapterPool struct {
	mu    sync.Mutex
	conns map[string]*grpc.ClientConn
}

func newAdapterPool() *adapterPool { return &adapterPool{conns: map[string]*grpc.ClientConn{}} }

func (p *adapterPool) client(addr string) (adapterv1.AdapterServiceClient, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if cc, ok := p.conns[addr]; ok {
		return adapterv1.NewAdapterServiceClient(cc), nil
	}
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	p.conns[addr] = cc
	return adapterv1.NewAdapterServiceClient(cc), nil
}

// execute calls Execute on the adapter at addr.
func (p *adapterPool) execute(ctx context.Context, addr string, req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
	cl, err := p.client(addr)
	if err != nil {
		return nil, err
	}
	return cl.Execute(ctx, req)
}

func (p *adapterPool) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for addr, cc := range p.conns {
		_ = cc.Close()
		delete(p.conns, addr)
	}
}
