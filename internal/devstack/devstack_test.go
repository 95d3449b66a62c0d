package devstack

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/capstan-dev/capstan/internal/config"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func testStack(mode string) stack {
	s := stack{gateway: 1001, gatewayAdmin: 1002, dispatcher: 1003, dispatcherAdmin: 1004, consumerAdmin: 1005,
		routerAdmin: 1006, provider: 1007, app: 1008, gatewayHTTP: 1009, providerHTTP: 1010, providerAdmin: 1011,
		dbURL: "postgres://capstan@127.0.0.1:5432/capstan", brokers: []string{"127.0.0.1:9092", "127.0.0.1:9093"}, mode: mode}
	if mode != ModeDirect {
		s.awaitSecret, s.callbackSecret = "whsec_"+randomB64(32), randomB64(32)
	}
	return s
}

// TestConfigPerMode loads the rendered configuration of each mode with the
// daemons' own loader, which validates it.
func TestConfigPerMode(t *testing.T) {
	t.Parallel()
	tests := []struct {
		mode  string
		await *config.AwaitStep // nil: no await step
	}{
		{mode: ModeDirect},
		{mode: ModeWebhook, await: &config.AwaitStep{Transport: "webhook", URL: "http://127.0.0.1:1010/requests", Timeout: awaitTimeout}},
		{mode: ModeKafka, await: &config.AwaitStep{Transport: "kafka", RequestTopic: RequestTopic, ResponseTopic: ResponseTopic, Timeout: awaitTimeout}},
	}
	for _, tt := range tests {
		t.Run(tt.mode, func(t *testing.T) {
			t.Parallel()
			s := testStack(tt.mode)
			path := filepath.Join(t.TempDir(), "capstan.yaml")
			if err := os.WriteFile(path, []byte(s.config()), 0o600); err != nil {
				t.Fatal(err)
			}
			cfg, err := config.Load(path)
			if err != nil {
				t.Fatalf("%v\n%s", err, s.config())
			}
			if !slices.Equal(cfg.Kafka.Brokers, s.brokers) || cfg.Gateway.Listen != "127.0.0.1:1001" || cfg.Database.URL != s.dbURL {
				t.Errorf("config = %+v", cfg)
			}
			cp, ok := cfg.Lookup("payments.send")
			if !ok || cp.Adapter != "127.0.0.1:1007" {
				t.Fatalf("payments.send = %+v, %v", cp, ok)
			}
			if tt.await == nil {
				if cp.Await != nil || cfg.CallbackSecret != "" || cfg.Gateway.PublicURL != "" {
					t.Errorf("direct mode has await settings: %+v, %+v", cp.Await, cfg.Gateway)
				}
				return
			}
			want := *tt.await
			if want.Transport == "webhook" {
				want.Secret = s.awaitSecret
			}
			if cp.Await == nil || *cp.Await != want {
				t.Errorf("await = %+v, want %+v", cp.Await, want)
			}
			if cfg.CallbackSecret != s.callbackSecret || cfg.Gateway.HTTPListen != "127.0.0.1:1009" ||
				cfg.Gateway.PublicURL != "http://127.0.0.1:1009" {
				t.Errorf("callback secret %q, gateway %+v", cfg.CallbackSecret, cfg.Gateway)
			}
		})
	}
}

func TestProviderArgs(t *testing.T) {
	t.Parallel()
	tests := []struct {
		mode     string
		wantArgs []string
		wantEnv  []string
	}{
		{mode: ModeDirect, wantArgs: []string{"--mode", "direct", "--admin-listen", "127.0.0.1:1011", "--listen", "127.0.0.1:1007"}},
		{mode: ModeWebhook, wantArgs: []string{"--mode", "webhook", "--admin-listen", "127.0.0.1:1011", "--http-listen", "127.0.0.1:1010"},
			wantEnv: []string{"PROVIDER_WEBHOOK_SECRET="}},
		{mode: ModeKafka, wantArgs: []string{"--mode", "kafka", "--admin-listen", "127.0.0.1:1011", "--kafka-brokers", "127.0.0.1:9092,127.0.0.1:9093",
			"--request-topic", RequestTopic, "--response-topic", ResponseTopic, "--kafka-group", "csv-payments-provider"}},
	}
	for _, tt := range tests {
		t.Run(tt.mode, func(t *testing.T) {
			t.Parallel()
			s := testStack(tt.mode)
			args, env := s.providerArgs()
			if !slices.Equal(args, tt.wantArgs) {
				t.Errorf("args = %q, want %q", args, tt.wantArgs)
			}
			if len(env) != len(tt.wantEnv) {
				t.Fatalf("env = %q", env)
			}
			for i := range env {
				if !strings.HasPrefix(env[i], tt.wantEnv[i]) || env[i] != tt.wantEnv[i]+s.awaitSecret {
					t.Errorf("env[%d] = %q", i, env[i])
				}
			}
			if slices.ContainsFunc(args, func(a string) bool { return strings.Contains(a, "whsec_") }) {
				t.Error("the secret is on the command line")
			}
		})
	}
}

func TestRunRejectsUnknownMode(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	err := Run(t.Context(), Options{RunDir: dir, DemoMode: "carrier-pigeon", Out: &bytes.Buffer{}})
	if !errors.Is(err, ErrDemoMode) {
		t.Fatalf("err = %v, want ErrDemoMode", err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Errorf("a run folder was created: %v", entries)
	}
}
