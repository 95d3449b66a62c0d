package gateway

import (
	"context"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/capstan-dev/capstan/internal/execution"
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
		md, _ := metadata.FromIncomingContext(ctx)
		vals := md.Get("authorization")
		if len(vals) != 1 {
			return nil, execution.ErrUnauthenticated
		}
		key, ok := strings.CutPrefix(vals[0], "Bearer ")
		if !ok || key == "" || len(key) > 512 {
			return nil, execution.ErrUnauthenticated
		}
		app, err := store.ApplicationByAPIKey(ctx, key)
		if err != nil {
			return nil, err
		}
		return h(context.WithValue(ctx, applicationKey{}, app), req)
	}
}
