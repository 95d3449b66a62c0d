package gateway

import (
	"google.golang.org/grpc"

	"github.com/capstan-dev/capstan/internal/daemon"
	"github.com/capstan-dev/capstan/internal/rpcerr"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
)

// NewServerForTest builds the gateway's gRPC server as Main does.
func NewServerForTest(svc *ExecutionService, store *pgstore.Store, maxInput int) *grpc.Server {
	h := daemon.NewHealth(store.Ping)
	return daemon.NewGRPCServer(h,
		grpc.ChainUnaryInterceptor(rpcerr.UnaryServerInterceptor(), authInterceptor(store)),
		grpc.ChainStreamInterceptor(authStreamInterceptor(store)),
		grpc.MaxRecvMsgSize(2*maxInput+1<<20))
}
