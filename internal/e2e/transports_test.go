package e2e_test

// The csv-payments demo over each way Capstan can reach the provider:
// direct (AdapterService calls), the await transports webhook and kafka
// (SYSTEM §6), and callback (AdapterService answering "accepted", completed
// through AdapterCallbackService on the interaction-api transport), run
// with `capstanctl dev --demo-mode`. Every mode must give the same output;
// the modes other than direct must leave exactly one completion per
// attempt, and a completion delivered twice must change nothing.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/capstan-dev/capstan/examples/csv-payments/payment"
	"github.com/capstan-dev/capstan/internal/devstack"
	"github.com/capstan-dev/capstan/internal/kafkatest"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/testutil/pgtest"
)

// transportInput is the 1k sample: ../shared/data when present, else the
// identical copy in examples/csv-payments/testdata.
func transportInput(t *testing.T) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	root := filepath.Join(filepath.Dir(file), "..", "..")
	for _, p := range []string{
		filepath.Join(root, "..", "shared", "data", "csv-payments", "payments_1k.csv"),
		filepath.Join(root, "examples", "csv-payments", "testdata", "payments_1k.csv"),
	} {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	t.Skip("payments_1k.csv found neither in ../shared/data/csv-payments nor in examples/csv-payments/testdata")
	return ""
}

// runDemoMode is runDemo with --demo-mode mode and extra environment
// variables for capstanctl and, through it, the daemons and the provider
// (which reads PROVIDER_* variables).
func runDemoMode(t *testing.T, bin, dbURL, input, mode string, env ...string) map[string]string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(bin, "capstanctl"), "dev", "--bin-dir", bin,
		"--run-dir", t.TempDir(), "--demo-input", input, "--demo-mode", mode)
	cmd.Env = append(append(os.Environ(), "DATABASE_URL="+dbURL), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	t.Logf("capstanctl dev --demo-mode %s output:\n%s", mode, out.String())
	if err != nil {
		if dir := demoRunFolder(out.String()); dir != "" {
			for _, name := range []string{"provider", "consumer", "gateway"} {
				t.Logf("%s.log (tail):\n%s", name, tail(filepath.Join(dir, name+".log"), 20))
			}
		}
	}
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

// demoRunFolder returns the run folder capstanctl dev printed.
func demoRunFolder(out string) string {
	for line := range strings.Lines(out) {
		if dir, ok := strings.CutPrefix(strings.TrimSpace(line), "run folder: "); ok {
			return dir
		}
	}
	return ""
}

// transportPayments reads the input's payments.
func transportPayments(t *testing.T, input string) []payment.Payment {
	t.Helper()
	f, err := os.Open(input)
	require.NoError(t, err)
	defer f.Close()
	payments, err := payment.ReadCSV(f)
	require.NoError(t, err)
	return payments
}

// requireOutputDecided checks the demo's output CSV: one row per input
// row in input order, each with the outcome payment.Decide gives, and
// returns its rows and the index of each column.
func requireOutputDecided(t *testing.T, summary map[string]string, payments []payment.Payment) ([][]string, map[string]int) {
	t.Helper()
	require.Equal(t, "0", summary["pending"])
	rows := readCSV(t, summary["output"])
	require.Len(t, rows, len(payments)+1, "one output row per input row, plus the header")
	col := map[string]int{}
	for i, h := range rows[0] {
		col[h] = i
	}
	for _, h := range []string{"ID", "Status", "ProviderReference", "Fee", "FailureClass", "Attempts", "ExecutionID"} {
		require.Contains(t, col, h, "output column")
	}
	for i, p := range payments {
		row := rows[i+1]
		require.Equal(t, p.ID, row[col["ID"]], "row %d is in input order", i+1)
		want := payment.Decide(p)
		if want.Succeeded {
			require.Equal(t, []string{"SUCCEEDED", want.Result.ProviderReference, want.Result.Fee, ""},
				[]string{row[col["Status"]], row[col["ProviderReference"]], row[col["Fee"]], row[col["FailureClass"]]}, "row %s", p.ID)
		} else {
			require.Equal(t, []string{"FAILED", "", "", want.FailureClass},
				[]string{row[col["Status"]], row[col["ProviderReference"]], row[col["Fee"]], row[col["FailureClass"]]}, "row %s", p.ID)
		}
	}
	return rows, col
}

// requireSettledOnce checks that every execution is terminal with exactly
// one completion event, none of them dead, and that retries happened.
func requireSettledOnce(t *testing.T, conn *pgx.Conn, n int) {
	t.Helper()
	require.Equal(t, n, queryInt(t, conn, `SELECT count(*) FROM executions`))
	require.Zero(t, queryInt(t, conn, `SELECT count(*) FROM executions WHERE settled_at IS NULL`), "every execution is terminal")
	require.Zero(t, queryInt(t, conn, `SELECT count(*) FROM executions e WHERE (SELECT count(*) FROM completion_events c WHERE c.execution_id = e.id) <> 1`),
		"exactly one completion event per execution")
	// Not "all DELIVERED": the app may learn the last outcomes by polling
	// and exit while the router still delivers their events, which then
	// stay PENDING when the stack stops.
	require.Zero(t, queryInt(t, conn, `SELECT count(*) FROM completion_events WHERE status = 'DEAD'`))
	require.Zero(t, queryInt(t, conn, `SELECT count(*) FROM attempts WHERE outcome = 'RUNNING'`))
	require.Positive(t, queryInt(t, conn, `SELECT count(*) FROM executions WHERE attempt > 1`),
		"the provider's seeded retryable failures really cause retries")
}

// requireOneCompletionPerAttempt checks the await modes' records: every
// execution has interactions, every attempt parked on exactly one await
// unit whose one interaction ended with exactly one completion — a
// retryable failure for every attempt but the last, the execution's
// outcome for the last — and no completion was refused.
func requireOneCompletionPerAttempt(t *testing.T, conn *pgx.Conn, n int, transport string) {
	t.Helper()
	require.Equal(t, n, queryInt(t, conn, `SELECT count(DISTINCT execution_id) FROM interactions`), "interactions for every execution")
	require.Zero(t, queryInt(t, conn, `SELECT count(*) FROM interactions WHERE transport <> '`+transport+`'`))
	require.Zero(t, queryInt(t, conn, `SELECT count(*) FROM interactions WHERE status NOT IN ('COMPLETED', 'FAILED')`),
		"no interaction left non-terminal, timed out or cancelled")
	require.Zero(t, queryInt(t, conn, `SELECT count(*) FROM await_units WHERE status NOT IN ('COMPLETED', 'FAILED')`))
	require.Zero(t, queryInt(t, conn, `
SELECT count(*) FROM (
  SELECT u.execution_id, u.attempt FROM await_units u JOIN interactions i ON i.await_unit_id = u.id
   WHERE i.status IN ('COMPLETED', 'FAILED')
   GROUP BY u.execution_id, u.attempt HAVING count(*) <> 1) twice`), "one completion per execution attempt")
	require.Zero(t, queryInt(t, conn, `
SELECT count(*) FROM executions e
 WHERE e.attempt <> (SELECT count(*) FROM await_units u WHERE u.execution_id = e.id)
    OR e.attempt <> (SELECT count(*) FROM attempts a WHERE a.execution_id = e.id)`), "every attempt parked on one await unit")
	require.Zero(t, queryInt(t, conn, `
SELECT count(*) FROM executions e JOIN await_units u ON u.execution_id = e.id JOIN interactions i ON i.await_unit_id = u.id
 WHERE (u.attempt < e.attempt AND NOT (i.status = 'FAILED' AND i.failure_retryable))
    OR (u.attempt = e.attempt AND (i.status = 'COMPLETED') <> (e.status = 'SUCCEEDED'))
    OR (u.attempt = e.attempt AND i.status = 'FAILED' AND i.failure_retryable)`),
		"retryable failures before the last attempt, the execution's outcome on it")
	var reasons []string
	rows, err := conn.Query(context.Background(), `SELECT reason FROM completion_refusals ORDER BY id`)
	require.NoError(t, err)
	reasons, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Empty(t, reasons, "no completion was refused")
}

// transportModes are the demo modes TestTransports compares, direct first.
var transportModes = []string{devstack.ModeDirect, devstack.ModeWebhook, devstack.ModeKafka, devstack.ModeCallback}

// TestTransports runs the 1k demo once per mode (in parallel, each on its
// own database and Kafka) and checks that the modes agree row by row except
// for Attempts and ExecutionID. In callback mode every attempt is accepted
// and parks on the interaction-api transport.
func TestTransports(t *testing.T) {
	if testing.Short() {
		t.Skip("end to end: runs the demo with the daemons as processes")
	}
	t.Parallel()
	input := transportInput(t)
	bin := buildBinaries(t)
	payments := transportPayments(t, input)

	var mu sync.Mutex
	outputs := map[string][][]string{}
	var columns map[string]int
	t.Run("mode", func(t *testing.T) {
		for _, mode := range transportModes {
			t.Run(mode, func(t *testing.T) {
				t.Parallel()
				dbURL := pgtest.NewDatabase(t, func(ctx context.Context, url string) error {
					_, err := pgstore.Migrate(ctx, url, nil)
					return err
				})
				summary := runDemoMode(t, bin, dbURL, input, mode)
				require.Equal(t, "1000", summary["rows in"])
				require.Equal(t, "1000", summary["invoked new"])
				rows, col := requireOutputDecided(t, summary, payments)

				ctx := context.Background()
				conn, err := pgx.Connect(ctx, dbURL)
				require.NoError(t, err)
				defer conn.Close(ctx)
				requireSettledOnce(t, conn, len(payments))
				switch mode {
				case devstack.ModeDirect:
					require.Zero(t, queryInt(t, conn, `SELECT count(*) FROM interactions`), "direct mode opens no interaction")
				case devstack.ModeCallback:
					requireOneCompletionPerAttempt(t, conn, len(payments), "interaction-api")
				default:
					requireOneCompletionPerAttempt(t, conn, len(payments), mode)
				}
				mu.Lock()
				outputs[mode], columns = rows, col
				mu.Unlock()
			})
		}
	})
	if len(outputs) != len(transportModes) {
		return // a mode failed and said why
	}
	varying := []int{columns["Attempts"], columns["ExecutionID"]}
	stable := func(row []string) []string {
		var out []string
		for i, v := range row {
			if !slices.Contains(varying, i) {
				out = append(out, v)
			}
		}
		return out
	}
	for _, mode := range transportModes[1:] {
		for i := range outputs[devstack.ModeDirect] {
			require.Equal(t, stable(outputs[devstack.ModeDirect][i]), stable(outputs[mode][i]),
				"%s mode, output line %d: same as direct mode but for Attempts and ExecutionID", mode, i+1)
		}
	}
}

// providerFinalStats returns the counts the provider logged when it
// stopped, from provider.log in the demo's run folder.
func providerFinalStats(t *testing.T, summary map[string]string) map[string]int64 {
	t.Helper()
	dir := summary["run folder"]
	require.NotEmpty(t, dir, "capstanctl dev printed its run folder")
	b, err := os.ReadFile(filepath.Join(dir, "provider.log"))
	require.NoError(t, err)
	for line := range strings.Lines(string(b)) {
		var rec map[string]any
		if json.Unmarshal([]byte(line), &rec) != nil || rec["msg"] != "provider stopped" {
			continue
		}
		out := map[string]int64{}
		for k, v := range rec {
			if f, ok := v.(float64); ok {
				out[k] = int64(f)
			}
		}
		return out
	}
	t.Fatalf("provider.log has no stop record:\n%s", b)
	return nil
}

// TestTransportDuplicateCompletions runs the await demos with a provider
// that delivers every completion twice, back to back (its hidden
// --duplicate-completions, set through the environment capstanctl passes
// on): the copies race the originals into admission, which must be
// idempotent — the same outcomes, one completion per attempt, no refusal.
// On kafka the test owns the broker and checks that every completion is
// on the response topic twice, identical, and that the completion
// consumer consumed every copy; on webhook the gateway must have answered
// every copy as a duplicate.
func TestTransportDuplicateCompletions(t *testing.T) {
	if testing.Short() {
		t.Skip("end to end: runs the demo with the daemons as processes")
	}
	t.Parallel()
	input := transportInput(t)
	bin := buildBinaries(t)
	payments := transportPayments(t, input)
	for _, mode := range []string{devstack.ModeKafka, devstack.ModeWebhook} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			dbURL := pgtest.NewDatabase(t, func(ctx context.Context, url string) error {
				_, err := pgstore.Migrate(ctx, url, nil)
				return err
			})
			env := []string{"PROVIDER_DUPLICATE_COMPLETIONS=true"}
			var kc *kafkatest.Cluster
			if mode == devstack.ModeKafka {
				var err error
				kc, err = kafkatest.Start(t.Context(), kafkatest.Options{Topics: map[string]int32{
					executionTopic: executionPartitions, devstack.RequestTopic: executionPartitions,
					devstack.ResponseTopic: executionPartitions,
				}})
				require.NoError(t, err)
				t.Cleanup(kc.Close)
				env = append(env, "KAFKA_BROKERS="+strings.Join(kc.Brokers(), ","))
			}

			summary := runDemoMode(t, bin, dbURL, input, mode, env...)
			require.Equal(t, "1000", summary["invoked new"])
			requireOutputDecided(t, summary, payments)
			ctx := t.Context()
			conn, err := pgx.Connect(ctx, dbURL)
			require.NoError(t, err)
			defer conn.Close(ctx)
			requireSettledOnce(t, conn, len(payments))
			requireOneCompletionPerAttempt(t, conn, len(payments), mode)
			interactions := int64(queryInt(t, conn, `SELECT count(*) FROM interactions`))

			final := providerFinalStats(t, summary)
			require.Equal(t, interactions, final["interactions"], "the provider answered every interaction")
			require.Equal(t, 2*interactions, final["completions"], "and delivered each completion twice")
			require.Zero(t, final["dropped"])
			if mode == devstack.ModeWebhook {
				require.Equal(t, interactions, final["duplicate_acks"], "the gateway answered every copy as a duplicate")
				return
			}
			requireResponseTopicDoubled(t, kc, interactions)
		})
	}
}

// requireResponseTopicDoubled checks that every completion is on the
// response topic twice, identical, and that the completion consumer
// committed past every copy.
func requireResponseTopicDoubled(t *testing.T, kc *kafkatest.Cluster, interactions int64) {
	t.Helper()
	ctx := t.Context()
	cl, err := kgo.NewClient(kgo.SeedBrokers(kc.Brokers()...), kgo.ConsumeTopics(devstack.ResponseTopic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(200*time.Millisecond))
	require.NoError(t, err)
	defer cl.Close()
	adm := kadm.NewClient(cl)
	ends, err := adm.ListEndOffsets(ctx, devstack.ResponseTopic)
	require.NoError(t, err)
	var total int64
	ends.Each(func(o kadm.ListedOffset) { total += o.Offset })
	require.Equal(t, 2*interactions, total, "two completion records per interaction")
	copies := map[string][][]byte{}
	pctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for read := int64(0); read < total; {
		fs := cl.PollFetches(pctx)
		require.NoError(t, pctx.Err(), "read %d of %d completion records", read, total)
		for _, r := range fs.Records() {
			copies[string(r.Key)] = append(copies[string(r.Key)], r.Value)
			read++
		}
	}
	require.Len(t, copies, int(interactions), "one correlation id per interaction")
	for key, vs := range copies {
		require.Len(t, vs, 2, "correlation id %s", key)
		require.Equal(t, vs[0], vs[1], "the copies of %s are identical", key)
	}

	// The completion consumer consumed every copy and committed past it.
	committed, err := adm.FetchOffsets(ctx, "capstan-consumer-completions")
	require.NoError(t, err)
	ends.Each(func(o kadm.ListedOffset) {
		if o.Offset == 0 {
			return
		}
		c, ok := committed.Lookup(o.Topic, o.Partition)
		require.True(t, ok, "partition %d committed", o.Partition)
		require.Equal(t, o.Offset, c.At, "partition %d consumed to its end", o.Partition)
	})
}
