package config_test

import (
	"encoding/base64"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/internal/config"
)

// TestEventConsumerKeys covers router.per_application_concurrency,
// router.secret_key and gateway.admin_token.
func TestEventConsumerKeys(t *testing.T) {
	c, err := config.Load(write(t, base))
	require.NoError(t, err)
	require.Equal(t, 8, c.Router.PerApplicationConcurrency)
	require.Empty(t, c.Router.SecretKey, "unset: plaintext development fallback")
	require.Empty(t, c.Gateway.AdminToken, "unset: no admin API")

	key := base64.StdEncoding.EncodeToString(make([]byte, 32))
	t.Setenv("CAPSTAN_ROUTER_SECRET_KEY", key)
	t.Setenv("CAPSTAN_GATEWAY_ADMIN_TOKEN", "0123456789abcdef")
	c, err = config.Load(write(t, base+"router:\n  per_application_concurrency: 3\n"))
	require.NoError(t, err)
	require.Equal(t, key, c.Router.SecretKey)
	require.Equal(t, "0123456789abcdef", c.Gateway.AdminToken)
	require.Equal(t, 3, c.Router.PerApplicationConcurrency)

	for _, tc := range []struct{ name, extra, key string }{
		{"per-app zero", "router:\n  per_application_concurrency: 0\n", "router.per_application_concurrency"},
		{"per-app above concurrency", "router:\n  concurrency: 4\n  per_application_concurrency: 5\n", "router.per_application_concurrency"},
		{"short key", "router:\n  secret_key: " + base64.StdEncoding.EncodeToString(make([]byte, 16)) + "\n", "router.secret_key"},
		{"key not base64", "router:\n  secret_key: '***'\n", "router.secret_key"},
		{"short token", "gateway:\n  admin_token: short\n", "gateway.admin_token"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("CAPSTAN_ROUTER_SECRET_KEY", "")
			t.Setenv("CAPSTAN_GATEWAY_ADMIN_TOKEN", "")
			_, err := config.Load(write(t, base+tc.extra))
			require.ErrorIs(t, err, config.ErrInvalid)
			require.ErrorContains(t, err, tc.key)
			require.NotContains(t, err.Error(), "***", "the key's value is not echoed")
		})
	}
}
