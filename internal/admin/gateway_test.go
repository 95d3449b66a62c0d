package admin_test

import (
	"context"
	"log/slog"
	"net"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/gateway"
	"github.com/capstan-dev/capstan/internal/testutil/pgtest"
	adminv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/admin/v1"
)

// freeAddr returns a loopback address that was free a moment ago.
func freeAddr(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := lis.Addr().String()
	require.NoError(t, lis.Close())
	return addr
}

// TestServedByGateway runs the gateway daemon and checks that it serves the
// admin API behind the operator token, and not at all without a token.
func TestServedByGateway(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDatabase(t, migrate)
	for _, tc := range []struct {
		name  string
		token string
		want  codes.Code
	}{
		{"with token", token, codes.OK},
		{"without token", "", codes.Unimplemented},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr := freeAddr(t)
			cfg := &config.Config{
				Database: config.Database{URL: url},
				Gateway:  config.Gateway{Listen: addr, AdminToken: tc.token, MaxInputBytes: 1 << 20},
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- gateway.Main(ctx, cfg, slog.New(slog.DiscardHandler)) }()
			t.Cleanup(func() {
				cancel()
				require.NoError(t, <-done)
			})
			conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
			require.NoError(t, err)
			t.Cleanup(func() { _ = conn.Close() })
			c := adminv1.NewAdminServiceClient(conn)

			call := func(tok string) error {
				cctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+tok)
				_, err := c.ListEventConsumers(cctx, &adminv1.ListEventConsumersRequest{}, grpc.WaitForReady(true))
				return err
			}
			if tc.want == codes.OK {
				require.NoError(t, call(token))
				requireCode(t, call("not-the-operator-token"), codes.Unauthenticated)
				return
			}
			requireCode(t, call(token), tc.want)
		})
	}
}
