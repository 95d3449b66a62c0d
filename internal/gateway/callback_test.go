package gateway_test

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"io"
	"net"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/gateway"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/testutil/pgtest"
	"github.com/capstan-dev/capstan/internal/token"
	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
	callbackv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/callback/v1"
	executionv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/execution/v1"
	interactionv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/interaction/v1"
)

var secret = []byte("callback-secret-of-at-least-32-bytes!")

func keyHash(k string) string { h := sha256.Sum256([]byte(k)); return hex.EncodeToString(h[:]) }

type cbBundle struct {
	store        *pgstore.Store
	app          pgstore.Application
	callbacks    callbackv1.AdapterCallbackServiceClient
	interactions interactionv1.InteractionServiceClient
	executions   executionv1.ExecutionServiceClient
	signer       *token.Signer
}

func serveCallbacks(t *testing.T) cbBundle {
	t.Helper()
	ctx := context.Background()
	url := pgtest.NewDatabase(t, migrate)
	st, err := pgstore.Open(ctx, url, nil)
	require.NoError(t, err)
	t.Cleanup(st.Close)
	app, err := st.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: "a", APIKey: "key-a"})
	require.NoError(t, err)
	cfg := &config.Config{
		Gateway:        config.Gateway{MaxInputBytes: 1024},
		CallbackSecret: base64.StdEncoding.EncodeToString(secret),
		Capabilities: []config.Capability{
			{Name: "payments.send", Release: "v1", Adapter: "127.0.0.1:1", AdapterKeySHA256: keyHash("adapter-pay"), LeaseDuration: time.Minute},
			{Name: "payments.quote", Release: "v1", Adapter: "127.0.0.1:1", Mode: "SYNC", AdapterKeySHA256: keyHash("adapter-pay")},
			{Name: "mail.send", Release: "v1", Adapter: "127.0.0.1:1", AdapterKeySHA256: keyHash("adapter-mail")},
		},
	}
	cb, err := gateway.NewCallbackService(st, cfg, nil)
	require.NoError(t, err)
	is, err := gateway.NewInteractionService(st, cfg, nil)
	require.NoError(t, err)
	svc := gateway.NewExecutionService(st, cfg, nil, nil)
	t.Cleanup(svc.Close)
	srv := gateway.NewServerForTest(svc, st, 1024)
	executionv1.RegisterExecutionServiceServer(srv, svc)
	callbackv1.RegisterAdapterCallbackServiceServer(srv, cb)
	interactionv1.RegisterInteractionServiceServer(srv, is)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { cc.Close() })
	signer, err := token.NewSigner(secret)
	require.NoError(t, err)
	return cbBundle{store: st, app: app, callbacks: callbackv1.NewAdapterCallbackServiceClient(cc),
		interactions: interactionv1.NewInteractionServiceClient(cc), executions: executionv1.NewExecutionServiceClient(cc), signer: signer}
}

func asAdapter(key string) context.Context {
	return metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+key)
}

// running starts attempt 1 of a new execution of capability, as the
// consumer does, and returns it with its callback token.
func (b cbBundle) running(t *testing.T, capability string, mode execution.Mode) (execution.Execution, string) {
	t.Helper()
	ctx := context.Background()
	st := execution.StatusQueued
	if mode == execution.ModeSync {
		st = execution.StatusRunning
	}
	e, _, err := b.store.ExecutionInsert(ctx, pgstore.ExecutionInsertParams{ApplicationID: b.app.ID, Capability: capability,
		Release: "v1", Mode: mode, MaxAttempts: 3, Input: []byte(`{}`), ContentType: "application/json",
		RequestHash: []byte(uuid.NewString()), AsyncBudget: time.Hour, Status: st, LeaseOwner: "gw", LeaseFor: time.Minute})
	require.NoError(t, err)
	if mode == execution.ModeAsync {
		e, err = b.store.AttemptStart(ctx, pgstore.AttemptStartParams{ExecutionID: e.ID, Attempt: 1, Owner: "w", LeaseFor: time.Minute})
		require.NoError(t, err)
	}
	return e, b.signer.Issue(token.Claims{Kind: token.KindCallback, ApplicationID: e.ApplicationID, ExecutionID: e.ID,
		Subject: e.LeaseToken, Attempt: e.Attempt, ExpiresAt: time.Now().Add(time.Hour)})
}

func (b cbBundle) park(t *testing.T, e execution.Execution) pgstore.ParkResult {
	t.Helper()
	res, err := b.store.AwaitPark(context.Background(), pgstore.ParkParams{AwaitOpen: pgstore.AwaitOpen{ExecutionID: e.ID,
		ApplicationID: e.ApplicationID, Attempt: e.Attempt, Step: pgstore.StepAdapter, Capability: e.Capability,
		Transport: pgstore.TransportInteractionAPI, Timeout: time.Hour, Request: e.Input, ContentType: e.ContentType},
		LeaseToken: e.LeaseToken, LeaseFor: time.Minute, Policy: execution.DefaultPolicy()})
	require.NoError(t, err)
	return res
}

func result(body string) *callbackv1.CompleteExecutionRequest_Result {
	return &callbackv1.CompleteExecutionRequest_Result{Result: &adapterv1.Result{Output: []byte(body)}}
}

func TestCallbacksCompleteParkedExecution(t *testing.T) {
	t.Parallel()
	b := serveCallbacks(t)
	e, tok := b.running(t, "payments.send", execution.ModeAsync)
	b.park(t, e)

	renewed, err := b.callbacks.RenewLease(asAdapter("adapter-pay"), &callbackv1.RenewLeaseRequest{CallbackToken: tok})
	require.NoError(t, err)
	require.True(t, renewed.LeaseExpiresAt.AsTime().After(time.Now()))
	_, err = b.callbacks.ReportProgress(asAdapter("adapter-pay"), &callbackv1.ReportProgressRequest{CallbackToken: tok, Percent: 40, Message: "sent to bank"})
	require.NoError(t, err)
	got, err := b.executions.GetExecution(as("key-a"), &executionv1.GetExecutionRequest{ExecutionId: e.ID.String()})
	require.NoError(t, err)
	require.Equal(t, int32(40), got.Execution.ProgressPercent)
	require.Equal(t, "sent to bank", got.Execution.ProgressMessage)
	require.Equal(t, executionv1.ExecutionStatus_EXECUTION_STATUS_WAITING_EXTERNAL, got.Execution.Status)
	require.Equal(t, "interaction-api", got.Execution.Await.Transport)
	require.Equal(t, "WAITING", got.Execution.Await.Status)

	watch, err := b.executions.WatchExecution(as("key-a"), &executionv1.WatchExecutionRequest{ExecutionId: e.ID.String()})
	require.NoError(t, err)
	first, err := watch.Recv()
	require.NoError(t, err)
	require.Equal(t, executionv1.ExecutionStatus_EXECUTION_STATUS_WAITING_EXTERNAL, first.Execution.Status)

	done, err := b.callbacks.CompleteExecution(asAdapter("adapter-pay"), &callbackv1.CompleteExecutionRequest{CallbackToken: tok, Outcome: result(`{"ok":1}`)})
	require.NoError(t, err)
	require.Equal(t, executionv1.ExecutionStatus_EXECUTION_STATUS_SUCCEEDED, done.Status)
	require.False(t, done.Duplicate)
	var last *executionv1.Execution
	for {
		m, err := watch.Recv()
		if err == io.EOF {
			break
		}
		require.NoError(t, err)
		last = m.Execution
	}
	require.Equal(t, executionv1.ExecutionStatus_EXECUTION_STATUS_SUCCEEDED, last.Status, "the watch ends after the terminal status")

	dup, err := b.callbacks.CompleteExecution(asAdapter("adapter-pay"), &callbackv1.CompleteExecutionRequest{CallbackToken: tok, Outcome: result(`{"ok":1}`)})
	require.NoError(t, err)
	require.True(t, dup.Duplicate)
	_, err = b.callbacks.CompleteExecution(asAdapter("adapter-pay"), &callbackv1.CompleteExecutionRequest{CallbackToken: tok, Outcome: result(`{"ok":2}`)})
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	_, err = b.callbacks.RenewLease(asAdapter("adapter-pay"), &callbackv1.RenewLeaseRequest{CallbackToken: tok})
	require.Equal(t, codes.FailedPrecondition, status.Code(err), "a settled execution's lease cannot be renewed")
}

func TestCallbackCompletionBeforePark(t *testing.T) {
	t.Parallel()
	b := serveCallbacks(t)
	e, tok := b.running(t, "payments.send", execution.ModeAsync)
	held, err := b.callbacks.CompleteExecution(asAdapter("adapter-pay"), &callbackv1.CompleteExecutionRequest{CallbackToken: tok, Outcome: result(`{"early":1}`)})
	require.NoError(t, err)
	require.Equal(t, executionv1.ExecutionStatus_EXECUTION_STATUS_RUNNING, held.Status, "held until the park commits")
	res := b.park(t, e)
	require.True(t, res.Released)
	require.Equal(t, execution.StatusSucceeded, res.Execution.Status)
}

func TestCallbackRefusals(t *testing.T) {
	t.Parallel()
	b := serveCallbacks(t)
	e, tok := b.running(t, "payments.send", execution.ModeAsync)
	b.park(t, e)
	_, syncTok := b.running(t, "payments.quote", execution.ModeSync)
	forged := token.Claims{Kind: token.KindCallback, ApplicationID: e.ApplicationID, ExecutionID: e.ID, Subject: e.LeaseToken,
		Attempt: 1, ExpiresAt: time.Now().Add(time.Hour)}
	otherSigner, _ := token.NewSigner([]byte("a different secret, also 32 bytes long"))
	expired := forged
	expired.ExpiresAt = time.Now().Add(-time.Minute)
	superseded := forged
	superseded.Subject = uuid.New()
	tests := []struct {
		name string
		ctx  context.Context
		tok  string
		code codes.Code
	}{
		{"no adapter credentials", context.Background(), tok, codes.Unauthenticated},
		{"unknown adapter key", asAdapter("nope"), tok, codes.Unauthenticated},
		{"forged token", asAdapter("adapter-pay"), otherSigner.Issue(forged), codes.Unauthenticated},
		{"expired token", asAdapter("adapter-pay"), b.signer.Issue(expired), codes.Unauthenticated},
		{"garbage token", asAdapter("adapter-pay"), "cap1.garbage", codes.Unauthenticated},
		{"missing token", asAdapter("adapter-pay"), "", codes.InvalidArgument},
		{"another adapter", asAdapter("adapter-mail"), tok, codes.PermissionDenied},
		{"superseded attempt", asAdapter("adapter-pay"), b.signer.Issue(superseded), codes.FailedPrecondition},
		{"SYNC execution", asAdapter("adapter-pay"), syncTok, codes.FailedPrecondition},
	}
	for _, tc := range tests {
		_, err := b.callbacks.CompleteExecution(tc.ctx, &callbackv1.CompleteExecutionRequest{CallbackToken: tc.tok, Outcome: result(`{}`)})
		require.Equal(t, tc.code, status.Code(err), "%s: %v", tc.name, err)
	}
	_, err := b.callbacks.CompleteExecution(asAdapter("adapter-pay"), &callbackv1.CompleteExecutionRequest{CallbackToken: tok})
	require.Equal(t, codes.InvalidArgument, status.Code(err))
	require.Contains(t, status.Convert(err).Message(), "outcome")
	_, err = b.callbacks.ReportProgress(asAdapter("adapter-pay"), &callbackv1.ReportProgressRequest{CallbackToken: tok, Percent: 101})
	require.Equal(t, codes.InvalidArgument, status.Code(err))
	require.Contains(t, status.Convert(err).Message(), "percent")

	got, err := b.store.ExecutionGet(context.Background(), uuid.Nil, e.ID)
	require.NoError(t, err)
	require.Equal(t, execution.StatusWaitingExternal, got.Status, "refusals change nothing")
}

func TestInteractionAPI(t *testing.T) {
	t.Parallel()
	b := serveCallbacks(t)
	var ids []string
	for range 5 {
		e, _ := b.running(t, "payments.send", execution.ModeAsync)
		res := b.park(t, e)
		ids = append(ids, res.InteractionID.String())
	}
	var seen []string
	page := ""
	for {
		resp, err := b.interactions.ListPendingInteractions(asAdapter("adapter-pay"), &interactionv1.ListPendingInteractionsRequest{
			Capability: "payments.send", PageSize: 2, PageToken: page})
		require.NoError(t, err)
		for _, i := range resp.Interactions {
			seen = append(seen, i.InteractionId)
		}
		if resp.NextPageToken == "" {
			break
		}
		page = resp.NextPageToken
	}
	require.ElementsMatch(t, ids, seen, "paging lists every pending interaction once")

	_, err := b.interactions.ListPendingInteractions(asAdapter("adapter-mail"), &interactionv1.ListPendingInteractionsRequest{Capability: "payments.send"})
	require.Equal(t, codes.PermissionDenied, status.Code(err))
	_, err = b.interactions.CompleteInteraction(asAdapter("adapter-mail"), &interactionv1.CompleteInteractionRequest{InteractionId: ids[0],
		Outcome: &interactionv1.CompleteInteractionRequest_Result{Result: &adapterv1.Result{Output: []byte(`{}`)}}})
	require.Equal(t, codes.PermissionDenied, status.Code(err), "an adapter of another capability")

	done, err := b.interactions.CompleteInteraction(asAdapter("adapter-pay"), &interactionv1.CompleteInteractionRequest{InteractionId: ids[0],
		Outcome: &interactionv1.CompleteInteractionRequest_Failure{Failure: &adapterv1.Failure{Class: "payment.declined"}}})
	require.NoError(t, err)
	require.Equal(t, interactionv1.InteractionStatus_INTERACTION_STATUS_FAILED, done.Status)
	_, err = b.interactions.CompleteInteraction(asAdapter("adapter-pay"), &interactionv1.CompleteInteractionRequest{InteractionId: uuid.NewString(),
		Outcome: &interactionv1.CompleteInteractionRequest_Result{Result: &adapterv1.Result{}}})
	require.Equal(t, codes.NotFound, status.Code(err))
	_, err = b.interactions.ListPendingInteractions(asAdapter("adapter-pay"), &interactionv1.ListPendingInteractionsRequest{Capability: "payments.send", PageToken: "!!"})
	require.Equal(t, codes.InvalidArgument, status.Code(err))
}
