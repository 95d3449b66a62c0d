package csvapp

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	executionv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/execution/v1"
)

// newFileConfig is newConfig in the file shape, with the object store in a
// temp dir that g serves FileCapability from.
func newFileConfig(t *testing.T, g *fakeGateway, input string) Config {
	t.Helper()
	cfg := newConfig(t, g, input)
	cfg.Shape = ShapeFile
	cfg.ObjectsDir = t.TempDir()
	cfg.ObjectsPrefix = "app"
	g.objectsDir = cfg.ObjectsDir
	return cfg
}

func fileName(t *testing.T, input string) string {
	t.Helper()
	b, err := os.ReadFile(input)
	if err != nil {
		t.Fatal(err)
	}
	return FileObjectName(input, sha256.Sum256(b))
}

func TestFileShapeEndToEnd(t *testing.T) {
	t.Parallel()
	g := startFakeGateway(t)
	cfg := newFileConfig(t, g, testdata("payments_1k.csv"))
	var stdout bytes.Buffer
	sum, err := Run(t.Context(), cfg, &stdout, nil)
	if err != nil {
		t.Fatal(err)
	}
	in := readPayments(t, cfg.Input)
	out := readOutput(t, filepath.Join(cfg.OutDir, "payments_1k.out.csv"))
	checkOutput(t, in, out, nil)
	for _, rec := range out {
		if rec[10] != sum.ExecutionID {
			t.Fatalf("row %s: execution id %q, want the file's %q", rec[0], rec[10], sum.ExecutionID)
		}
	}
	if sum.RowsIn != 1000 || sum.InvokedNew != 1 || sum.InvokedDuplicate != 0 || sum.Succeeded != 802 || sum.Failed != 198 ||
		sum.OtherTerminal != 0 || sum.Pending != 0 || sum.EventsDelivered != 1 || sum.Window != 128 || sum.MaxInFlight != 128 {
		t.Errorf("summary = %+v", sum)
	}
	if got := g.accepted.Load(); got != 1 {
		t.Errorf("gateway accepted %d executions, want 1", got)
	}
	// The upload is the file (well-formed: re-encoding changes nothing),
	// under a key named after the file and its hash.
	name := fileName(t, cfg.Input)
	if !strings.HasPrefix(name, "payments_1k-") || len(name) != len("payments_1k-")+16 {
		t.Errorf("object name %q", name)
	}
	up, err := os.ReadFile(filepath.Join(cfg.ObjectsDir, "app", "uploads", name+".csv"))
	if err != nil {
		t.Fatal(err)
	}
	orig, _ := os.ReadFile(cfg.Input)
	if !bytes.Equal(up, orig) {
		t.Error("the uploaded object differs from the input file")
	}
	g.mu.Lock()
	ex, ok := g.byKey["csv-payments-file:"+name]
	g.mu.Unlock()
	if !ok || ex.GetExecutionId() != sum.ExecutionID {
		t.Errorf("no execution under the file's idempotency key (%v)", ok)
	}
	m := parseSummary(t, stdout.String())
	for k, v := range map[string]string{
		"rows in": "1000", "invoked new": "1", "invoked duplicate": "0", "succeeded": "802", "failed": "198",
		"events delivered": "1", "output": filepath.Join(cfg.OutDir, "payments_1k.out.csv"), "shape": "file",
		"execution": sum.ExecutionID, "window": "128", "max in flight": "128", "object": "app/outputs/" + name + ".out.csv",
	} {
		if m[k] != v {
			t.Errorf("summary %q = %q, want %q", k, m[k], v)
		}
	}
	if m["rows per second"] == "" || m["elapsed"] == "" {
		t.Errorf("summary lacks figures: %s", stdout.String())
	}
}

// TestFileShapeRerun runs the same file again: the invoke finds the same
// execution (DUPLICATE, terminal), whose outcome is read with Get, and the
// output is the same.
func TestFileShapeRerun(t *testing.T) {
	t.Parallel()
	g := startFakeGateway(t)
	cfg := newFileConfig(t, g, testdata("payments_12.csv"))
	first, err := Run(t.Context(), cfg, &bytes.Buffer{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	firstOut, _ := os.ReadFile(cfg.OutputPath())
	g.sendWebhooks.Store(false)
	cfg2 := newConfig(t, g, cfg.Input)
	cfg2.Shape, cfg2.ObjectsDir, cfg2.ObjectsPrefix = ShapeFile, cfg.ObjectsDir, cfg.ObjectsPrefix
	sum, err := Run(t.Context(), cfg2, &bytes.Buffer{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if sum.InvokedNew != 0 || sum.InvokedDuplicate != 1 || sum.ExecutionID != first.ExecutionID || sum.Succeeded != 9 || sum.Failed != 3 {
		t.Errorf("re-run summary = %+v (first %s)", sum, first.ExecutionID)
	}
	second, _ := os.ReadFile(cfg2.OutputPath())
	if !bytes.Equal(firstOut, second) || len(second) == 0 {
		t.Errorf("re-run output differs:\n%s\n---\n%s", firstOut, second)
	}
	if g.accepted.Load() != 1 {
		t.Errorf("accepted = %d, want 1", g.accepted.Load())
	}
}

// TestFileShapeReencodesUpload: spaces around fields and a byte order mark
// are dropped as the row shape drops them, so the output repeats the
// fields as the row shape writes them.
func TestFileShapeReencodesUpload(t *testing.T) {
	t.Parallel()
	g := startFakeGateway(t)
	in := filepath.Join(t.TempDir(), "spaced file.csv")
	if err := os.WriteFile(in, []byte("\ufeffID, Recipient ,Amount,Currency\r\n 1 , Ann ,10.00, EUR\r\n2,\"Bo, Jr\",9000.01,USD\r\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := newFileConfig(t, g, in)
	if _, err := Run(t.Context(), cfg, &bytes.Buffer{}, nil); err != nil {
		t.Fatal(err)
	}
	name := fileName(t, in)
	if !strings.HasPrefix(name, "spaced_file-") {
		t.Errorf("object name %q", name)
	}
	up, err := os.ReadFile(filepath.Join(cfg.ObjectsDir, "app", "uploads", name+".csv"))
	if err != nil {
		t.Fatal(err)
	}
	if want := "ID,Recipient,Amount,Currency\n1,Ann,10.00,EUR\n2,\"Bo, Jr\",9000.01,USD\n"; string(up) != want {
		t.Errorf("upload = %q, want %q", up, want)
	}
	checkOutput(t, readPayments(t, in), readOutput(t, cfg.OutputPath()), nil)
}

func TestFileShapeExecutionFailed(t *testing.T) {
	t.Parallel()
	g := startFakeGateway(t)
	g.fileFailure = &executionv1.Failure{Class: "source.invalid", Message: "line 3: bad"}
	cfg := newFileConfig(t, g, testdata("payments_12.csv"))
	var stdout bytes.Buffer
	_, err := Run(t.Context(), cfg, &stdout, nil)
	var fe *ExecutionFailedError
	if !errors.As(err, &fe) || fe.Status != "FAILED" || fe.Class != "source.invalid" || !strings.Contains(err.Error(), "line 3: bad") {
		t.Fatalf("err = %v, want *ExecutionFailedError", err)
	}
	if _, err := os.Stat(cfg.OutputPath()); !os.IsNotExist(err) {
		t.Errorf("output written for a failed execution: %v", err)
	}
	if stdout.Len() != 0 {
		t.Errorf("summary printed: %s", stdout.String())
	}
}

// TestFileShapeChecksOutput: an output object whose rows are not in input
// order is refused and not copied.
func TestFileShapeChecksOutput(t *testing.T) {
	t.Parallel()
	g := startFakeGateway(t)
	g.fileSwapRows = true
	cfg := newFileConfig(t, g, testdata("payments_12.csv"))
	_, err := Run(t.Context(), cfg, &bytes.Buffer{}, nil)
	if err == nil || !strings.Contains(err.Error(), "input order") {
		t.Fatalf("err = %v", err)
	}
	if _, err := os.Stat(cfg.OutputPath()); !os.IsNotExist(err) {
		t.Errorf("output written: %v", err)
	}
	entries, _ := os.ReadDir(cfg.OutDir)
	if len(entries) != 0 {
		t.Errorf("temporary files left: %v", entries)
	}
}

func TestFileShapeTimeout(t *testing.T) {
	t.Parallel()
	g := startFakeGateway(t)
	g.settle = false
	cfg := newFileConfig(t, g, testdata("payments_12.csv"))
	cfg.Timeout = 300 * time.Millisecond
	sum, err := Run(t.Context(), cfg, &bytes.Buffer{}, nil)
	var pe *PendingError
	if !errors.As(err, &pe) || pe.Pending != 12 || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want *PendingError with 12 rows", err)
	}
	if sum.Shape != ShapeFile || len(sum.ExecutionID) != 36 {
		t.Errorf("summary = %+v", sum)
	}
	if _, err := os.Stat(cfg.OutputPath()); !os.IsNotExist(err) {
		t.Errorf("output written: %v", err)
	}
}

func TestFileObjectName(t *testing.T) {
	t.Parallel()
	sum := sha256.Sum256([]byte("x"))
	h := hex.EncodeToString(sum[:8])
	for in, want := range map[string]string{
		"data/payments_10k.csv": "payments_10k-" + h,
		"a/My File (2).CSV":     "My_File__2_-" + h,
		"..hidden.csv":          "hidden-" + h,
		"..csv":                 "input-" + h,
		"dir/" + strings.Repeat("é", 40) + ".csv": strings.Repeat("_", 64) + "-" + h,
	} {
		if got := FileObjectName(in, sum); got != want {
			t.Errorf("FileObjectName(%q) = %q, want %q", in, got, want)
		}
	}
	j, err := newFileJob("app", "x/in.csv", sum)
	if err != nil {
		t.Fatal(err)
	}
	if j.sourceKey != "app/uploads/in-"+h+".csv" || j.outputKey != "app/outputs/in-"+h+".out.csv" || j.key != "csv-payments-file:in-"+h ||
		string(j.input) != `{"source":"app/uploads/in-`+h+`.csv","output":"app/outputs/in-`+h+`.out.csv"}` {
		t.Errorf("job = %+v, input %s", j, j.input)
	}
}

func TestParseConfigShape(t *testing.T) {
	t.Parallel()
	env := map[string]string{"CAPSTAN_GATEWAY": "127.0.0.1:7443", "CAPSTAN_API_KEY": "k", "APP_WEBHOOK_SECRET": testSecret}
	getenv := func(k string) string { return env[k] }
	cfg, _, err := ParseConfig([]string{"--input", "x.csv"}, getenv, &bytes.Buffer{})
	if err != nil || cfg.Shape != ShapeRow {
		t.Errorf("default shape = %q, %v", cfg.Shape, err)
	}
	_, _, err = ParseConfig([]string{"--input", "x.csv", "--shape", "file"}, getenv, &bytes.Buffer{})
	if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "--objects-dir") {
		t.Errorf("file shape without --objects-dir: %v", err)
	}
	_, _, err = ParseConfig([]string{"--input", "x.csv", "--shape", "column"}, getenv, &bytes.Buffer{})
	if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "--shape") {
		t.Errorf("unknown shape: %v", err)
	}
	env["APP_SHAPE"], env["APP_OBJECTS_DIR"] = "file", "/tmp/objects"
	_, _, err = ParseConfig([]string{"--input", "x.csv"}, getenv, &bytes.Buffer{})
	if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "--objects-prefix") {
		t.Errorf("file shape without --objects-prefix: %v", err)
	}
	env["APP_OBJECTS_PREFIX"] = "csv-payments-demo"
	cfg, _, err = ParseConfig([]string{"--input", "x.csv"}, getenv, &bytes.Buffer{})
	if err != nil || cfg.Shape != ShapeFile || cfg.ObjectsDir != "/tmp/objects" || cfg.ObjectsPrefix != "csv-payments-demo" {
		t.Errorf("env: %+v, %v", cfg, err)
	}
	cfg, _, err = ParseConfig([]string{"--input", "x.csv", "--shape", "row"}, getenv, &bytes.Buffer{})
	if err != nil || cfg.Shape != ShapeRow {
		t.Errorf("flag must win over env: %q, %v", cfg.Shape, err)
	}
}

func TestSummaryFormatFile(t *testing.T) {
	t.Parallel()
	s := Summary{RowsIn: 4, InvokedNew: 1, Succeeded: 3, Failed: 1, EventsDelivered: 1, Elapsed: 2 * time.Second,
		Output: "x.out.csv", Shape: ShapeFile, ExecutionID: "e-1", Window: 128, MaxInFlight: 4, Object: "outputs/x.out.csv"}
	var b bytes.Buffer
	if _, err := s.WriteTo(&b); err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(b.String(), "rows per second: 2.0\noutput: x.out.csv\nshape: file\nexecution: e-1\nwindow: 128\nmax in flight: 4\nobject: outputs/x.out.csv\n") {
		t.Errorf("summary:\n%s", b.String())
	}
}

// TestTransient: rate limits and outages are retried; a message over
// gRPC's size limit (a 5 MB field) is not, so such a row is rejected at
// once instead of waiting out the run's timeout.
func TestTransient(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{status.Error(codes.Unavailable, "connection refused"), true},
		{status.Error(codes.DeadlineExceeded, "slow"), true},
		{status.Error(codes.ResourceExhausted, "admission: too many requests"), true},
		{status.Error(codes.ResourceExhausted, "grpc: trying to send message larger than max (5242912 vs. 4194304)"), false},
		{status.Error(codes.InvalidArgument, "input"), false},
	} {
		if got := transient(tc.err); got != tc.want {
			t.Errorf("transient(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}
