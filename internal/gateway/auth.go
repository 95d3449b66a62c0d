package gateway

import (
	"context"
	"fmt"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/rpcerr"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
)

type applicationKey struct{}

// applicationFrom returns the authenticated application of ctx.
func applicationFrom(ctx context.Context) (pgstore.Application, bool) {
	a, ok := ctx.Value(applicationKey{}).(pgstore.Application)
	return a, ok
}

// authInterceptor authenticates every ExecutionService call by its
// "authorization: Bearer <api key>" metadata; health and reflection calls
// pass through.
func authInterceptor(store *pgstore.Store) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		if !strings.HasPrefix(info.FullMethod, "/capstan.execution.") {
			return h(ctx, req)
		}
		app, err := authenticate(ctx, store)
		if err != nil {
			return nil, err
		}
		return h(context.WithValue(ctx, applicationKey{}, app), req)
	}
}

// authenticate resolves the application of the call's
// "authorization: Bearer <api key>" metadata.
func authenticate(ctx context.Context, store *pgstore.Store) (pgstore.Application, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	vals := md.Get("authorization")
	if len(vals) != 1 {
		return pgstore.Application{}, fmt.Errorf("%w: want one \"authorization: Bearer <api key>\" metadata entry", execution.ErrUnauthenticated)
	}
	key, ok := strings.CutPrefix(vals[0], "Bearer ")
	if !ok || key == "" || len(key) > 512 {
		return pgstore.Application{}, fmt.Errorf("%w: authorization: want \"Bearer <api key>\"", execution.ErrUnauthenticated)
	}
	return store.ApplicationByAPIKey(ctx, key)
}

// authStreamInterceptor is authInterceptor for streaming calls
// (WatchExecution); errors are translated to gRPC codes here because no
// unary interceptor sees them.
func authStreamInterceptor(store *pgstore.Store) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		if !strings.HasPrefix(info.FullMethod, "/capstan.execution.") {
			return h(srv, ss)
		}
		app, err := authenticate(ss.Context(), store)
		if err != nil {
			return rpcerr.Status(err)
		}
		return h(srv, &authedStream{ServerStream: ss, ctx: context.WithValue(ss.Context(), applicationKey{}, app)})
	}
}

type authedStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *authedStream) Context() context.Context { return s.ctx }
