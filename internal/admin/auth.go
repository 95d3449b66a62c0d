package admin

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/capstan-dev/capstan/internal/execution"
)

// servicePrefix starts the full method name of every AdminService RPC.
const servicePrefix = "/capstan.admin.v1.AdminService/"

// maxTokenBytes bounds a presented token.
const maxTokenBytes = 1024

// AuthInterceptor authenticates AdminService calls by their
// "authorization: Bearer <token>" metadata against token, in constant time
// (SHA-256 of both, then subtle.ConstantTimeCompare); other services pass
// through untouched. A missing, malformed or wrong token, or an empty
// configured token, is refused with execution.ErrUnauthenticated
// (UNAUTHENTICATED once rpcerr translates it).
func AuthInterceptor(token string) grpc.UnaryServerInterceptor {
	want := sha256.Sum256([]byte(token))
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		if !strings.HasPrefix(info.FullMethod, servicePrefix) {
			return h(ctx, req)
		}
		if !authorized(ctx, token != "", want) {
			return nil, execution.ErrUnauthenticated
		}
		return h(ctx, req)
	}
}

func authorized(ctx context.Context, configured bool, want [sha256.Size]byte) bool {
	md, _ := metadata.FromIncomingContext(ctx)
	vals := md.Get("authorization")
	if len(vals) != 1 || len(vals[0]) > maxTokenBytes {
		return false
	}
	got, ok := strings.CutPrefix(vals[0], "Bearer ")
	if !ok || got == "" {
		return false
	}
	sum := sha256.Sum256([]byte(got))
	return subtle.ConstantTimeCompare(sum[:], want[:]) == 1 && configured
}
