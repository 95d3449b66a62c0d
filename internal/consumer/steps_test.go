package consumer_test

import (
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/capstan-dev/capstan/examples/csv-payments/payment"
	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/gateway"
	"github.com/capstan-dev/capstan/internal/kafka"
	"github.com/capstan-dev/capstan/internal/steps"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/pkg/adapter"
	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
)

const testCallbackSecret = "c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0LXNlY3JldC0xMjM0NQ=="

// paymentColumns render the output the per-row csv-payments application
// writes (examples/csv-payments/app, OutputHeader).
var paymentColumns = []config.Column{
	{Name: "ID", Value: "item.ID"}, {Name: "Recipient", Value: "item.Recipient"}, {Name: "Amount", Value: "item.Amount"},
	{Name: "Currency", Value: "item.Currency"}, {Name: "Status", Value: "status"},
	{Name: "ProviderReference", Value: "result.provider_reference"}, {Name: "Fee", Value: "result.fee"},
	{Name: "FailureClass", Value: "failure.class"}, {Name: "FailureMessage", Value: "failure.message"},
	{Name: "Attempts", Value: "sends"}, {Name: "ExecutionID", Value: "execution_id"},
}

// withSteps declares capability 0 as steps over the kafka transport.
func withSteps(dir, cardinality string, window int, columns []config.Column) func(*config.Config) {
	return func(c *config.Config) {
		c.CallbackSecret = testCallbackSecret
		c.ObjectStore.Dir = dir
		cp := &c.Capabilities[0] // Adapter stays: it serves the map step's tests
		cp.MaxAttempts = 3
		cp.Steps = &config.ReleaseSteps{
			Source: &config.SourceStep{Format: "csv"},
			Await: &config.AwaitStep{Transport: "kafka", RequestTopic: "items.requests", ResponseTopic: "items.responses",
				Timeout: time.Minute, Cardinality: cardinality, Window: window, MaxItems: config.DefaultMaxItems},
			Publish: &config.PublishStep{Format: "csv", Columns: columns},
		}
	}
}

// partnerEvent is one request received or completion sent by the partner.
type partnerEvent struct {
	request       bool
	interactionID string
}

// kafkaPartner answers the kafka transport's requests with answer; it logs
// every request and completion in order.
type kafkaPartner struct {
	mu       sync.Mutex
	events   []partnerEvent
	requests map[string]int // by interaction id
	paused   chan struct{}  // closed: answering; while open, requests wait
}

func startKafkaPartner(t testing.TB, brokers []string, answer func(adapter.InteractionRequest) adapter.InteractionCompletion) *kafkaPartner {
	t.Helper()
	logger := slog.New(slog.DiscardHandler)
	cl, err := kafka.NewClient(brokers, logger, kgo.ConsumeTopics("items.requests"), kgo.ConsumerGroup("partner-"+uuid.NewString()),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(50*time.Millisecond), kgo.ProducerLinger(0))
	require.NoError(t, err)
	p := &kafkaPartner{requests: map[string]int{}, paused: make(chan struct{})}
	close(p.paused)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			fs := cl.PollFetches(ctx)
			var out []*kgo.Record
			fs.EachRecord(func(r *kgo.Record) {
				var req adapter.InteractionRequest
				if json.Unmarshal(r.Value, &req) != nil {
					return
				}
				p.mu.Lock()
				p.events = append(p.events, partnerEvent{request: true, interactionID: req.InteractionID})
				p.requests[req.InteractionID]++
				paused := p.paused
				p.mu.Unlock()
				select {
				case <-paused:
				case <-ctx.Done():
					return
				}
				c := answer(req)
				body, _ := json.Marshal(c)
				out = append(out, &kgo.Record{Topic: "items.responses", Key: []byte(req.CorrelationID), Value: body})
				p.mu.Lock()
				p.events = append(p.events, partnerEvent{interactionID: req.InteractionID})
				p.mu.Unlock()
			})
			if len(out) > 0 && ctx.Err() == nil {
				_ = cl.ProduceSync(ctx, out...).FirstErr()
			}
		}
	}()
	t.Cleanup(func() { cancel(); <-done; cl.Close() })
	return p
}

// decidePayment answers a payment item as the csv-payments provider does.
func decidePayment(req adapter.InteractionRequest) adapter.InteractionCompletion {
	c := adapter.InteractionCompletion{ResumeToken: req.ResumeToken, CorrelationID: req.CorrelationID}
	p, err := payment.DecodeJSON(req.Request)
	if err != nil {
		c.Failure = &adapter.CompletionFailure{Class: payment.ClassInputInvalid, Message: err.Error()}
		return c
	}
	out := payment.Decide(p)
	if out.Succeeded {
		c.Result = &adapter.CompletionResult{Output: out.Result.JSON()}
	} else {
		c.Failure = &adapter.CompletionFailure{Class: out.FailureClass, Message: out.FailureMessage}
	}
	return c
}

// invokeSteps inserts one execution of capability 0 over source → output.
func (p *pipeline) invokeSteps(t testing.TB, source, output string) uuid.UUID {
	t.Helper()
	policy := p.cfg.Capabilities[0].Policy()
	in, _ := json.Marshal(steps.Input{Source: source, Output: output})
	e, _, err := p.store.ExecutionInsert(context.Background(), pgstore.ExecutionInsertParams{
		ApplicationID: p.app.ID, Capability: "payments.send", Release: "v1", Mode: execution.ModeAsync,
		MaxAttempts: p.cfg.Capabilities[0].MaxAttempts, Input: in, ContentType: "application/json",
		RequestHash: []byte(output), AsyncBudget: policy.AsyncBudget, Status: execution.StatusQueued,
	})
	require.NoError(t, err)
	return e.ID
}

func copyFile(t testing.TB, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(filepath.Dir(to), 0o755))
	require.NoError(t, os.WriteFile(to, b, 0o644))
}

func readCSV(t *testing.T, path string) [][]string {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	recs, err := csv.NewReader(f).ReadAll()
	require.NoError(t, err)
	return recs
}

// TestStepsLiveKafkaWindow runs payments_10k.csv as one execution through
// a Kafka partner: one output row per input row, in input order, each row
// as the provider decides it; each row got one interaction and one
// request; and at no time was a request sent for row i before the partner
// had completed every row up to i-window (the window bounds what is
// dispatched and not yet consumed), which the session's own counter
// confirms.
func TestStepsLiveKafkaWindow(t *testing.T) {
	t.Parallel()
	const window = 64
	dir := t.TempDir()
	copyFile(t, "../../../shared/data/csv-payments/payments_10k.csv", filepath.Join(dir, "in", "payments.csv"))
	p := startPipeline(t, noAdapter, withSteps(dir, config.OneToOne, window, paymentColumns))
	partner := startKafkaPartner(t, p.brokers, decidePayment)
	id := p.invokeSteps(t, "in/payments.csv", "out/payments.csv")
	e := p.waitSettledWithin(t, []uuid.UUID{id}, 3*time.Minute)[id]
	require.Equal(t, execution.StatusSucceeded, e.Status, "failure: %+v", e.Failure)
	var sum steps.Summary
	require.NoError(t, json.Unmarshal(e.Output, &sum))
	require.Equal(t, 10000, sum.Items)
	require.Equal(t, 10000, sum.Rows)
	require.Equal(t, window, sum.MaxInFlight, "the window fills but is never exceeded")
	require.Equal(t, 10000, sum.Sent)

	in := readPaymentsFile(t, filepath.Join(dir, "in", "payments.csv"))
	out := readCSV(t, filepath.Join(dir, "out", "payments.csv"))
	checkPaymentRows(t, in, out, id)
	require.Equal(t, 8160, sum.Succeeded)

	// One interaction per row, each sent once.
	require.Equal(t, 10000, p.count(t, `SELECT count(*) FROM interactions WHERE execution_id = '`+id.String()+`'`))
	require.Equal(t, 10000, p.count(t, `SELECT count(DISTINCT seq) FROM interactions WHERE execution_id = '`+id.String()+`'`))
	seqOf := interactionSeqs(t, p, id)
	partner.mu.Lock()
	defer partner.mu.Unlock()
	require.Len(t, partner.requests, 10000)
	for iid, n := range partner.requests {
		require.Equal(t, 1, n, "interaction %s was requested %d times", iid, n)
	}
	// Replay the partner's log: a request for seq i may only arrive while
	// every seq ≤ i-window has been completed.
	done := make([]bool, 10000)
	prefix := 0
	for _, ev := range partner.events {
		seq := seqOf[ev.interactionID]
		if ev.request {
			require.Less(t, seq, prefix+window, "request for row %d before row %d was completed", seq+1, prefix+1)
			continue
		}
		done[seq] = true
		for prefix < len(done) && done[prefix] {
			prefix++
		}
	}
}

func readPaymentsFile(t *testing.T, path string) []payment.Payment {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	ps, err := payment.ReadCSV(f)
	require.NoError(t, err)
	return ps
}

// checkPaymentRows checks the output against the provider's rules, row by
// row, in input order.
func checkPaymentRows(t *testing.T, in []payment.Payment, out [][]string, id uuid.UUID) {
	t.Helper()
	require.Len(t, out, len(in)+1)
	require.Equal(t, "ID,Recipient,Amount,Currency,Status,ProviderReference,Fee,FailureClass,FailureMessage,Attempts,ExecutionID",
		strings.Join(out[0], ","))
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
		require.Equal(t, id.String(), row[10])
	}
}

func interactionSeqs(t *testing.T, p *pipeline, id uuid.UUID) map[string]int {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), p.url)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	rows, err := conn.Query(context.Background(), `SELECT id::text, seq FROM interactions WHERE execution_id = $1`, id)
	require.NoError(t, err)
	defer rows.Close()
	m := map[string]int{}
	for rows.Next() {
		var iid string
		var seq int
		require.NoError(t, rows.Scan(&iid, &seq))
		m[iid] = seq
	}
	require.NoError(t, rows.Err())
	return m
}

// TestStepsCardinalities runs each cardinality end to end over the kafka
// transport, including an empty input.
func TestStepsCardinalities(t *testing.T) {
	t.Parallel()
	items := "ID,Amount\n1,10\n2,20\n3,30\n"
	one := "ID,Amount\n7,70\n"
	empty := "ID,Amount\n"
	// The partner: a list request is summed (MANY_TO_ONE) or echoed with a
	// doubled amount (MANY_TO_MANY); one item is expanded into three rows
	// (ONE_TO_MANY) or doubled (ONE_TO_ONE).
	answer := func(card string) func(adapter.InteractionRequest) adapter.InteractionCompletion {
		return func(req adapter.InteractionRequest) adapter.InteractionCompletion {
			c := adapter.InteractionCompletion{ResumeToken: req.ResumeToken}
			var out any
			switch card {
			case config.OneToOne:
				var it map[string]string
				_ = json.Unmarshal(req.Request, &it)
				n, _ := strconv.Atoi(it["Amount"])
				out = map[string]any{"id": it["ID"], "double": n * 2}
			case config.ManyToOne:
				var list []map[string]string
				_ = json.Unmarshal(req.Request, &list)
				sum := 0
				for _, it := range list {
					n, _ := strconv.Atoi(it["Amount"])
					sum += n
				}
				out = map[string]any{"count": len(list), "sum": sum}
			case config.OneToMany:
				var it map[string]string
				_ = json.Unmarshal(req.Request, &it)
				out = []map[string]any{{"id": it["ID"], "part": 1}, {"id": it["ID"], "part": 2}, {"id": it["ID"], "part": 3}}
			case config.ManyToMany:
				var list []map[string]string
				_ = json.Unmarshal(req.Request, &list)
				res := []map[string]any{}
				for _, it := range list {
					n, _ := strconv.Atoi(it["Amount"])
					res = append(res, map[string]any{"id": it["ID"], "double": n * 2})
				}
				out = res
			}
			b, _ := json.Marshal(out)
			c.Result = &adapter.CompletionResult{Output: b}
			return c
		}
	}
	tests := []struct {
		card, input  string
		columns      []config.Column
		want         string
		interactions int
	}{
		{config.OneToOne, items, []config.Column{{Name: "id", Value: "item.ID"}, {Name: "double", Value: "result.double"}, {Name: "status", Value: "status"}},
			"id,double,status\n1,20,SUCCEEDED\n2,40,SUCCEEDED\n3,60,SUCCEEDED\n", 3},
		{config.OneToOne, empty, []config.Column{{Name: "id", Value: "item.ID"}}, "id\n", 0},
		{config.ManyToOne, items, []config.Column{{Name: "count", Value: "result.count"}, {Name: "sum", Value: "result.sum"}},
			"count,sum\n3,60\n", 1},
		{config.ManyToOne, empty, []config.Column{{Name: "count", Value: "result.count"}, {Name: "sum", Value: "result.sum"}},
			"count,sum\n0,0\n", 1},
		{config.OneToMany, one, []config.Column{{Name: "id", Value: "result.id"}, {Name: "part", Value: "result.part"}, {Name: "index", Value: "index"}},
			"id,part,index\n7,1,1\n7,2,2\n7,3,3\n", 1},
		{config.OneToMany, empty, []config.Column{{Name: "id", Value: "result.id"}}, "id\n", 0},
		{config.ManyToMany, items, []config.Column{{Name: "id", Value: "result.id"}, {Name: "double", Value: "result.double"}},
			"id,double\n1,20\n2,40\n3,60\n", 1},
		{config.ManyToMany, empty, []config.Column{{Name: "id", Value: "result.id"}}, "id\n", 0},
	}
	for _, tc := range tests {
		name := tc.card
		if tc.input == empty {
			name += "/empty"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			require.NoError(t, os.MkdirAll(filepath.Join(dir, "in"), 0o755))
			require.NoError(t, os.WriteFile(filepath.Join(dir, "in", "x.csv"), []byte(tc.input), 0o644))
			p := startPipeline(t, noAdapter, withSteps(dir, tc.card, 4, tc.columns))
			partner := startKafkaPartner(t, p.brokers, answer(tc.card))
			id := p.invokeSteps(t, "in/x.csv", "out/x.csv")
			e := p.waitSettledWithin(t, []uuid.UUID{id}, time.Minute)[id]
			require.Equal(t, execution.StatusSucceeded, e.Status, "failure: %+v", e.Failure)
			got, err := os.ReadFile(filepath.Join(dir, "out", "x.csv"))
			require.NoError(t, err)
			require.Equal(t, tc.want, string(got))
			require.Equal(t, tc.interactions, p.count(t, `SELECT count(*) FROM interactions`))
			partner.mu.Lock()
			require.Len(t, partner.requests, tc.interactions, "requests sent")
			partner.mu.Unlock()
		})
	}
}

// TestStepsLimitsAndBadInput: a collecting cardinality over more than
// max_items items, a missing source, an input without an output key and a
// malformed row each fail the execution with a class that says why, and
// publish nothing.
func TestStepsLimitsAndBadInput(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	var big bytes.Buffer
	big.WriteString("ID,Amount\n")
	for i := range 11 {
		fmt.Fprintf(&big, "%d,1\n", i)
	}
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "in"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "in", "big.csv"), big.Bytes(), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "in", "bad.csv"), []byte("ID,Amount\n1,2\n3\n"), 0o644))
	p := startPipeline(t, noAdapter, withSteps(dir, config.ManyToMany, 4, nil), func(c *config.Config) {
		c.Capabilities[0].Steps.Await.MaxItems = 10
	})
	startKafkaPartner(t, p.brokers, func(req adapter.InteractionRequest) adapter.InteractionCompletion {
		return adapter.InteractionCompletion{ResumeToken: req.ResumeToken, Result: &adapter.CompletionResult{Output: []byte(`[]`)}}
	})
	tests := []struct{ source, output, class, message string }{
		{"in/big.csv", "out/big.csv", steps.ClassTooManyItems, "more than await.max_items (10)"},
		{"in/missing.csv", "out/missing.csv", steps.ClassInputInvalid, `input.source: no object "in/missing.csv"`},
		{"in/bad.csv", "out/bad.csv", steps.ClassSourceInvalid, "line 3"},
		{"in/big.csv", "../escape.csv", steps.ClassInputInvalid, "input.output"},
	}
	for _, tc := range tests {
		id := p.invokeSteps(t, tc.source, tc.output)
		e := p.waitSettledWithin(t, []uuid.UUID{id}, time.Minute)[id]
		require.Equal(t, execution.StatusFailed, e.Status, tc.source)
		require.Equal(t, tc.class, e.Failure.Class, tc.source)
		require.Contains(t, e.Failure.Message, tc.message)
		require.Equal(t, 1, e.Attempt, "%s: not retried", tc.source)
		_, err := os.Stat(filepath.Join(dir, tc.output))
		require.True(t, os.IsNotExist(err), "%s: nothing published", tc.output)
	}
	require.Zero(t, p.count(t, `SELECT count(*) FROM interactions`), "nothing was sent")
}

// TestStepsPublishFailure: when the output cannot be committed (storage
// failing at the moment of the commit), the execution does not succeed and
// nothing is visible under the final key; the retry replays the stored
// completions instead of sending the items again, and publishes.
func TestStepsPublishFailure(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "in"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "in", "x.csv"), []byte("ID,Amount\n1,10\n2,20\n3,30\n"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, failCommitsFile), []byte("2"), 0o644))
	p := startPipeline(t, noAdapter, withSteps(dir, config.OneToOne, 2, nil))
	partner := startKafkaPartner(t, p.brokers, func(req adapter.InteractionRequest) adapter.InteractionCompletion {
		return adapter.InteractionCompletion{ResumeToken: req.ResumeToken, Result: &adapter.CompletionResult{Output: []byte(`{"ok":true}`)}}
	})
	final := filepath.Join(dir, "out", "x.csv")
	stop := watchFile(final)
	id := p.invokeSteps(t, "in/x.csv", "out/x.csv")
	e := p.waitSettledWithin(t, []uuid.UUID{id}, time.Minute)[id]
	seen := stop()
	require.Equal(t, execution.StatusSucceeded, e.Status, "failure: %+v", e.Failure)
	require.Equal(t, 3, e.Attempt, "two failed publishes, two retries")
	require.Equal(t, 2, p.count(t, `SELECT count(*) FROM attempts WHERE execution_id = $1 AND failure_class = $2`, id, steps.ClassPublishFailed))
	got, err := os.ReadFile(final)
	require.NoError(t, err)
	require.Len(t, seen, 1, "only the complete object was ever visible under the final key")
	require.Contains(t, seen, string(got))
	var sum steps.Summary
	require.NoError(t, json.Unmarshal(e.Output, &sum))
	require.Equal(t, 3, sum.Replayed, "the last attempt fed every row from its stored completion")
	require.Zero(t, sum.Sent)
	entries, err := os.ReadDir(filepath.Join(dir, "out"))
	require.NoError(t, err)
	require.Len(t, entries, 1, "no temporary object is left behind: %v", entries)
	partner.mu.Lock()
	defer partner.mu.Unlock()
	require.Len(t, partner.requests, 3)
	for iid, n := range partner.requests {
		require.Equal(t, 1, n, "interaction %s was sent again by a retry", iid)
	}
	require.Equal(t, 3, p.count(t, `SELECT count(*) FROM interactions`))
}

// TestStepsOutputKeyBlocked: an output key that can never be published (a
// directory in the way) fails the execution at once as input.invalid,
// naming input.output, and nothing appears under it.
func TestStepsOutputKeyBlocked(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "in"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "in", "x.csv"), []byte("ID,Amount\n1,10\n"), 0o644))
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "out", "x.csv", "keep"), 0o755))
	p := startPipeline(t, noAdapter, withSteps(dir, config.OneToOne, 2, nil))
	startKafkaPartner(t, p.brokers, func(req adapter.InteractionRequest) adapter.InteractionCompletion {
		return adapter.InteractionCompletion{ResumeToken: req.ResumeToken, Result: &adapter.CompletionResult{Output: []byte(`{}`)}}
	})
	id := p.invokeSteps(t, "in/x.csv", "out/x.csv")
	e := p.waitSettledWithin(t, []uuid.UUID{id}, time.Minute)[id]
	require.Equal(t, execution.StatusFailed, e.Status)
	require.Equal(t, steps.ClassInputInvalid, e.Failure.Class)
	require.Contains(t, e.Failure.Message, "input.output")
	require.Equal(t, 1, e.Attempt, "not retried")
	st, err := os.Stat(filepath.Join(dir, "out", "x.csv"))
	require.NoError(t, err)
	require.True(t, st.IsDir())
	entries, err := os.ReadDir(filepath.Join(dir, "out"))
	require.NoError(t, err)
	require.Len(t, entries, 1, "no temporary object is left behind: %v", entries)
}

// watchFile reads path every few milliseconds until stop is called; stop
// returns every distinct content seen there.
func watchFile(path string) (stop func() map[string]bool) {
	ctx, cancel := context.WithCancel(context.Background())
	seen := map[string]bool{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			if b, err := os.ReadFile(path); err == nil {
				seen[string(b)] = true
			}
			select {
			case <-ctx.Done():
			case <-time.After(2 * time.Millisecond):
			}
		}
	}()
	return func() map[string]bool { cancel(); <-done; return seen }
}

// TestStepsWebhookTransport: items go out as signed webhook POSTs and come
// back through the gateway's completion endpoint; a POST the partner
// refuses once is retried by the background sender, with the same
// interaction.
func TestStepsWebhookTransport(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	var src strings.Builder
	src.WriteString("ID,Amount\n")
	for i := 1; i <= 20; i++ {
		fmt.Fprintf(&src, "%d,%d\n", i, i*10)
	}
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "in"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "in", "x.csv"), []byte(src.String()), 0o644))

	var handler atomic.Pointer[gateway.CompletionHandler]
	gw := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { handler.Load().ServeHTTP(w, r) }))
	defer gw.Close()
	var mu sync.Mutex
	posts := map[string]int{}
	var wg sync.WaitGroup
	partner := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if err := adapter.VerifyWebhook(r.Header, partnerSecret, body, time.Now(), time.Minute); err != nil {
			http.Error(w, err.Error(), http.StatusUnauthorized)
			return
		}
		var req adapter.InteractionRequest
		require.NoError(t, json.Unmarshal(body, &req))
		var it map[string]string
		require.NoError(t, json.Unmarshal(req.Request, &it))
		mu.Lock()
		posts[it["ID"]]++
		n := posts[it["ID"]]
		mu.Unlock()
		if it["ID"] == "7" && n == 1 {
			http.Error(w, "busy", http.StatusServiceUnavailable) // the first POST of row 7 fails
			return
		}
		w.WriteHeader(http.StatusAccepted)
		wg.Add(1)
		go func() {
			defer wg.Done()
			done, _ := json.Marshal(adapter.InteractionCompletion{ResumeToken: req.ResumeToken,
				Result: &adapter.CompletionResult{Output: []byte(`{"ok":"` + it["ID"] + `"}`)}})
			hr, _ := http.NewRequest(http.MethodPost, req.CompletionURL, bytes.NewReader(done))
			if adapter.SignWebhook(hr.Header, partnerSecret, uuid.NewString(), time.Now(), done) != nil {
				return
			}
			if resp, err := http.DefaultClient.Do(hr); err == nil {
				resp.Body.Close()
			}
		}()
	}))
	defer partner.Close()
	defer wg.Wait()

	p := startPipeline(t, noAdapter, withSteps(dir, config.OneToOne, 4, []config.Column{
		{Name: "id", Value: "item.ID"}, {Name: "ok", Value: "result.ok"}, {Name: "sends", Value: "sends"}}),
		func(c *config.Config) {
			c.Gateway.PublicURL = gw.URL
			c.Capabilities[0].Steps.Await = &config.AwaitStep{Transport: "webhook", URL: partner.URL, Secret: partnerSecret,
				Timeout: time.Minute, Cardinality: config.OneToOne, Window: 4, MaxItems: config.DefaultMaxItems}
		})
	handler.Store(gateway.NewCompletionHandler(p.store, p.cfg, slog.New(slog.DiscardHandler)))
	id := p.invokeSteps(t, "in/x.csv", "out/x.csv")
	e := p.waitSettledWithin(t, []uuid.UUID{id}, time.Minute)[id]
	require.Equal(t, execution.StatusSucceeded, e.Status, "failure: %+v", e.Failure)
	out := readCSV(t, filepath.Join(dir, "out", "x.csv"))
	require.Len(t, out, 21)
	for i := 1; i <= 20; i++ {
		sends := "1"
		if i == 7 {
			sends = "2"
		}
		require.Equal(t, []string{strconv.Itoa(i), strconv.Itoa(i), sends}, out[i], "row %d", i)
	}
	require.Equal(t, 20, p.count(t, `SELECT count(*) FROM interactions`))
}

// TestStepsInteractionAPI: nothing is pushed; the items are listed as
// pending and completed through the interaction API, no more than the
// window at a time.
func TestStepsInteractionAPI(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "in"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "in", "x.jsonl"),
		[]byte("{\"n\":1}\n{\"n\":2}\n{\"n\":3}\n{\"n\":4}\n{\"n\":5}\n"), 0o644))
	p := startPipeline(t, noAdapter, withSteps(dir, config.OneToOne, 2, nil), func(c *config.Config) {
		st := c.Capabilities[0].Steps
		st.Source.Format = "jsonl"
		st.Publish.Format = "jsonl"
		st.Publish.Columns = []config.Column{{Name: "item", Value: "item"}, {Name: "result", Value: "result"}, {Name: "status", Value: "status"}}
		st.Await = &config.AwaitStep{Transport: "interaction-api", Timeout: time.Minute, Cardinality: config.OneToOne, Window: 2,
			MaxItems: config.DefaultMaxItems}
	})
	id := p.invokeSteps(t, "in/x.jsonl", "out/x.jsonl")
	ctx := context.Background()
	completed := 0
	require.Eventually(t, func() bool {
		pending, err := p.store.InteractionListPending(ctx, "payments.send", time.Time{}, uuid.Nil, 100)
		require.NoError(t, err)
		require.LessOrEqual(t, len(pending), 2, "never more pending than the window")
		for _, it := range pending {
			var in map[string]int
			require.NoError(t, json.Unmarshal(it.Request, &in))
			_, err := p.store.CompleteInteraction(ctx, pgstore.CompleteParams{InteractionID: it.ID, ApplicationID: p.app.ID,
				Outcome: execution.Outcome{Succeeded: true, Output: []byte(fmt.Sprintf(`{"square":%d}`, in["n"]*in["n"]))}})
			require.NoError(t, err)
			completed++
		}
		return completed == 5
	}, time.Minute, 20*time.Millisecond)
	e := p.waitSettledWithin(t, []uuid.UUID{id}, time.Minute)[id]
	require.Equal(t, execution.StatusSucceeded, e.Status, "failure: %+v", e.Failure)
	got, err := os.ReadFile(filepath.Join(dir, "out", "x.jsonl"))
	require.NoError(t, err)
	var want strings.Builder
	for n := 1; n <= 5; n++ {
		fmt.Fprintf(&want, `{"item":{"n":%d},"result":{"square":%d},"status":"SUCCEEDED"}`+"\n", n, n*n)
	}
	require.Equal(t, want.String(), string(got))
}

// TestStepsMap: each successful item's result goes through the map
// adapter before it is published; a map's non-retryable failure becomes
// that row's failure, not the execution's.
func TestStepsMap(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "in"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "in", "x.csv"), []byte("ID\n1\n2\n3\n"), 0o644))
	mapper := func(req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
		var in map[string]string
		_ = json.Unmarshal(req.GetInput(), &in)
		if in["id"] == "2" {
			return &adapterv1.ExecuteResponse{Outcome: &adapterv1.ExecuteResponse_Failure{Failure: &adapterv1.Failure{
				Class: "map.refused", Message: "no", Retryable: false}}}, nil
		}
		return &adapterv1.ExecuteResponse{Outcome: &adapterv1.ExecuteResponse_Result{Result: &adapterv1.Result{
			Output: []byte(`{"id":"` + in["id"] + `","mapped":true}`)}}}, nil
	}
	p := startPipeline(t, mapper, withSteps(dir, config.OneToOne, 2, []config.Column{
		{Name: "id", Value: "item.ID"}, {Name: "mapped", Value: "result.mapped"}, {Name: "status", Value: "status"}, {Name: "class", Value: "failure.class"}}),
		func(c *config.Config) {
			c.Capabilities[0].Steps.Map = &config.MapStep{Adapter: c.Capabilities[0].Adapter, Timeout: 5 * time.Second}
		})
	startKafkaPartner(t, p.brokers, func(req adapter.InteractionRequest) adapter.InteractionCompletion {
		var it map[string]string
		_ = json.Unmarshal(req.Request, &it)
		return adapter.InteractionCompletion{ResumeToken: req.ResumeToken, Result: &adapter.CompletionResult{Output: []byte(`{"id":"` + it["ID"] + `"}`)}}
	})
	id := p.invokeSteps(t, "in/x.csv", "out/x.csv")
	e := p.waitSettledWithin(t, []uuid.UUID{id}, time.Minute)[id]
	require.Equal(t, execution.StatusSucceeded, e.Status, "failure: %+v", e.Failure)
	got, err := os.ReadFile(filepath.Join(dir, "out", "x.csv"))
	require.NoError(t, err)
	require.Equal(t, "id,mapped,status,class\n1,true,SUCCEEDED,\n2,,FAILED,map.refused\n3,true,SUCCEEDED,\n", string(got))
}

// TestStepsShutdownHandsOver: a consumer that shuts down while a file's
// session waits hands the execution to its next attempt at once —
// RETRY_SCHEDULED, due now, class consumer.shutdown — without using up an
// attempt, and its sent items stay open for the next attempt to await.
func TestStepsShutdownHandsOver(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "in"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "in", "x.csv"), []byte("ID\n1\n2\n3\n4\n5\n"), 0o644))
	p := startPipeline(t, noAdapter, withSteps(dir, config.OneToOne, 2, nil))
	// Nobody answers: the session waits on a full window.
	id := p.invokeSteps(t, "in/x.csv", "out/x.csv")
	require.Eventually(t, func() bool {
		return p.count(t, `SELECT count(*) FROM interactions WHERE status = 'DISPATCHED'`) == 2
	}, 30*time.Second, 10*time.Millisecond)
	p.stopDaemons()

	e, err := p.store.ExecutionGet(context.Background(), uuid.Nil, id)
	require.NoError(t, err)
	require.Equal(t, execution.StatusRetryScheduled, e.Status)
	require.Equal(t, steps.ClassShutdown, e.Failure.Class)
	require.Equal(t, 1, e.Attempt)
	require.Equal(t, p.cfg.Capabilities[0].MaxAttempts+1, e.MaxAttempts, "the handed-over attempt does not count")
	require.Equal(t, 1, p.count(t, `SELECT count(*) FROM dispatch_records WHERE execution_id = $1 AND attempt = 2 AND due_at <= now()`, id))
	require.Equal(t, 2, p.count(t, `SELECT count(*) FROM interactions WHERE status = 'DISPATCHED'`), "sent items stay open")
	require.Equal(t, 1, p.count(t, `SELECT count(*) FROM await_units WHERE status = 'WAITING'`))
	_, err = os.Stat(filepath.Join(dir, "out", "x.csv"))
	require.True(t, os.IsNotExist(err))
}

// TestStepsMalformedRowSendsNothing: a malformed row deep in the file — a
// missing field, bytes that are not UTF-8, a row above the item size limit
// — fails a ONE_TO_ONE execution as source.invalid naming the line before
// a single row is sent.
func TestStepsMalformedRowSendsNothing(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "in"), 0o755))
	file := func(name string, bad string) {
		var b strings.Builder
		b.WriteString("ID,Amount\n")
		for i := 1; i <= 500; i++ {
			if i == 300 {
				b.WriteString(bad)
				continue
			}
			fmt.Fprintf(&b, "%d,%d\n", i, i)
		}
		require.NoError(t, os.WriteFile(filepath.Join(dir, "in", name), []byte(b.String()), 0o644))
	}
	file("short.csv", "300\n")
	file("latin1.csv", "300,Caf\xe9\n")
	file("huge.csv", "300,"+strings.Repeat("9", steps.MaxItemBytes)+"\n")
	p := startPipeline(t, noAdapter, withSteps(dir, config.OneToOne, 4, nil))
	partner := startKafkaPartner(t, p.brokers, func(req adapter.InteractionRequest) adapter.InteractionCompletion {
		return adapter.InteractionCompletion{ResumeToken: req.ResumeToken, Result: &adapter.CompletionResult{Output: []byte(`{}`)}}
	})
	for _, tc := range []struct{ name, want string }{
		{"short.csv", "line 301: row has a different number of fields"},
		{"latin1.csv", "line 301 column 5: field Amount is not valid UTF-8"},
		{"huge.csv", "line 301: row of 262147 bytes is longer than the maximum of 262144"},
	} {
		id := p.invokeSteps(t, "in/"+tc.name, "out/"+tc.name)
		e := p.waitSettledWithin(t, []uuid.UUID{id}, time.Minute)[id]
		require.Equal(t, execution.StatusFailed, e.Status, tc.name)
		require.Equal(t, steps.ClassSourceInvalid, e.Failure.Class, tc.name)
		require.Contains(t, e.Failure.Message, tc.want, tc.name)
		require.Equal(t, 1, e.Attempt, "%s: not retried", tc.name)
	}
	require.Zero(t, p.count(t, `SELECT count(*) FROM interactions`), "no row was sent")
	partner.mu.Lock()
	defer partner.mu.Unlock()
	require.Empty(t, partner.requests)
}
