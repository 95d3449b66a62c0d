package gateway

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc/metadata"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/token"
)

// adapterAuth authenticates adapters by their key and verifies callback and
// resume tokens.
type adapterAuth struct {
	cfg    *config.Config
	keys   map[[32]byte]map[string]bool // sha256(key) → capabilities served
	signer *token.Signer                // nil: no callback_secret configured
	now    func() time.Time
}

func newAdapterAuth(cfg *config.Config) (*adapterAuth, error) {
	a := &adapterAuth{cfg: cfg, keys: map[[32]byte]map[string]bool{}, now: time.Now}
	for _, cp := range cfg.Capabilities {
		if cp.AdapterKeySHA256 == "" {
			continue
		}
		b, err := hex.DecodeString(cp.AdapterKeySHA256)
		if err != nil || len(b) != 32 {
			return nil, fmt.Errorf("capabilities %q: adapter_key_sha256: want 64 hex digits", cp.Name)
		}
		var h [32]byte
		copy(h[:], b)
		if a.keys[h] == nil {
			a.keys[h] = map[string]bool{}
		}
		a.keys[h][cp.Name] = true
	}
	if cfg.CallbackSecret != "" {
		key, err := base64.StdEncoding.DecodeString(cfg.CallbackSecret)
		if err != nil {
			return nil, fmt.Errorf("callback_secret: %w", err)
		}
		if a.signer, err = token.NewSigner(key); err != nil {
			return nil, fmt.Errorf("callback_secret: %w", err)
		}
	}
	return a, nil
}

// capabilities returns the capabilities that the caller's adapter key
// serves, or execution.ErrUnauthenticated.
func (a *adapterAuth) capabilities(ctx context.Context) (map[string]bool, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	vals := md.Get("authorization")
	if len(vals) != 1 {
		return nil, fmt.Errorf("%w: adapter credentials required", execution.ErrUnauthenticated)
	}
	key, ok := strings.CutPrefix(vals[0], "Bearer ")
	if !ok || key == "" || len(key) > 512 {
		return nil, fmt.Errorf("%w: adapter credentials required", execution.ErrUnauthenticated)
	}
	h := sha256.Sum256([]byte(key))
	for k, caps := range a.keys { // constant-time compare against each known hash
		if subtle.ConstantTimeCompare(k[:], h[:]) == 1 {
			return caps, nil
		}
	}
	return nil, fmt.Errorf("%w: unknown adapter key", execution.ErrUnauthenticated)
}

// callback verifies a callback token.
func (a *adapterAuth) callback(tok string) (token.Claims, error) {
	if a.signer == nil {
		return token.Claims{}, fmt.Errorf("%w: callbacks are not enabled (no callback_secret)", execution.ErrUnauthenticated)
	}
	if tok == "" {
		return token.Claims{}, &execution.InvalidArgumentError{Field: "callback_token", Reason: "required"}
	}
	c, err := a.signer.Verify(tok, token.KindCallback, a.now())
	if err != nil {
		return token.Claims{}, fmt.Errorf("%w: callback_token: %w", execution.ErrUnauthenticated, err)
	}
	if c.ApplicationID == uuid.Nil || c.ExecutionID == uuid.Nil || c.Attempt < 1 {
		return token.Claims{}, fmt.Errorf("%w: callback_token: incomplete claims", execution.ErrUnauthenticated)
	}
	return c, nil
}

// policyFor returns the policy of a configured capability, or the defaults.
func policyFor(cfg *config.Config) func(string) execution.Policy {
	return func(name string) execution.Policy {
		if cp, ok := cfg.Lookup(name); ok {
			return cp.Policy()
		}
		return execution.DefaultPolicy()
	}
}
