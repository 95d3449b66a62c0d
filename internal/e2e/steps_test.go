package e2e_test

// Process-level failure tests of releases declared as steps (SYSTEM §6,
// package steps): one execution runs the 1k payments file through the
// kafka transport with a window; the consumer running its live session is
// SIGKILLed at a chosen point, a second consumer's reaper schedules the
// next attempt, which adopts the step unit and replays. Every test checks
// that the file was published once, complete and in input order, that no
// row got a second interaction, that no row completed before the kill was
// requested again, and that nothing partial was ever visible under the
// output's key.

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/examples/csv-payments/payment"
	"github.com/capstan-dev/capstan/internal/steps"
)

const (
	// stepsCapability is the release declared as steps (stackOptions.Steps).
	stepsCapability    = "payments.process-file"
	stepsRequestTopic  = "items.requests"
	stepsResponseTopic = "items.responses"
	// stepsSource and stepsOutput are the object keys of the execution's
	// input {"source": …, "output": …}.
	// Both lie under the application's prefix (its name, e2e-failures/).
	stepsSource = "e2e-failures/in/payments.csv"
	stepsOutput = "e2e-failures/out/payments.csv"
	// stepsTempPrefix starts the name of the Local object store's hidden
	// temporary file of a write session on stepsOutput
	// (internal/objectstore/local.go).
	stepsTempPrefix = ".capstan-tmp-payments.csv-"
	// stepsSettleTimeout bounds the wait for the execution to settle after
	// the kill: the lease (1 s) and the Kafka session of the dead consumer's
	// members (consumer.session_timeout, for both of its groups) expire,
	// then the next attempt replays — about 5-10 s; the rest is margin for
	// a loaded CI machine.
	stepsSettleTimeout = time.Minute
)

// stepsColumns render the output the per-row csv-payments application
// writes, as paymentColumns in internal/consumer/steps_test.go.
var stepsColumns = [][2]string{
	{"ID", "item.ID"}, {"Recipient", "item.Recipient"}, {"Amount", "item.Amount"}, {"Currency", "item.Currency"},
	{"Status", "status"}, {"ProviderReference", "result.provider_reference"}, {"Fee", "result.fee"},
	{"FailureClass", "failure.class"}, {"FailureMessage", "failure.message"}, {"Attempts", "sends"},
	{"ExecutionID", "execution_id"},
}

// stepsConfig renders what stackOptions.Steps adds to the configuration:
// the capability stepsCapability (appended to the capabilities list, which
// the configuration ends with), a fresh callback secret (the consumer signs
// the interactions' resume tokens with it) and the object store.
func (s *stack) stepsConfig() string {
	var secret [32]byte
	_, _ = rand.Read(secret[:]) // crypto/rand.Read never fails
	var cols strings.Builder
	for _, c := range stepsColumns {
		fmt.Fprintf(&cols, "          - {name: %s, value: %s}\n", c[0], c[1])
	}
	return fmt.Sprintf(`  - name: %s
    release: v1
    max_attempts: 10
    retry_delays: [50ms, 100ms, 200ms]
    lease_duration: %s
    async_budget: 10m
    steps:
      source: {format: csv}
      await: {transport: kafka, request_topic: %s, response_topic: %s, window: %d, timeout: 5m}
      publish:
        format: csv
        columns:
%scallback_secret: %q
object_store:
  dir: %q
`, stepsCapability, s.opts.LeaseDuration, stepsRequestTopic, stepsResponseTopic, s.opts.StepsWindow,
		cols.String(), base64.StdEncoding.EncodeToString(secret[:]), s.objects)
}

// startStepsProvider starts the example provider as the kafka transport's
// partner of stepsCapability, with the stack's latency and retryable
// fraction, logging at debug level (stepsResent reads its log).
func (s *stack) startStepsProvider() *proc {
	s.t.Helper()
	o := s.opts
	return s.start("provider", "csv-payments-provider", fmt.Sprintf("http://127.0.0.1:%d/stats", s.providerAdmin), nil,
		"--mode", "kafka", "--kafka-brokers", strings.Join(s.brokers, ","),
		"--request-topic", stepsRequestTopic, "--response-topic", stepsResponseTopic,
		"--admin-listen", fmt.Sprintf("127.0.0.1:%d", s.providerAdmin),
		"--latency-min", o.ProviderLatencyMin.String(), "--latency-max", o.ProviderLatencyMax.String(),
		"--retryable-fraction", fmt.Sprint(o.RetryableFraction), "--log-level", "debug")
}

// providerStats is the provider's GET /stats.
type providerStats struct {
	Calls        int64 `json:"calls"`
	Interactions int   `json:"interactions"`
	Resent       int64 `json:"resent"`
	Completions  int64 `json:"completions"`
}

func (s *stack) providerStats(t testing.TB) providerStats {
	t.Helper()
	resp, err := readyClient.Get(fmt.Sprintf("http://127.0.0.1:%d/stats", s.providerAdmin))
	require.NoError(t, err)
	defer resp.Body.Close()
	var st providerStats
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&st))
	return st
}

// stepsResent returns the interaction ids whose request the provider
// received again (its debug line "resent request ignored").
func stepsResent(t testing.TB, provider *proc) []string {
	t.Helper()
	var ids []string
	for _, line := range provider.logLines("resent request ignored") {
		var rec struct {
			InteractionID string `json:"interaction_id"`
		}
		require.NoError(t, json.Unmarshal([]byte(line), &rec), line)
		ids = append(ids, rec.InteractionID)
	}
	return ids
}

// tempObjects returns the names of the hidden temporary files of write
// sessions on stepsOutput, with their sizes.
func (s *stack) tempObjects(t testing.TB) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	entries, err := os.ReadDir(filepath.Join(s.objects, filepath.Dir(stepsOutput)))
	if os.IsNotExist(err) {
		return out
	}
	require.NoError(t, err)
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), stepsTempPrefix) {
			continue
		}
		if info, err := e.Info(); err == nil { // gone meanwhile: committed or aborted
			out[e.Name()] = info.Size()
		}
	}
	return out
}

// watchObject reads the file at path every few milliseconds until stop is
// called, and stop returns the distinct contents seen there, by SHA-256,
// with their sizes: an object published atomically is only ever seen
// complete.
func watchObject(path string) (stop func() map[[32]byte]int) {
	ctx, cancel := context.WithCancel(context.Background())
	seen := map[[32]byte]int{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			if b, err := os.ReadFile(path); err == nil {
				seen[sha256.Sum256(b)] = len(b)
			}
			select {
			case <-ctx.Done():
			case <-time.After(5 * time.Millisecond):
			}
		}
	}()
	return func() map[[32]byte]int { cancel(); <-done; return seen }
}

// itemCounts is the state of the execution's item interactions.
type itemCounts struct {
	Total, Dispatching, Dispatched, Terminal int
}

func (s *stack) itemCounts(ctx context.Context, id string) itemCounts {
	var c itemCounts
	if err := s.db.QueryRow(ctx, `
SELECT count(*), count(*) FILTER (WHERE status = 'DISPATCHING'), count(*) FILTER (WHERE status = 'DISPATCHED'),
       count(*) FILTER (WHERE status IN ('COMPLETED', 'FAILED'))
  FROM interactions WHERE execution_id = $1`, id).Scan(&c.Total, &c.Dispatching, &c.Dispatched, &c.Terminal); err != nil {
		return itemCounts{Total: -1}
	}
	return c
}

// killWhen SIGKILLs consumer p at the first moment at which at holds while
// p is paused (SIGSTOP) and none of the execution's items is DISPATCHING
// (claimed by the session, its send not recorded). A paused process
// writes nothing, so the moment is exact: at the kill every item the dead
// session opened was either sent and recorded, or never sent. (An item
// left DISPATCHING would be sent again, with the same interaction id, only
// after its claim expires — steps.Runner.ClaimFor, 30 s — which the test
// does not wait for.)
func (s *stack) killWhen(t testing.TB, p *proc, id string, at func(itemCounts) bool) {
	t.Helper()
	ctx := t.Context()
	ok := pollUntil(ctx, 60*time.Second, 5*time.Millisecond, func() bool {
		if !at(s.itemCounts(ctx, id)) {
			return false
		}
		p.pause(t)
		// A transaction whose COMMIT the process sent just before the
		// pause still lands: wait until what it wrote is visible (two reads
		// 20 ms apart agree) before judging the moment.
		c := s.itemCounts(ctx, id)
		for {
			time.Sleep(20 * time.Millisecond)
			again := s.itemCounts(ctx, id)
			if again == c {
				break
			}
			c = again
		}
		if c.Dispatching == 0 && at(c) {
			return true
		}
		p.resume(t)
		return false
	})
	require.True(t, ok, "the kill point was never reached: items %+v, %s", s.itemCounts(ctx, id), s.progress(ctx))
	p.kill(t)
}

// atKill is what the dead session left behind.
type atKill struct {
	items    itemCounts
	terminal map[string]bool  // interaction ids COMPLETED or FAILED
	temps    map[string]int64 // temporary objects of stepsOutput
}

// recordKill records, right after the kill, what the dead session left
// behind, and checks that nothing was published under the output's key.
func (s *stack) recordKill(t testing.TB, id string) atKill {
	t.Helper()
	ctx := t.Context()
	k := atKill{items: s.itemCounts(ctx, id), terminal: map[string]bool{}, temps: s.tempObjects(t)}
	rows, err := s.db.Query(ctx, `SELECT id::text FROM interactions WHERE execution_id = $1 AND status IN ('COMPLETED', 'FAILED')`, id)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	for _, iid := range ids {
		k.terminal[iid] = true
	}
	require.Len(t, k.terminal, k.items.Terminal)
	_, err = os.Stat(filepath.Join(s.objects, stepsOutput))
	require.True(t, os.IsNotExist(err), "nothing is published under %s before the execution succeeds (stat: %v)", stepsOutput, err)
	return k
}

// TestStepsConsumerKilled runs payments_1k.csv as one execution of a
// release declared as steps, window 32, and SIGKILLs the consumer running
// its live session at three points, one per subtest; a second consumer
// takes over:
//
//   - dispatched: the provider is paused (SIGSTOP) from the start, so the
//     window fills with sent items of which none completes; the consumer
//     is killed, the new one started, the provider resumed;
//   - completed: at least 300 items have completed;
//   - publishing: at least 500 items have completed and rows are being
//     streamed into the output's temporary object (non-empty), which is
//     not yet published.
//
// In each, the execution succeeds on a later attempt, which adopted the
// unit: the output holds one row per input row in input order, each as
// payment.Decide says; every row has exactly one interaction; the new
// attempt sent only the rows the dead session never sent and replayed the
// stored completions; the provider was never asked again for an item that
// had completed, and answered each item once; the execution has exactly
// one completion event; and the output's key never showed anything but the
// complete object. The subtests run in parallel, each on its own stack.
func TestStepsConsumerKilled(t *testing.T) {
	skipShort(t)
	const window = 32
	input := transportInput(t)
	payments := transportPayments(t, input)
	succeeded := 0
	for _, p := range payments {
		if payment.Decide(p).Succeeded {
			succeeded++
		}
	}
	killPoints := []struct {
		name string
		// pauseProvider: the provider is paused before the invocation and
		// resumed after the new consumer started.
		pauseProvider bool
		// at says whether the kill point is reached.
		at func(t *testing.T, s *stack, c itemCounts) bool
	}{
		{"dispatched", true, func(_ *testing.T, _ *stack, c itemCounts) bool {
			return c.Total == window && c.Dispatched == window
		}},
		{"completed", false, func(_ *testing.T, _ *stack, c itemCounts) bool { return c.Terminal >= 300 }},
		{"publishing", false, func(t *testing.T, s *stack, c itemCounts) bool {
			if c.Terminal < 500 {
				return false
			}
			for _, size := range s.tempObjects(t) {
				if size > 0 {
					return true
				}
			}
			return false
		}},
	}
	for _, kp := range killPoints {
		t.Run(kp.name, func(t *testing.T) {
			t.Parallel()
			start := time.Now()
			s := newStack(t, stackOptions{Steps: true, StepsWindow: window, RetryableFraction: -1,
				ProviderLatencyMin: 10 * time.Millisecond, ProviderLatencyMax: 40 * time.Millisecond,
				SessionTimeout: 3 * time.Second})
			copyInto(t, input, filepath.Join(s.objects, stepsSource)) // the application uploads the file
			provider := s.startStepsProvider()
			s.startGateway()
			s.startDispatcher()
			s.startRouter()
			c1 := s.startConsumer("consumer-1")
			stopWatch := watchObject(filepath.Join(s.objects, stepsOutput))
			if kp.pauseProvider {
				provider.pause(t)
			}

			ctx := t.Context()
			in, _ := json.Marshal(steps.Input{Source: stepsSource, Output: stepsOutput})
			ictx, cancel := context.WithTimeout(ctx, 10*time.Second)
			resp, err := s.client.Invoke(ictx, stepsCapability, in, "application/json", "file-"+kp.name)
			cancel()
			require.NoError(t, err)
			id := resp.GetExecutionId()

			s.killWhen(t, c1, id, func(c itemCounts) bool { return kp.at(t, s, c) })
			killed := s.recordKill(t, id)
			killedAt := time.Now()
			t.Logf("killed consumer-1 %v after the start: items %+v, temporary objects %v",
				killedAt.Sub(start).Round(time.Millisecond), killed.items, killed.temps)
			require.Zero(t, killed.items.Dispatching, "no item was left half-sent")
			switch kp.name {
			case "dispatched":
				require.Equal(t, itemCounts{Total: window, Dispatched: window}, killed.items)
			case "publishing":
				require.Len(t, killed.temps, 1, "the dead session's temporary object")
				for _, size := range killed.temps {
					require.Positive(t, size, "rows were streamed into it")
				}
			}

			s.startConsumer("consumer-2")
			if kp.pauseProvider {
				provider.resume(t)
			}
			status := s.waitSettled(t, id, stepsSettleTimeout)
			t.Logf("settled %s %v after the kill", status, time.Since(killedAt).Round(time.Millisecond))
			require.Equal(t, "SUCCEEDED", status)
			seen := stopWatch()

			// The attempts: the killed one expired, the last one succeeded.
			var attempt int
			var output []byte
			require.NoError(t, s.db.QueryRow(ctx, `SELECT attempt, output FROM executions WHERE id = $1`, id).Scan(&attempt, &output))
			require.GreaterOrEqual(t, attempt, 2)
			var first, last [2]string
			require.NoError(t, s.db.QueryRow(ctx, `SELECT worker, outcome FROM attempts WHERE execution_id = $1 AND attempt = 1`, id).
				Scan(&first[0], &first[1]))
			require.Equal(t, [2]string{"consumer-1", "LEASE_EXPIRED"}, first, "the killed attempt was reaped")
			require.NoError(t, s.db.QueryRow(ctx, `SELECT worker, outcome FROM attempts WHERE execution_id = $1 AND attempt = $2`, id, attempt).
				Scan(&last[0], &last[1]))
			require.Equal(t, [2]string{"consumer-2", "SUCCEEDED"}, last)
			require.Len(t, s.procsNamed("consumer-2")[0].logLines("adopted the step unit of an earlier attempt"), attempt-1,
				"every later attempt adopted the unit")

			// The summary of the last attempt.
			var sum steps.Summary
			require.NoError(t, json.Unmarshal(output, &sum))
			t.Logf("summary: %+v", sum)
			n := len(payments)
			require.Equal(t, stepsOutput, sum.Object)
			require.Equal(t, []int{n, n, succeeded, n - succeeded}, []int{sum.Items, sum.Rows, sum.Succeeded, sum.Failed})
			require.Equal(t, window, sum.Window)
			require.Positive(t, sum.MaxInFlight)
			require.LessOrEqual(t, sum.MaxInFlight, window)
			require.Equal(t, n-killed.items.Total, sum.Sent, "the new attempt sent exactly the rows never sent before")
			require.GreaterOrEqual(t, sum.Replayed, len(killed.terminal), "rows completed before the kill were replayed")
			require.LessOrEqual(t, sum.Replayed, killed.items.Total, "only rows sent before the kill can be replayed")
			if kp.name != "dispatched" {
				require.Positive(t, sum.Replayed)
			}

			// The output: complete, in input order, as the provider decides;
			// never visible under its key before that.
			outPath := filepath.Join(s.objects, stepsOutput)
			b, err := os.ReadFile(outPath)
			require.NoError(t, err)
			require.Equal(t, int64(len(b)), sum.Bytes)
			require.Equal(t, fmt.Sprintf("%x", sha256.Sum256(b)), sum.SHA256)
			require.Equal(t, map[[32]byte]int{sha256.Sum256(b): len(b)}, seen, "the output's key only ever showed the complete object")
			requireStepsRows(t, payments, readCSV(t, outPath), id)
			// The Local store cannot remove the temporary object of a
			// session that died: at most the killed session's hidden
			// ".capstan-tmp-" file remains beside the output, never visible
			// as an object; the new session's was renamed into place.
			left := s.tempObjects(t)
			require.LessOrEqual(t, len(left), 1, "temporary objects left: %v", left)
			for name := range left {
				require.Contains(t, killed.temps, name, "only the killed session's temporary object is left")
			}

			// Every row got exactly one interaction, terminal.
			require.Equal(t, n, s.queryInt(t, `SELECT count(*) FROM interactions WHERE execution_id = $1`, id))
			require.Equal(t, n, s.queryInt(t, `SELECT count(DISTINCT seq) FROM interactions WHERE execution_id = $1`, id))
			require.Equal(t, n, s.queryInt(t, `SELECT count(*) FROM interactions WHERE execution_id = $1 AND status IN ('COMPLETED', 'FAILED')`, id))
			require.Equal(t, 1, s.queryInt(t, `SELECT count(*) FROM await_units WHERE execution_id = $1`, id), "one unit, adopted")
			require.Zero(t, s.queryInt(t, `SELECT count(*) FROM completion_refusals`), "no completion was refused")

			// The provider: no row completed before the kill was requested
			// again; only rows left half-sent could be (none here).
			resent := stepsResent(t, provider)
			for _, iid := range resent {
				require.False(t, killed.terminal[iid], "interaction %s, completed before the kill, was requested again", iid)
			}
			var st providerStats
			require.True(t, pollUntil(ctx, 10*time.Second, 20*time.Millisecond, func() bool {
				st = s.providerStats(t)
				return st.Completions >= int64(n)
			}), "the provider counted its completions: %+v", st)
			require.Len(t, resent, int(st.Resent))
			require.LessOrEqual(t, st.Resent, int64(killed.items.Dispatching), "only rows left half-sent may be sent again")
			require.LessOrEqual(t, st.Resent, int64(window))
			if kp.name != "dispatched" {
				require.Zero(t, st.Resent, "completed rows were never requested again")
			}
			require.Equal(t, providerStats{Calls: int64(n) + st.Resent, Interactions: n, Resent: st.Resent, Completions: int64(n)}, st,
				"the provider answered each row once")

			// Exactly one completion event, delivered.
			require.True(t, pollUntil(ctx, 30*time.Second, 50*time.Millisecond, func() bool {
				return s.queryIntNow(ctx, `SELECT count(*) FROM completion_events WHERE execution_id = $1 AND status = 'DELIVERED'`, id) == 1
			}), "the completion event was delivered: %s", s.progress(ctx))
			require.Equal(t, 1, s.queryInt(t, `SELECT count(*) FROM completion_events WHERE execution_id = $1`, id))
			require.Positive(t, s.deliveries(t, id))
			t.Logf("kill point %s took %v", kp.name, time.Since(start).Round(time.Millisecond))
		})
	}
}

// waitSettled waits until execution id is terminal and returns its status.
func (s *stack) waitSettled(t testing.TB, id string, timeout time.Duration) string {
	t.Helper()
	ctx := t.Context()
	var status string
	ok := pollUntil(ctx, timeout, 100*time.Millisecond, func() bool {
		return s.db.QueryRow(ctx, `SELECT status FROM executions WHERE id = $1 AND settled_at IS NOT NULL`, id).Scan(&status) == nil
	})
	require.True(t, ok, "execution %s not settled within %v: items %+v, %s", id, timeout, s.itemCounts(ctx, id), s.progress(ctx))
	return status
}

// requireStepsRows checks the published output against the provider's
// rules, row by row, in input order (checkPaymentRows in
// internal/consumer/steps_test.go): every row sent once, by execution id.
func requireStepsRows(t testing.TB, in []payment.Payment, out [][]string, id string) {
	t.Helper()
	require.Len(t, out, len(in)+1, "one output row per input row, plus the header")
	header := make([]string, len(stepsColumns))
	for i, c := range stepsColumns {
		header[i] = c[0]
	}
	require.Equal(t, header, out[0])
	for k, pay := range in {
		row := out[k+1]
		want := payment.Decide(pay)
		require.Equal(t, []string{pay.ID, pay.Recipient, pay.Amount, pay.Currency}, row[:4], "row %d", k+1)
		if want.Succeeded {
			require.Equal(t, []string{"SUCCEEDED", want.Result.ProviderReference, want.Result.Fee, "", ""}, row[4:9], "row %d", k+1)
		} else {
			require.Equal(t, []string{"FAILED", "", "", want.FailureClass, want.FailureMessage}, row[4:9], "row %d", k+1)
		}
		require.Equal(t, "1", row[9], "row %d was sent once", k+1)
		require.Equal(t, id, row[10], "row %d", k+1)
	}
}

// copyInto copies the file from to the path to, creating its directory.
func copyInto(t testing.TB, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(filepath.Dir(to), 0o755))
	require.NoError(t, os.WriteFile(to, b, 0o644))
}
