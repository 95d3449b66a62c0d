package token_test

import (
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/capstan-dev/capstan/internal/token"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var key = []byte("0123456789abcdef0123456789abcdef")

func TestIssueVerify(t *testing.T) {
	t.Parallel()
	s, err := token.NewSigner(key)
	require.NoError(t, err)
	now := time.Unix(1_800_000_000, 0)
	c := token.Claims{Kind: token.KindCallback, ApplicationID: uuid.New(), ExecutionID: uuid.New(), Subject: uuid.New(),
		Attempt: 3, ExpiresAt: now.Add(time.Hour)}
	tok := s.Issue(c)
	require.LessOrEqual(t, len(tok), token.MaxLen)
	got, err := s.Verify(tok, token.KindCallback, now)
	require.NoError(t, err)
	require.Equal(t, c, got)

	other, _ := token.NewSigner([]byte("another key of at least 32 bytes!!"))
	tests := []struct {
		name string
		tok  string
		kind token.Kind
		now  time.Time
		s    *token.Signer
		err  error
	}{
		{"expired", tok, token.KindCallback, now.Add(2 * time.Hour), s, token.ErrExpired},
		{"wrong kind", tok, token.KindResume, now, s, token.ErrKind},
		{"other key", tok, token.KindCallback, now, other, token.ErrSignature},
		{"tampered payload", tok[:10] + flip(tok[10]) + tok[11:], token.KindCallback, now, s, token.ErrSignature},
		{"tampered signature", tok[:len(tok)-10] + flip(tok[len(tok)-10]) + tok[len(tok)-9:], token.KindCallback, now, s, token.ErrSignature},
		{"truncated signature", tok[:len(tok)-3], token.KindCallback, now, s, token.ErrSignature},
		{"no signature", tok[:20], token.KindCallback, now, s, token.ErrMalformed},
		{"empty", "", token.KindCallback, now, s, token.ErrMalformed},
		{"too long", tok + strings.Repeat("A", 300), token.KindCallback, now, s, token.ErrMalformed},
	}
	for _, tc := range tests {
		_, err := tc.s.Verify(tc.tok, tc.kind, tc.now)
		require.ErrorIs(t, err, tc.err, tc.name)
	}
	_, err = token.NewSigner([]byte("short"))
	require.ErrorIs(t, err, token.ErrKey)
}

func flip(b byte) string {
	if b == 'A' {
		return "B"
	}
	return "A"
}

// FuzzVerify: Verify never panics, and accepts nothing it did not issue.
func FuzzVerify(f *testing.F) {
	s, _ := token.NewSigner(key)
	now := time.Unix(1_800_000_000, 0)
	f.Add(s.Issue(token.Claims{Kind: token.KindResume, ExpiresAt: now.Add(time.Minute)}))
	f.Add("cap1..")
	f.Add("cap1.AAAA.BBBB")
	f.Fuzz(func(t *testing.T, in string) {
		c, err := s.Verify(in, token.KindResume, now)
		if err == nil {
			require.Equal(t, in, s.Issue(c), "only issued tokens verify")
		}
	})
}
