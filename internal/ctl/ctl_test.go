package ctl_test

import (
	"bytes"
	"context"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/internal/ctl"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/testutil/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.RunMain(m)) }

func run(t *testing.T, args ...string) (string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	err := ctl.Main(context.Background(), args, &out, &errOut)
	return out.String() + errOut.String(), err
}

func TestMigrateAppAndExecution(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDatabase(t, nil)
	out, err := run(t, "migrate", "--database-url", url, "--status")
	require.NoError(t, err)
	require.Contains(t, out, "schema version 0")
	out, err = run(t, "migrate", "--database-url", url)
	require.NoError(t, err)
	require.Contains(t, out, "schema at version")
	_, err = run(t, "migrate", "--database-url", url)
	require.NoError(t, err, "migrate is idempotent")

	out, err = run(t, "app", "upsert", "--database-url", url, "--name", "shop", "--api-key", "k1",
		"--webhook-url", "https://shop.example/events", "--webhook-secret", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
	require.NoError(t, err)
	require.Contains(t, out, "application shop")

	ctx := context.Background()
	st, err := pgstore.Open(ctx, url, nil)
	require.NoError(t, err)
	defer st.Close()
	app, err := st.ApplicationByAPIKey(ctx, "k1")
	require.NoError(t, err)
	e, _, err := st.ExecutionInsert(ctx, pgstore.ExecutionInsertParams{ApplicationID: app.ID, Capability: "payments.send",
		Release: "v1", Mode: execution.ModeAsync, MaxAttempts: 3, Input: []byte(`{"secret":"card"}`), ContentType: "application/json",
		RequestHash: []byte("h"), AsyncBudget: time.Hour, Status: execution.StatusQueued})
	require.NoError(t, err)
	out, err = run(t, "execution", "get", e.ID.String(), "--database-url", url)
	require.NoError(t, err)
	require.Contains(t, out, `"Status": "QUEUED"`)
	out, err = run(t, "execution", "get", "--database-url", url, e.ID.String())
	require.NoError(t, err, "the id may follow the flags")
	require.Contains(t, out, e.ID.String())
	require.NotContains(t, out, "card", "payloads are not shown")
}

func TestUsageErrors(t *testing.T) {
	t.Parallel()
	tests := []struct {
		args []string
		want string
	}{
		{nil, "Commands"},
		{[]string{"frobnicate"}, "unknown command"},
		{[]string{"migrate", "--database-url", ""}, "--database-url is required"},
		{[]string{"app", "upsert", "--database-url", "postgres://x/y", "--name", "a"}, "--api-key is required"},
		{[]string{"app", "upsert", "--database-url", "postgres://x/y", "--name", "a", "--api-key", "k", "--webhook-url", "https://x"}, "--webhook-secret"},
		{[]string{"execution", "get", "nope", "--database-url", "postgres://x/y"}, "not a UUID"},
	}
	for _, tc := range tests {
		out, err := run(t, tc.args...)
		require.ErrorIs(t, err, ctl.ErrUsage, "%v", tc.args)
		require.Contains(t, out+err.Error(), tc.want, "%v", tc.args)
	}
}
