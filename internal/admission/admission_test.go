package admission_test

import (
	"encoding/base64"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/capstan-dev/capstan/internal/admission"
	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/token"
	"github.com/capstan-dev/capstan/pkg/adapter"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var key = []byte("admission-test-secret-of-32-bytes!!")

func TestClaims(t *testing.T) {
	t.Parallel()
	a, err := admission.New(nil, &config.Config{CallbackSecret: base64.StdEncoding.EncodeToString(key)})
	require.NoError(t, err)
	claims := token.Claims{Kind: token.KindResume, ApplicationID: uuid.New(), ExecutionID: uuid.New(), Subject: uuid.New(),
		Attempt: 1, ExpiresAt: time.Now().Add(time.Minute)}
	got, err := a.Claims(a.Signer().Issue(claims))
	require.NoError(t, err)
	require.Equal(t, claims.Subject, got.Subject)

	late := claims
	late.ExpiresAt = time.Now().Add(-time.Second)
	_, err = a.Claims(a.Signer().Issue(late))
	require.ErrorIs(t, err, execution.ErrCompletionRefused, "past the deadline: a late completion, not a forgery")
	callback := claims
	callback.Kind = token.KindCallback
	_, err = a.Claims(a.Signer().Issue(callback))
	require.ErrorIs(t, err, execution.ErrUnauthenticated, "a callback token is not a resume token")
	_, err = a.Claims("cap1.nope.nope")
	require.ErrorIs(t, err, execution.ErrUnauthenticated)

	_, err = admission.New(nil, &config.Config{})
	require.Error(t, err, "no callback_secret, no admission")
}

func TestOutcome(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		c     adapter.InteractionCompletion
		field string
	}{
		{"result", adapter.InteractionCompletion{Result: &adapter.CompletionResult{Output: []byte(`{}`)}}, ""},
		{"failure", adapter.InteractionCompletion{Failure: &adapter.CompletionFailure{Class: "x.y", Retryable: true}}, ""},
		{"no outcome", adapter.InteractionCompletion{}, "outcome"},
		{"no class", adapter.InteractionCompletion{Failure: &adapter.CompletionFailure{}}, "failure.class"},
	}
	for _, tc := range tests {
		out, err := admission.Outcome(tc.c)
		if tc.field == "" {
			require.NoError(t, err, tc.name)
			require.Equal(t, tc.c.Result != nil, out.Succeeded)
			continue
		}
		var inv *execution.InvalidArgumentError
		require.ErrorAs(t, err, &inv, tc.name)
		require.Equal(t, tc.field, inv.Field)
	}
	require.True(t, admission.Permanent(execution.ErrCompletionRefused))
	require.False(t, admission.Permanent(execution.ErrUnavailable))
}
