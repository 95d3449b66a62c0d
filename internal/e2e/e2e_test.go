package e2e_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/csv"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/examples/csv-payments/payment"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/testutil/pgtest"
)

func TestMain(m *testing.M) {
	code := pgtest.RunMain(m)
	if binDir != "" {
		_ = os.RemoveAll(binDir) // ~190 MB of binaries per run
	}
	os.Exit(code)
}

// sharedData is the folder of real sample inputs beside the project.
func sharedData(t testing.TB, name string) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	p := filepath.Join(filepath.Dir(file), "..", "..", "..", "shared", "data", "csv-payments", name)
	if _, err := os.Stat(p); err != nil {
		t.Skipf("sample input %s not found (../shared/data/csv-payments is absent): %v", name, err)
	}
	return p
}

var (
	buildOnce sync.Once
	binDir    string
	buildErr  error
)

// buildBinaries builds the daemons, capstanctl and the example once per
// test binary.
func buildBinaries(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "capstan-e2e-bin-")
		if err != nil {
			buildErr = err
			return
		}
		binDir = dir
		_, file, _, _ := runtime.Caller(0)
		root := filepath.Join(filepath.Dir(file), "..", "..")
		for _, b := range [][2]string{
			{"gateway", "./cmd/gateway"}, {"dispatcher", "./cmd/dispatcher"}, {"consumer", "./cmd/consumer"},
			{"router", "./cmd/router"}, {"capstanctl", "./cmd/capstanctl"},
			{"csv-payments-provider", "./examples/csv-payments/provider"},
			{"csv-payments-app", "./examples/csv-payments/app"},
		} {
			cmd := exec.Command("go", "build", "-o", filepath.Join(dir, b[0]), b[1])
			cmd.Dir = root
			if out, err := cmd.CombinedOutput(); err != nil {
				buildErr = &buildError{pkg: b[1], out: string(out), err: err}
				return
			}
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binDir
}

type buildError struct {
	pkg, out string
	err      error
}

func (e *buildError) Error() string { return "build " + e.pkg + ": " + e.err.Error() + "\n" + e.out }

// runDemo runs `capstanctl dev --demo-input input` against the database at
// dbURL and returns the app's summary as key → value.
func runDemo(t testing.TB, bin, dbURL, input string) map[string]string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(bin, "capstanctl"), "dev", "--bin-dir", bin,
		"--run-dir", t.TempDir(), "--demo-input", input)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+dbURL)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	t.Logf("capstanctl dev output:\n%s", out.String())
	require.NoError(t, err)
	summary := map[string]string{}
	sc := bufio.NewScanner(&out)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), ": "); ok {
			summary[k] = v
		}
	}
	return summary
}

func readCSV(t testing.TB, path string) [][]string {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	rows, err := csv.NewReader(f).ReadAll()
	require.NoError(t, err)
	return rows
}

func queryInt(t testing.TB, conn *pgx.Conn, sql string) int {
	t.Helper()
	var n int
	require.NoError(t, conn.QueryRow(context.Background(), sql).Scan(&n))
	return n
}

// TestCSVPaymentsThroughTheDaemons pushes the 1k sample through the four
// daemons as processes and checks: one output row per input row in order,
// every execution terminal, exactly one completion event per execution,
// every event delivered, outcomes equal to the provider's rules, and that a
// second run of the same file creates nothing new.
func TestCSVPaymentsThroughTheDaemons(t *testing.T) {
	if testing.Short() {
		t.Skip("end to end: starts the daemons as processes")
	}
	input := sharedData(t, "payments_1k.csv")
	bin := buildBinaries(t)
	dbURL := pgtest.NewDatabase(t, func(ctx context.Context, url string) error {
		_, err := pgstore.Migrate(ctx, url, nil)
		return err
	})

	summary := runDemo(t, bin, dbURL, input)
	require.Equal(t, "1000", summary["rows in"])
	require.Equal(t, "1000", summary["invoked new"])
	require.Equal(t, "0", summary["pending"])

	f, err := os.Open(input)
	require.NoError(t, err)
	payments, err := payment.ReadCSV(f)
	f.Close()
	require.NoError(t, err)
	rows := readCSV(t, summary["output"])
	require.Len(t, rows, len(payments)+1, "one output row per input row, plus the header")
	header := rows[0]
	col := map[string]int{}
	for i, h := range header {
		col[h] = i
	}
	succeeded := 0
	for i, p := range payments {
		row := rows[i+1]
		require.Equal(t, p.ID, row[col["ID"]], "row %d is in input order", i+1)
		want := payment.Decide(p)
		if want.Succeeded {
			succeeded++
			require.Equal(t, "SUCCEEDED", row[col["Status"]], "row %s", p.ID)
			require.Equal(t, want.Result.ProviderReference, row[col["ProviderReference"]])
			require.Equal(t, want.Result.Fee, row[col["Fee"]])
		} else {
			require.Equal(t, "FAILED", row[col["Status"]], "row %s", p.ID)
			require.Equal(t, want.FailureClass, row[col["FailureClass"]], "row %s", p.ID)
		}
	}
	require.Equal(t, summary["succeeded"], strconv.Itoa(succeeded))

	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dbURL)
	require.NoError(t, err)
	defer conn.Close(ctx)
	require.Equal(t, 1000, queryInt(t, conn, `SELECT count(*) FROM executions`))
	require.Zero(t, queryInt(t, conn, `SELECT count(*) FROM executions WHERE settled_at IS NULL`), "every execution is terminal")
	require.Zero(t, queryInt(t, conn, `SELECT count(*) FROM executions e WHERE (SELECT count(*) FROM completion_events c WHERE c.execution_id = e.id) <> 1`),
		"exactly one completion event per execution")
	require.Equal(t, 1000, queryInt(t, conn, `SELECT count(*) FROM completion_events WHERE status = 'DELIVERED'`))
	require.Zero(t, queryInt(t, conn, `SELECT count(*) FROM dispatch_records`), "no dispatch work left behind")
	retried := queryInt(t, conn, `SELECT count(*) FROM executions WHERE attempt > 1`)
	require.Positive(t, retried, "the provider's seeded retryable failures really cause retries")
	require.Zero(t, queryInt(t, conn, `SELECT count(*) FROM attempts WHERE outcome = 'RUNNING'`))

	// A second run of the same file creates no new executions and no events.
	again := runDemo(t, bin, dbURL, input)
	require.Equal(t, "0", again["invoked new"])
	require.Equal(t, "1000", again["invoked duplicate"])
	require.Equal(t, summary["succeeded"], again["succeeded"])
	require.Equal(t, 1000, queryInt(t, conn, `SELECT count(*) FROM executions`))
	require.Equal(t, 1000, queryInt(t, conn, `SELECT count(*) FROM completion_events`))
	rows2 := readCSV(t, again["output"])
	require.Len(t, rows2, len(rows))
	for i := range rows {
		require.Equal(t, rows[i][:col["Attempts"]], rows2[i][:col["Attempts"]], "same outcome for row %d", i)
	}
}
