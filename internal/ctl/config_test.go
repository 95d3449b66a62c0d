package ctl_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/ctl"
)

// Secrets of the test configuration: none may appear in the output.
const (
	dbPassword     = "db-pass-s3cr3t"
	callbackSecret = "Y2FsbGJhY2stc2VjcmV0LWNhbGxiYWNrLXNlY3JldC0xMjM0NTY3OA=="
	adminToken     = "admin-token-0123456789abcdef"
	routerKey      = "MDEyMzQ1Njc4OTAxMjM0NTY3ODkwMTIzNDU2Nzg5MDE="
	awaitSecret    = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
)

const printable = `
database:
  url: postgres://capstan:` + dbPassword + `@db:5432/capstan?sslmode=disable
kafka:
  brokers: [k1:9092]
callback_secret: ` + callbackSecret + `
gateway:
  admin_token: ` + adminToken + `
  public_url: https://capstan.example
  http_listen: 127.0.0.1:7280
router:
  secret_key: ` + routerKey + `
capabilities:
  - name: payments.send
    adapter: 127.0.0.1:7070
  - name: payments.approve
    adapter: 127.0.0.1:7071
    await:
      transport: webhook
      url: https://partner.example/approve
      secret: ` + awaitSecret + `
`

func TestConfigPrint(t *testing.T) {
	t.Parallel()
	p := filepath.Join(t.TempDir(), "capstan.yaml")
	require.NoError(t, os.WriteFile(p, []byte(printable), 0o600))
	out, err := run(t, "config", "print", "--config", p)
	require.NoError(t, err, out)
	for _, secret := range []string{dbPassword, callbackSecret, adminToken, routerKey, awaitSecret} {
		require.NotContains(t, out, secret)
	}
	var got map[string]any
	require.NoError(t, yaml.Unmarshal([]byte(out), &got))
	at := func(path ...any) any {
		var v any = got
		for _, k := range path {
			switch k := k.(type) {
			case string:
				v = v.(map[string]any)[k]
			case int:
				v = v.([]any)[k]
			}
		}
		return v
	}
	tests := []struct {
		path []any
		want any
	}{
		{[]any{"database", "url"}, "postgres://capstan:****@db:5432/capstan?sslmode=disable"},
		{[]any{"callback_secret"}, ctl.Masked},
		{[]any{"gateway", "admin_token"}, ctl.Masked},
		{[]any{"router", "secret_key"}, ctl.Masked},
		{[]any{"capabilities", 1, "await", "secret"}, ctl.Masked},
		{[]any{"capabilities", 1, "await", "url"}, "https://partner.example/approve"},
		{[]any{"capabilities", 0, "adapter"}, "127.0.0.1:7070"},
		{[]any{"capabilities", 0, "await"}, nil},
		{[]any{"kafka", "brokers", 0}, "k1:9092"},
		{[]any{"kafka", "execution_topic"}, "capstan.executions"}, // a default
		{[]any{"max_async_budget"}, "24h0m0s"},                    // a duration
	}
	for _, tt := range tests {
		require.Equal(t, tt.want, at(tt.path...), "%v", tt.path)
	}
}

func TestPrintConfigMasksDatabaseURL(t *testing.T) {
	t.Parallel()
	tests := []struct{ url, want string }{
		{"postgres://u:pw@h:5432/d", "postgres://u:****@h:5432/d"},
		{"postgres://u@h:5432/d", "postgres://u@h:5432/d"},
		{"postgres://u@h/d?password=pw&sslmode=require", "postgres://u@h/d?password=****&sslmode=require"},
		{"", ""},
		{"postgres://u:pw@h:5432/%zz", ctl.Masked},
	}
	for _, tt := range tests {
		t.Run(tt.url, func(t *testing.T) {
			t.Parallel()
			out, err := ctl.PrintConfig(&config.Config{Database: config.Database{URL: tt.url}})
			require.NoError(t, err)
			require.NotContains(t, string(out), "pw")
			var got struct {
				Database struct {
					URL string `json:"url"`
				} `json:"database"`
			}
			require.NoError(t, yaml.Unmarshal(out, &got))
			require.Equal(t, tt.want, got.Database.URL)
		})
	}
}
