package main

import (
	"bytes"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestRunExitCodes(t *testing.T) {
	t.Parallel()
	noEnv := func(string) string { return "" }
	var stdout, stderr bytes.Buffer
	if code := run(t.Context(), []string{"-h"}, noEnv, &stdout, &stderr); code != 0 {
		t.Errorf("-h: exit %d", code)
	}
	if !strings.Contains(stderr.String(), "-webhook-secret") {
		t.Errorf("usage lacks flags: %s", stderr.String())
	}
	stderr.Reset()
	if code := run(t.Context(), []string{"--gateway", "127.0.0.1:1"}, noEnv, &stdout, &stderr); code != 2 {
		t.Errorf("missing flags: exit %d", code)
	}
	env := map[string]string{
		"CAPSTAN_GATEWAY": "127.0.0.1:1", "CAPSTAN_API_KEY": "k",
		"APP_WEBHOOK_SECRET": "whsec_c2VjcmV0", "APP_INPUT": filepath.Join(t.TempDir(), "missing.csv"),
	}
	stderr.Reset()
	if code := run(t.Context(), nil, func(k string) string { return env[k] }, &stdout, &stderr); code != 1 {
		t.Errorf("missing input: exit %d", code)
	}
	if !strings.Contains(stderr.String(), "missing.csv") {
		t.Errorf("stderr = %s", stderr.String())
	}
	if stdout.Len() != 0 {
		t.Errorf("stdout = %q", stdout.String())
	}
}
