package config_test

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/internal/config"
)

const base = `
database:
  url: postgres://u@127.0.0.1:5432/capstan
kafka:
  brokers: [127.0.0.1:9092]
capabilities:
  - name: payments.send
    adapter: 127.0.0.1:7070
    retry_delays: [1s, 2s]
`

func write(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "capstan.yaml")
	require.NoError(t, os.WriteFile(p, []byte(body), 0o600))
	return p
}

func TestLoadDefaults(t *testing.T) {
	c, err := config.Load(write(t, base))
	require.NoError(t, err)
	require.Equal(t, "capstan.executions", c.Kafka.ExecutionTopic)
	require.Equal(t, 256*1024, c.Gateway.MaxInputBytes)
	require.Equal(t, []time.Duration{time.Minute, 5 * time.Minute, 30 * time.Minute, 2 * time.Hour, 6 * time.Hour}, c.Router.RetryDelays)
	cp, ok := c.Lookup("payments.send")
	require.True(t, ok)
	require.Equal(t, "v1", cp.Release)
	p := cp.Policy()
	require.Equal(t, 10, p.MaxAttempts)
	require.Equal(t, []time.Duration{time.Second, 2 * time.Second}, p.RetryDelays)
	require.Equal(t, 24*time.Hour, p.AsyncBudget)
}

func TestLoadEnvironmentOverrides(t *testing.T) {
	t.Setenv("CAPSTAN_DATABASE_URL", "postgres://other@db:5432/x")
	t.Setenv("CAPSTAN_KAFKA_BROKERS", "k1:9092,k2:9092")
	t.Setenv("CAPSTAN_ROUTER_TIMEOUT", "3s")
	c, err := config.Load(write(t, base))
	require.NoError(t, err)
	require.Equal(t, "postgres://other@db:5432/x", c.Database.URL)
	require.Equal(t, []string{"k1:9092", "k2:9092"}, c.Kafka.Brokers)
	require.Equal(t, 3*time.Second, c.Router.Timeout)
}

func TestLoadErrorsNameTheKey(t *testing.T) {
	tests := []struct {
		name, extra, key string
	}{
		{"bad duration", "router:\n  timeout: soon\n", "timeout"},
		{"unknown key", "gateway:\n  lisen: :1\n", "lisen"},
		{"input bound", "gateway:\n  max_input_bytes: 0\n", "gateway.max_input_bytes"},
		{"claim ttl", "router:\n  claim_ttl: 1s\n  timeout: 2s\n", "router.claim_ttl"},
		{"log level", "log:\n  level: loud\n", "log.level"},
		{"budget", "max_async_budget: 1h\n", "async_budget"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := config.Load(write(t, base+tc.extra))
			require.ErrorIs(t, err, config.ErrInvalid)
			require.Contains(t, err.Error(), tc.key)
		})
	}
	_, err := config.Load(write(t, "kafka:\n  brokers: [a:1]\n"))
	require.ErrorContains(t, err, "database.url")
	bad := base + "  - name: payments.send\n    adapter: x:1\n"
	_, err = config.Load(write(t, bad))
	require.ErrorContains(t, err, "configured twice")
	_, err = config.Load(write(t, base+"  - name: a.b\n    adapter: x:1\n    max_attempts: -1\n"))
	require.ErrorContains(t, err, "max_attempts")
}
