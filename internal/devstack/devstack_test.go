package devstack

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
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
	s.secrets()
	return s
}

// TestConfigPerMode loads the rendered configuration of each mode with the
// daemons' own loader, which validates it.
func TestConfigPerMode(t *testing.T) {
	t.Parallel()
	tests := []struct {
		mode  string
		await *config.AwaitStep // nil: no await step
		// callbacks: callback_secret and the adapter's key hash are set
		callbacks bool
	}{
		{mode: ModeDirect},
		{mode: ModeCallback, callbacks: true},
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
			wantKeyHash := ""
			if tt.callbacks {
				sum := sha256.Sum256([]byte(s.adapterKey))
				wantKeyHash = hex.EncodeToString(sum[:])
			}
			if cp.AdapterKeySHA256 != wantKeyHash || (tt.callbacks && s.adapterKey == "") {
				t.Errorf("adapter_key_sha256 = %q, want %q", cp.AdapterKeySHA256, wantKeyHash)
			}
			if strings.Contains(s.config(), s.adapterKey) && s.adapterKey != "" {
				t.Error("the configuration holds the adapter key itself")
			}
			switch want := tt.await; {
			case want == nil && cp.Await != nil:
				t.Errorf("%s mode has an await step: %+v", tt.mode, cp.Await)
			case want != nil:
				w := *want
				if w.Transport == "webhook" {
					w.Secret = s.awaitSecret
				}
				if cp.Await == nil || *cp.Await != w {
					t.Errorf("await = %+v, want %+v", cp.Await, w)
				}
			}
			if tt.mode == ModeDirect {
				if cfg.CallbackSecret != "" || cfg.Gateway.PublicURL != "" {
					t.Errorf("direct mode has await settings: %+v, %+v", cp.Await, cfg.Gateway)
				}
				return
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
		wantEnv  func(s stack) []string
	}{
		{mode: ModeDirect, wantArgs: []string{"--mode", "direct", "--admin-listen", "127.0.0.1:1011", "--listen", "127.0.0.1:1007"}},
		{mode: ModeWebhook, wantArgs: []string{"--mode", "webhook", "--admin-listen", "127.0.0.1:1011", "--http-listen", "127.0.0.1:1010"},
			wantEnv: func(s stack) []string { return []string{"PROVIDER_WEBHOOK_SECRET=" + s.awaitSecret} }},
		{mode: ModeKafka, wantArgs: []string{"--mode", "kafka", "--admin-listen", "127.0.0.1:1011", "--kafka-brokers", "127.0.0.1:9092,127.0.0.1:9093",
			"--request-topic", RequestTopic, "--response-topic", ResponseTopic, "--kafka-group", "csv-payments-provider"}},
		{mode: ModeCallback, wantArgs: []string{"--mode", "callback", "--admin-listen", "127.0.0.1:1011", "--listen", "127.0.0.1:1007",
			"--gateway", "127.0.0.1:1001"},
			wantEnv: func(s stack) []string { return []string{"PROVIDER_ADAPTER_KEY=" + s.adapterKey} }},
	}
	for _, tt := range tests {
		t.Run(tt.mode, func(t *testing.T) {
			t.Parallel()
			s := testStack(tt.mode)
			args, env := s.providerArgs()
			if !slices.Equal(args, tt.wantArgs) {
				t.Errorf("args = %q, want %q", args, tt.wantArgs)
			}
			var wantEnv []string
			if tt.wantEnv != nil {
				wantEnv = tt.wantEnv(s)
			}
			if !slices.Equal(env, wantEnv) {
				t.Errorf("env = %q, want %q", env, wantEnv)
			}
			for _, secret := range []string{s.awaitSecret, s.adapterKey} {
				if secret != "" && slices.ContainsFunc(args, func(a string) bool { return strings.Contains(a, secret) }) {
					t.Error("a secret is on the command line")
				}
			}
		})
	}
}

// testFileStack is testStack in the file shape.
func testFileStack() stack {
	s := testStack(ModeKafka)
	s.shape, s.objectsDir = ShapeFile, "/tmp/run/objects"
	return s
}

// TestConfigFileShape loads the file shape's configuration with the
// daemons' own loader: payments.process-file is a release declared as
// steps over the kafka item topics, publishing the row shape's columns.
func TestConfigFileShape(t *testing.T) {
	t.Parallel()
	s := testFileStack()
	path := filepath.Join(t.TempDir(), "capstan.yaml")
	if err := os.WriteFile(path, []byte(s.config()), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Load(path)
	if err != nil {
		t.Fatalf("%v\n%s", err, s.config())
	}
	if cfg.ObjectStore.Dir != s.objectsDir || cfg.CallbackSecret != s.callbackSecret || cfg.CallbackSecret == "" ||
		cfg.Gateway.PublicURL != "http://127.0.0.1:1009" {
		t.Errorf("object store %q, callback secret %q, gateway %+v", cfg.ObjectStore.Dir, cfg.CallbackSecret, cfg.Gateway)
	}
	if len(cfg.Capabilities) != 1 {
		t.Fatalf("capabilities = %+v, want only %s", cfg.Capabilities, FileCapability)
	}
	cp, ok := cfg.Lookup(FileCapability)
	if !ok || cp.Steps == nil || cp.Adapter != "" || cp.Await != nil {
		t.Fatalf("%s = %+v, %v", FileCapability, cp, ok)
	}
	st := cp.Steps
	if st.Source == nil || st.Source.Format != "csv" || st.Publish == nil || st.Publish.Format != "csv" || st.Map != nil {
		t.Errorf("steps = %+v", st)
	}
	want := config.AwaitStep{Transport: "kafka", RequestTopic: ItemRequestTopic, ResponseTopic: ItemResponseTopic,
		Timeout: awaitTimeout, Cardinality: config.OneToOne, Window: fileWindow, MaxItems: config.DefaultMaxItems}
	if st.Await == nil || *st.Await != want {
		t.Errorf("await = %+v, want %+v", st.Await, want)
	}
	// The columns of the row shape's output (csvapp.OutputHeader).
	var names, values []string
	for _, c := range st.Publish.Columns {
		names, values = append(names, c.Name), append(values, c.Value)
	}
	if got := strings.Join(names, ","); got != "ID,Recipient,Amount,Currency,Status,ProviderReference,Fee,FailureClass,FailureMessage,Attempts,ExecutionID" {
		t.Errorf("columns = %s", got)
	}
	if got := strings.Join(values, ","); got != "item.ID,item.Recipient,item.Amount,item.Currency,status,result.provider_reference,result.fee,failure.class,failure.message,sends,execution_id" {
		t.Errorf("column values = %s", got)
	}
}

func TestProviderArgsFileShape(t *testing.T) {
	t.Parallel()
	args, env := testFileStack().providerArgs()
	want := []string{"--mode", "kafka", "--admin-listen", "127.0.0.1:1011", "--kafka-brokers", "127.0.0.1:9092,127.0.0.1:9093",
		"--request-topic", ItemRequestTopic, "--response-topic", ItemResponseTopic, "--kafka-group", "csv-payments-provider",
		"--retryable-fraction", "0"}
	if !slices.Equal(args, want) || env != nil {
		t.Errorf("args = %q, env %q; want %q", args, env, want)
	}
}

// TestRunRejectsShapeCombinations: an unknown shape, and the file shape
// with a mode other than direct (the default) or kafka, fail before
// anything starts.
func TestRunRejectsShapeCombinations(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		mode, shape string
		want        error
	}{
		{ModeDirect, "column", ErrDemoShape},
		{ModeWebhook, ShapeFile, ErrShapeMode},
		{ModeCallback, ShapeFile, ErrShapeMode},
		{"carrier-pigeon", ShapeFile, ErrDemoMode},
	} {
		dir := t.TempDir()
		err := Run(t.Context(), Options{RunDir: dir, DemoMode: tt.mode, DemoShape: tt.shape, Out: &bytes.Buffer{}})
		if !errors.Is(err, tt.want) {
			t.Errorf("mode %s shape %s: err = %v, want %v", tt.mode, tt.shape, err, tt.want)
		}
		if entries, _ := os.ReadDir(dir); len(entries) != 0 {
			t.Errorf("a run folder was created: %v", entries)
		}
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
