package ctl_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"

	"github.com/capstan-dev/capstan/internal/admin"
	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/ctl"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/rpcerr"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/testutil/pgtest"
)

const token = "operator-token-0123456789"

type bundle struct {
	store *pgstore.Store
	addr  string
}

func migrate(ctx context.Context, url string) error {
	_, err := pgstore.Migrate(ctx, url, nil)
	return err
}

// setup serves the admin API as the gateway does, on loopback.
func setup(t *testing.T) bundle {
	t.Helper()
	url := pgtest.NewDatabase(t, migrate)
	st, err := pgstore.Open(context.Background(), url, nil)
	require.NoError(t, err)
	t.Cleanup(st.Close)
	cfg := &config.Config{Gateway: config.Gateway{AdminToken: token}}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(rpcerr.UnaryServerInterceptor(), admin.AuthInterceptor(token)))
	require.NoError(t, admin.Register(srv, st, cfg, slog.New(slog.DiscardHandler)))
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return bundle{store: st, addr: lis.Addr().String()}
}

// run runs capstanctl against the bundle's admin API.
func (b bundle) run(t *testing.T, args ...string) (string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	args = append(args, "--admin-addr", b.addr, "--admin-token", token)
	err := ctl.Main(t.Context(), args, &out, &errOut)
	return out.String(), err
}

func newSecret(t testing.TB) string {
	t.Helper()
	k := make([]byte, 32)
	_, _ = rand.Read(k)
	return "whsec_" + base64.StdEncoding.EncodeToString(k)
}

func (b bundle) app(t *testing.T) uuid.UUID {
	t.Helper()
	a, err := b.store.ApplicationUpsert(t.Context(), pgstore.ApplicationUpsertParams{Name: uuid.NewString(), APIKey: uuid.NewString()})
	require.NoError(t, err)
	return a.ID
}

// deadEvent settles an execution of app and makes its event DEAD.
func (b bundle) deadEvent(t *testing.T, app uuid.UUID) uuid.UUID {
	t.Helper()
	ctx := t.Context()
	e, _, err := b.store.ExecutionInsert(ctx, pgstore.ExecutionInsertParams{
		ApplicationID: app, Capability: "test.echo", Release: "v1", Mode: execution.ModeAsync, MaxAttempts: 1,
		Input: []byte(`{}`), ContentType: "application/json", RequestHash: []byte(uuid.NewString()),
		AsyncBudget: time.Hour, Status: execution.StatusQueued,
	})
	require.NoError(t, err)
	e, err = b.store.AttemptStart(ctx, pgstore.AttemptStartParams{ExecutionID: e.ID, Attempt: 1, Owner: "t", LeaseFor: time.Minute})
	require.NoError(t, err)
	_, err = b.store.ExecutionSettle(ctx, pgstore.SettleParams{
		ExecutionID: e.ID, Fence: pgstore.Fence{Attempt: 1, LeaseToken: e.LeaseToken},
		Status: execution.StatusSucceeded, Output: []byte(`{}`), OutputType: "application/json", AttemptOutcome: "SUCCEEDED",
	})
	require.NoError(t, err)
	got, err := b.store.EventClaim(ctx, pgstore.EventClaimParams{Owner: "t", Limit: 10, ClaimFor: time.Minute, PerApplication: 10})
	require.NoError(t, err)
	require.Len(t, got, 1)
	_, err = b.store.EventRecordResult(ctx, pgstore.EventResultParams{ID: got[0].ID, ClaimToken: got[0].ClaimToken,
		Attempt: 1, StartedAt: time.Now(), StatusCode: 503, Error: "HTTP 503", Dead: true})
	require.NoError(t, err)
	return got[0].ID
}

func TestConsumersCommands(t *testing.T) {
	t.Parallel()
	b := setup(t)
	app := b.app(t)
	s1, s2 := newSecret(t), newSecret(t)
	file := filepath.Join(t.TempDir(), "secrets")
	require.NoError(t, os.WriteFile(file, []byte("# rotation\n"+s2+"\n\n"), 0o600))

	out, err := b.run(t, "consumers", "set", "--app", app.String(), "--webhook-url", "https://example.com/hook",
		"--secret", s1, "--secrets-file", file)
	require.NoError(t, err)
	require.Contains(t, out, `"url": "https://example.com/hook"`)
	require.Equal(t, 2, strings.Count(out, `"fingerprint"`))
	require.NotContains(t, out, strings.TrimPrefix(s1, "whsec_"))

	out, err = b.run(t, "consumers", "list")
	require.NoError(t, err)
	require.Contains(t, out, app.String())
	require.Contains(t, out, "webhook")
	require.Contains(t, out, "2 active")

	out, err = b.run(t, "consumers", "rotate-secret", "--app", app.String(), "--retire-after", "1h")
	require.NoError(t, err)
	require.Contains(t, out, "new signing secret (shown once, store it now): whsec_")

	out, err = b.run(t, "consumers", "set", "--app", app.String(), "--kafka-topic", "app.events")
	require.NoError(t, err)
	require.Contains(t, out, `"topic": "app.events"`)
	out, err = b.run(t, "consumers", "get", "--app", app.String())
	require.NoError(t, err)
	require.Contains(t, out, `"topic": "app.events"`)
	out, err = b.run(t, "consumers", "enable", "--app", app.String())
	require.NoError(t, err)
	require.Contains(t, out, app.String())

	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"consumers"}, "usage"},
		{[]string{"consumers", "frobnicate"}, "unknown consumers command"},
		{[]string{"consumers", "get"}, "--app is required"},
		{[]string{"consumers", "set", "--app", app.String()}, "exactly one of"},
		{[]string{"consumers", "set", "--app", app.String(), "--kafka-topic", "a", "--grpc-target", "h:1"}, "exactly one of"},
		{[]string{"consumers", "set", "--app", app.String(), "--webhook-url", "ftp://x/", "--secret", s1}, "InvalidArgument"},
		{[]string{"consumers", "get", "--app", uuid.NewString()}, "NotFound"},
	} {
		_, err := b.run(t, tt.args...)
		require.ErrorContains(t, err, tt.want, tt.args)
	}
	var out2, errOut bytes.Buffer
	err = ctl.Main(t.Context(), []string{"consumers", "list", "--admin-addr", b.addr, "--admin-token", ""}, &out2, &errOut)
	require.ErrorIs(t, err, ctl.ErrUsage, "no token")
	err = ctl.Main(t.Context(), []string{"consumers", "list", "--admin-addr", b.addr, "--admin-token", "wrong-token-0123456789"}, &out2, &errOut)
	require.ErrorContains(t, err, "Unauthenticated")
}

func TestEventsCommands(t *testing.T) {
	t.Parallel()
	b := setup(t)
	app, other := b.app(t), b.app(t)
	first := b.deadEvent(t, app)
	second := b.deadEvent(t, app)
	foreign := b.deadEvent(t, other)

	out, err := b.run(t, "events", "list", "--app", app.String(), "--status", "dead", "--since", "1h")
	require.NoError(t, err)
	require.Contains(t, out, first.String())
	require.Contains(t, out, second.String())
	require.NotContains(t, out, foreign.String())
	require.Contains(t, out, "DEAD")
	require.Contains(t, out, "503")

	out, err = b.run(t, "events", "list", "--limit", "1")
	require.NoError(t, err)
	require.Equal(t, 2, strings.Count(out, "\n"), "a header and one event")

	out, err = b.run(t, "events", "show", first.String())
	require.NoError(t, err)
	require.Contains(t, out, `"status": "EVENT_STATUS_DEAD"`)
	require.Contains(t, out, `"error": "HTTP 503"`)
	require.NotContains(t, out, `"payload"`)
	out, err = b.run(t, "events", "show", first.String(), "--payload")
	require.NoError(t, err)
	require.Contains(t, out, `"payload"`)

	out, err = b.run(t, "events", "replay", first.String())
	require.NoError(t, err)
	require.Contains(t, out, "replayed")
	_, err = b.run(t, "events", "replay", first.String())
	require.ErrorContains(t, err, "FailedPrecondition")

	out, err = b.run(t, "events", "replay", "--app", app.String(), "--since", time.Now().Add(-time.Hour).UTC().Format(time.RFC3339))
	require.NoError(t, err)
	require.Contains(t, out, "1 dead events of "+app.String()+" replayed")

	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"events"}, "usage"},
		{[]string{"events", "show"}, "events show ID"},
		{[]string{"events", "replay"}, "events replay ID"},
		{[]string{"events", "replay", first.String(), "--app", app.String()}, "either one event"},
		{[]string{"events", "list", "--status", "LOST"}, "--status"},
		{[]string{"events", "list", "--since", "yesterday"}, "--since"},
		{[]string{"events", "show", "not-a-uuid"}, "InvalidArgument"},
	} {
		_, err := b.run(t, tt.args...)
		require.ErrorContains(t, err, tt.want, tt.args)
	}
}
