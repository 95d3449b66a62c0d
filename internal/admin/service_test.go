package admin_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/capstan-dev/capstan/internal/admin"
	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/rpcerr"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/testutil/pgtest"
	adminv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/admin/v1"
)

const token = "operator-token-0123456789"

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

type bundle struct {
	store  *pgstore.Store
	pool   *pgxpool.Pool
	client adminv1.AdminServiceClient
	conn   *grpc.ClientConn
	logs   *syncBuffer
	key    string
}

func migrate(ctx context.Context, url string) error {
	_, err := pgstore.Migrate(ctx, url, nil)
	return err
}

// setup serves the admin API as the gateway does (rpcerr + AuthInterceptor
// + Register) on loopback, with a secret key configured when withKey.
func setup(t *testing.T, adminToken string, withKey bool) bundle {
	t.Helper()
	url := pgtest.NewDatabase(t, migrate)
	st, err := pgstore.Open(context.Background(), url, nil)
	require.NoError(t, err)
	t.Cleanup(st.Close)
	pool, err := pgxpool.New(context.Background(), url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	cfg := &config.Config{Gateway: config.Gateway{AdminToken: adminToken}}
	if withKey {
		k := make([]byte, 32)
		_, _ = rand.Read(k)
		cfg.Router.SecretKey = base64.StdEncoding.EncodeToString(k)
	}
	logs := &syncBuffer{}
	logger := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(rpcerr.UnaryServerInterceptor(), admin.AuthInterceptor(adminToken)))
	require.NoError(t, admin.Register(srv, st, cfg, logger))
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return bundle{store: st, pool: pool, client: adminv1.NewAdminServiceClient(conn), conn: conn, logs: logs, key: cfg.Router.SecretKey}
}

func authed(t *testing.T) context.Context {
	return metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+token)
}

func newSecret(t testing.TB) string {
	t.Helper()
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	return "whsec_" + base64.StdEncoding.EncodeToString(b)
}

func (b bundle) app(t *testing.T) uuid.UUID {
	t.Helper()
	a, err := b.store.ApplicationUpsert(t.Context(), pgstore.ApplicationUpsertParams{Name: uuid.NewString(), APIKey: uuid.NewString()})
	require.NoError(t, err)
	return a.ID
}

// event settles a new execution of app and returns its completion event id.
func (b bundle) event(t *testing.T, app uuid.UUID) uuid.UUID {
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
	list, err := b.store.EventList(ctx, pgstore.EventListParams{ApplicationID: app, Limit: 1})
	require.NoError(t, err)
	return list[0].ID
}

// record claims every due event and records one attempt for each: dead
// ones DEAD, the rest DELIVERED.
func (b bundle) record(t *testing.T, dead ...uuid.UUID) {
	t.Helper()
	got, err := b.store.EventClaim(t.Context(), pgstore.EventClaimParams{Owner: "t", Limit: 100, ClaimFor: time.Minute, PerApplication: 100})
	require.NoError(t, err)
	for _, d := range got {
		isDead := false
		for _, id := range dead {
			isDead = isDead || id == d.ID
		}
		p := pgstore.EventResultParams{ID: d.ID, ClaimToken: d.ClaimToken, Attempt: d.Attempts + 1, StartedAt: time.Now(),
			StatusCode: 200, Delivered: !isDead}
		if isDead {
			p.StatusCode, p.Error, p.Dead = 500, "HTTP 500", true
		}
		_, err := b.store.EventRecordResult(t.Context(), p)
		require.NoError(t, err)
	}
}

func requireCode(t *testing.T, err error, want codes.Code, msg ...string) {
	t.Helper()
	require.Error(t, err)
	st, ok := status.FromError(err)
	require.True(t, ok, "status error: %v", err)
	require.Equal(t, want, st.Code(), st.Message())
	for _, m := range msg {
		require.Contains(t, st.Message(), m)
	}
}

func TestAuthentication(t *testing.T) {
	t.Parallel()
	b := setup(t, token, false)
	tests := []struct {
		name string
		md   []string
		want codes.Code
	}{
		{"no metadata", nil, codes.Unauthenticated},
		{"wrong token", []string{"authorization", "Bearer " + token + "x"}, codes.Unauthenticated},
		{"prefix of the token", []string{"authorization", "Bearer " + token[:10]}, codes.Unauthenticated},
		{"no Bearer", []string{"authorization", token}, codes.Unauthenticated},
		{"empty bearer", []string{"authorization", "Bearer "}, codes.Unauthenticated},
		{"two values", []string{"authorization", "Bearer " + token, "authorization", "Bearer " + token}, codes.Unauthenticated},
		{"too long", []string{"authorization", "Bearer " + strings.Repeat("x", 2000)}, codes.Unauthenticated},
		{"right token", []string{"authorization", "Bearer " + token}, codes.OK},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ctx := metadata.AppendToOutgoingContext(t.Context(), tt.md...)
			_, err := b.client.ListEventConsumers(ctx, &adminv1.ListEventConsumersRequest{})
			if tt.want == codes.OK {
				require.NoError(t, err)
				return
			}
			requireCode(t, err, tt.want)
		})
	}
}

func TestNoTokenNoService(t *testing.T) {
	t.Parallel()
	b := setup(t, "", false)
	_, err := b.client.ListEventConsumers(metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "),
		&adminv1.ListEventConsumersRequest{})
	requireCode(t, err, codes.Unimplemented)
	require.Contains(t, b.logs.String(), "admin API disabled")

	// The interceptor alone refuses admin methods when no token is set.
	ic := admin.AuthInterceptor("")
	_, err = ic(t.Context(), nil, &grpc.UnaryServerInfo{FullMethod: adminv1.AdminService_ListEvents_FullMethodName},
		func(context.Context, any) (any, error) { return "reached", nil })
	require.ErrorIs(t, err, execution.ErrUnauthenticated)
	got, err := ic(t.Context(), nil, &grpc.UnaryServerInfo{FullMethod: "/capstan.execution.v1.ExecutionService/GetExecution"},
		func(context.Context, any) (any, error) { return "reached", nil })
	require.NoError(t, err)
	require.Equal(t, "reached", got, "other services pass through")
}

func TestEventConsumerRPCs(t *testing.T) {
	t.Parallel()
	b := setup(t, token, true)
	ctx := authed(t)
	app := b.app(t)
	s1, s2 := newSecret(t), newSecret(t)

	set, err := b.client.SetEventConsumer(ctx, &adminv1.SetEventConsumerRequest{
		ApplicationId: app.String(),
		Target:        &adminv1.SetEventConsumerRequest_Webhook{Webhook: &adminv1.WebhookTarget{Url: "https://example.com/hook"}},
		Secrets:       []string{s1, s2},
	})
	require.NoError(t, err)
	c := set.GetConsumer()
	require.Equal(t, "https://example.com/hook", c.GetWebhook().GetUrl())
	require.Len(t, c.GetSecrets(), 2)
	require.EqualValues(t, 1, c.GetVersion())
	wire, err := proto.Marshal(set)
	require.NoError(t, err)
	for _, s := range []string{s1, s2} {
		require.NotContains(t, string(wire), strings.TrimPrefix(s, "whsec_"), "secrets are never returned")
		require.NotContains(t, b.logs.String(), strings.TrimPrefix(s, "whsec_"), "secrets are never logged")
	}
	var stored string
	require.NoError(t, b.pool.QueryRow(t.Context(), `SELECT sealed FROM event_consumer_secrets LIMIT 1`).Scan(&stored))
	require.True(t, strings.HasPrefix(stored, "aesgcm1:"), "sealed with router.secret_key")

	got, err := b.client.GetEventConsumer(ctx, &adminv1.GetEventConsumerRequest{ApplicationId: app.String()})
	require.NoError(t, err)
	require.True(t, proto.Equal(c, got.GetConsumer()))

	rot, err := b.client.RotateSigningSecret(ctx, &adminv1.RotateSigningSecretRequest{
		ApplicationId: app.String(), RetirePreviousAfter: durationpb.New(time.Hour),
	})
	require.NoError(t, err)
	require.NoError(t, pgstore.ValidateSecret("secret", rot.GetSecret()), "a generated secret is returned once")
	require.Len(t, rot.GetConsumer().GetSecrets(), 3)
	for _, sec := range rot.GetConsumer().GetSecrets() {
		require.True(t, sec.GetActive())
		if sec.GetId() == rot.GetSecretId() {
			require.Nil(t, sec.GetExpiresAt())
			require.Equal(t, pgstore.SecretFingerprint(rot.GetSecret()), sec.GetFingerprint())
		} else {
			require.NotNil(t, sec.GetExpiresAt(), "previous secrets retire after the grace period")
		}
	}
	require.NotContains(t, b.logs.String(), strings.TrimPrefix(rot.GetSecret(), "whsec_"))
	supplied, err := b.client.RotateSigningSecret(ctx, &adminv1.RotateSigningSecretRequest{ApplicationId: app.String(), Secret: newSecret(t)})
	require.NoError(t, err)
	require.Empty(t, supplied.GetSecret(), "a supplied secret is not echoed")

	rem, err := b.client.RemoveSigningSecret(ctx, &adminv1.RemoveSigningSecretRequest{ApplicationId: app.String(), SecretId: rot.GetSecretId()})
	require.NoError(t, err)
	require.Len(t, rem.GetConsumer().GetSecrets(), 3)

	kafka, err := b.client.SetEventConsumer(ctx, &adminv1.SetEventConsumerRequest{
		ApplicationId: app.String(), ExpectedVersion: rem.GetConsumer().GetVersion(),
		Target: &adminv1.SetEventConsumerRequest_Kafka{Kafka: &adminv1.KafkaTarget{Topic: "app.events"}},
	})
	require.NoError(t, err)
	require.Equal(t, "app.events", kafka.GetConsumer().GetKafka().GetTopic())
	grpcC, err := b.client.SetEventConsumer(ctx, &adminv1.SetEventConsumerRequest{
		ApplicationId: app.String(), Target: &adminv1.SetEventConsumerRequest_Grpc{Grpc: &adminv1.GrpcTarget{Target: "app.internal:9000"}},
	})
	require.NoError(t, err)
	require.Equal(t, "app.internal:9000", grpcC.GetConsumer().GetGrpc().GetTarget())

	// A disabled consumer (410) shows its flag; Enable clears it.
	_, err = b.pool.Exec(t.Context(), `UPDATE event_consumers SET disabled_at = now(), disabled_reason = 'HTTP 410 Gone'`)
	require.NoError(t, err)
	dis, err := b.client.GetEventConsumer(ctx, &adminv1.GetEventConsumerRequest{ApplicationId: app.String()})
	require.NoError(t, err)
	require.NotNil(t, dis.GetConsumer().GetDisabledAt())
	require.Equal(t, "HTTP 410 Gone", dis.GetConsumer().GetDisabledReason())
	en, err := b.client.EnableEventConsumer(ctx, &adminv1.EnableEventConsumerRequest{ApplicationId: app.String()})
	require.NoError(t, err)
	require.Nil(t, en.GetConsumer().GetDisabledAt())

	other := b.app(t)
	_, err = b.client.SetEventConsumer(ctx, &adminv1.SetEventConsumerRequest{
		ApplicationId: other.String(), Target: &adminv1.SetEventConsumerRequest_Kafka{Kafka: &adminv1.KafkaTarget{Topic: "b"}},
	})
	require.NoError(t, err)
	var ids []string
	req := &adminv1.ListEventConsumersRequest{PageSize: 1}
	for {
		page, err := b.client.ListEventConsumers(ctx, req)
		require.NoError(t, err)
		for _, c := range page.GetConsumers() {
			ids = append(ids, c.GetApplicationId())
		}
		if page.GetNextPageToken() == "" {
			break
		}
		req.PageToken = page.GetNextPageToken()
	}
	require.ElementsMatch(t, []string{app.String(), other.String()}, ids)

	errs := []struct {
		name string
		call func() error
		code codes.Code
		msg  string
	}{
		{"bad application id", func() error {
			_, err := b.client.GetEventConsumer(ctx, &adminv1.GetEventConsumerRequest{ApplicationId: "nope"})
			return err
		}, codes.InvalidArgument, "application_id"},
		{"no consumer", func() error {
			_, err := b.client.GetEventConsumer(ctx, &adminv1.GetEventConsumerRequest{ApplicationId: b.app(t).String()})
			return err
		}, codes.NotFound, "not found"},
		{"unknown application", func() error {
			_, err := b.client.SetEventConsumer(ctx, &adminv1.SetEventConsumerRequest{ApplicationId: uuid.NewString(),
				Target: &adminv1.SetEventConsumerRequest_Kafka{Kafka: &adminv1.KafkaTarget{Topic: "t"}}})
			return err
		}, codes.NotFound, "application"},
		{"no target", func() error {
			_, err := b.client.SetEventConsumer(ctx, &adminv1.SetEventConsumerRequest{ApplicationId: app.String()})
			return err
		}, codes.InvalidArgument, "target"},
		{"bad url", func() error {
			_, err := b.client.SetEventConsumer(ctx, &adminv1.SetEventConsumerRequest{ApplicationId: app.String(),
				Target:  &adminv1.SetEventConsumerRequest_Webhook{Webhook: &adminv1.WebhookTarget{Url: "https://user:pw@x.example/"}},
				Secrets: []string{s1}})
			return err
		}, codes.InvalidArgument, "user info"},
		{"bad secret", func() error {
			_, err := b.client.SetEventConsumer(ctx, &adminv1.SetEventConsumerRequest{ApplicationId: app.String(),
				Target:  &adminv1.SetEventConsumerRequest_Webhook{Webhook: &adminv1.WebhookTarget{Url: "https://x.example/"}},
				Secrets: []string{"whsec_c2hvcnQ="}})
			return err
		}, codes.InvalidArgument, "secrets[0]"},
		{"stale version", func() error {
			_, err := b.client.SetEventConsumer(ctx, &adminv1.SetEventConsumerRequest{ApplicationId: app.String(), ExpectedVersion: 1,
				Target: &adminv1.SetEventConsumerRequest_Kafka{Kafka: &adminv1.KafkaTarget{Topic: "t"}}})
			return err
		}, codes.FailedPrecondition, "version"},
		{"bad page token", func() error {
			_, err := b.client.ListEventConsumers(ctx, &adminv1.ListEventConsumersRequest{PageToken: "!!"})
			return err
		}, codes.InvalidArgument, "page_token"},
		{"bad page size", func() error {
			_, err := b.client.ListEventConsumers(ctx, &adminv1.ListEventConsumersRequest{PageSize: 5000})
			return err
		}, codes.InvalidArgument, "page_size"},
		{"negative grace", func() error {
			_, err := b.client.RotateSigningSecret(ctx, &adminv1.RotateSigningSecretRequest{ApplicationId: app.String(),
				RetirePreviousAfter: durationpb.New(-time.Second)})
			return err
		}, codes.InvalidArgument, "retire_previous_after"},
	}
	for _, e := range errs {
		requireCode(t, e.call(), e.code, e.msg)
	}
}

func TestEventRPCs(t *testing.T) {
	t.Parallel()
	b := setup(t, token, false)
	ctx := authed(t)
	app, other := b.app(t), b.app(t)
	since := timestamppb.Now()
	dead1, dead2 := b.event(t, app), b.event(t, app)
	delivered := b.event(t, app)
	foreign := b.event(t, other)
	b.record(t, dead1, dead2, foreign)

	list, err := b.client.ListEvents(ctx, &adminv1.ListEventsRequest{ApplicationId: app.String(), Status: adminv1.EventStatus_EVENT_STATUS_DEAD})
	require.NoError(t, err)
	var ids []string
	for _, e := range list.GetEvents() {
		ids = append(ids, e.GetEventId())
		require.Equal(t, adminv1.EventStatus_EVENT_STATUS_DEAD, e.GetStatus())
		require.EqualValues(t, 500, e.GetLastStatusCode())
		require.Empty(t, e.GetPayload())
	}
	require.ElementsMatch(t, []string{dead1.String(), dead2.String()}, ids)

	var paged []string
	req := &adminv1.ListEventsRequest{PageSize: 1, Since: since}
	for {
		page, err := b.client.ListEvents(ctx, req)
		require.NoError(t, err)
		for _, e := range page.GetEvents() {
			paged = append(paged, e.GetEventId())
		}
		if page.GetNextPageToken() == "" {
			break
		}
		req.PageToken = page.GetNextPageToken()
	}
	require.ElementsMatch(t, []string{dead1.String(), dead2.String(), delivered.String(), foreign.String()}, paged)

	got, err := b.client.GetEvent(ctx, &adminv1.GetEventRequest{EventId: dead1.String(), IncludePayload: true})
	require.NoError(t, err)
	require.NotEmpty(t, got.GetEvent().GetPayload())
	require.Len(t, got.GetAttempts(), 1)
	require.EqualValues(t, 500, got.GetAttempts()[0].GetStatusCode())
	require.Equal(t, "HTTP 500", got.GetAttempts()[0].GetError())

	_, err = b.client.ReplayEvent(ctx, &adminv1.ReplayEventRequest{EventId: delivered.String()})
	requireCode(t, err, codes.FailedPrecondition, "DELIVERED", "force")
	forced, err := b.client.ReplayEvent(ctx, &adminv1.ReplayEventRequest{EventId: delivered.String(), Force: true})
	require.NoError(t, err)
	require.Equal(t, adminv1.EventStatus_EVENT_STATUS_PENDING, forced.GetEvent().GetStatus())
	require.Equal(t, delivered.String(), forced.GetEvent().GetEventId())
	require.NotNil(t, forced.GetEvent().GetNextAttemptAt())
	_, err = b.client.ReplayEvent(ctx, &adminv1.ReplayEventRequest{EventId: delivered.String()})
	requireCode(t, err, codes.FailedPrecondition, "PENDING")

	n, err := b.client.ReplayDeadEvents(ctx, &adminv1.ReplayDeadEventsRequest{ApplicationId: app.String(), Since: since})
	require.NoError(t, err)
	require.EqualValues(t, 2, n.GetReplayed())
	again, err := b.client.GetEvent(ctx, &adminv1.GetEventRequest{EventId: foreign.String()})
	require.NoError(t, err)
	require.Equal(t, adminv1.EventStatus_EVENT_STATUS_DEAD, again.GetEvent().GetStatus(), "another application's events stay")

	for _, e := range []struct {
		call func() error
		code codes.Code
		msg  string
	}{
		{func() error {
			_, err := b.client.GetEvent(ctx, &adminv1.GetEventRequest{EventId: uuid.NewString()})
			return err
		}, codes.NotFound, "event"},
		{func() error {
			_, err := b.client.GetEvent(ctx, &adminv1.GetEventRequest{EventId: "x"})
			return err
		}, codes.InvalidArgument, "event_id"},
		{func() error {
			_, err := b.client.ReplayDeadEvents(ctx, &adminv1.ReplayDeadEventsRequest{ApplicationId: app.String()})
			return err
		}, codes.InvalidArgument, "since"},
		{func() error {
			_, err := b.client.ListEvents(ctx, &adminv1.ListEventsRequest{PageToken: base64.RawURLEncoding.EncodeToString([]byte("x"))})
			return err
		}, codes.InvalidArgument, "page_token"},
		{func() error {
			_, err := b.client.ListEvents(ctx, &adminv1.ListEventsRequest{Status: 42})
			return err
		}, codes.InvalidArgument, "status"},
	} {
		requireCode(t, e.call(), e.code, e.msg)
	}
}
