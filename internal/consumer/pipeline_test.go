package consumer_test

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.opentelemetry.io/otel/metric"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/capstan-dev/capstan/internal/adapterclient"
	"github.com/capstan-dev/capstan/internal/admission"
	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/consumer"
	"github.com/capstan-dev/capstan/internal/dispatcher"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/kafka"
	"github.com/capstan-dev/capstan/internal/kafkatest"
	"github.com/capstan-dev/capstan/internal/objectstore"
	"github.com/capstan-dev/capstan/internal/steps"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/testutil/pgtest"
	"github.com/capstan-dev/capstan/internal/token"
	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
	dispatchv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/dispatch/v1"
)

func TestMain(m *testing.M) { os.Exit(pgtest.RunMain(m)) }

// fakeAdapter answers Execute with a scripted function and counts calls per
// execution.
type fakeAdapter struct {
	adapterv1.UnimplementedAdapterServiceServer
	answer func(req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error)
	mu     sync.Mutex
	calls  map[string]int
}

func (f *fakeAdapter) Execute(_ context.Context, req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
	f.mu.Lock()
	f.calls[req.GetExecutionId()]++
	f.mu.Unlock()
	return f.answer(req)
}

func (f *fakeAdapter) callsOf(id uuid.UUID) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[id.String()]
}

func ok(*adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
	return &adapterv1.ExecuteResponse{Outcome: &adapterv1.ExecuteResponse_Result{Result: &adapterv1.Result{Output: []byte(`{"ok":true}`)}}}, nil
}

type pipeline struct {
	store   *pgstore.Store
	url     string
	cfg     *config.Config
	adapter *fakeAdapter
	brokers []string
	app     pgstore.Application
	kafka   *kafkatest.Cluster
	// stopDaemons stops the dispatcher, consumer, reaper and senders, as
	// if their process died; the store stays usable.
	stopDaemons func()
}

// startPipeline runs a dispatcher and a consumer in this process against a
// fresh database, an embedded Kafka and a fake adapter.
func startPipeline(t testing.TB, answer func(*adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error), opts ...func(*config.Config)) *pipeline {
	t.Helper()
	return startPipelineMetered(t, answer, nil, opts...)
}

// startPipelineMetered is startPipeline recording the dispatcher's and the
// consumer's metrics on mp (nil: the global provider).
func startPipelineMetered(t testing.TB, answer func(*adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error), mp metric.MeterProvider, opts ...func(*config.Config)) *pipeline {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	url := pgtest.NewDatabase(t, func(ctx context.Context, url string) error {
		_, err := pgstore.Migrate(ctx, url, nil)
		return err
	})
	st, err := pgstore.Open(ctx, url, nil)
	require.NoError(t, err)
	app, err := st.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: "a", APIKey: "k"})
	require.NoError(t, err)

	topic := "capstan.executions"
	kc, err := kafkatest.Start(ctx, kafkatest.Options{Topics: map[string]int32{topic: 4}})
	require.NoError(t, err)

	fa := &fakeAdapter{answer: answer, calls: map[string]int{}}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	gs := grpc.NewServer()
	adapterv1.RegisterAdapterServiceServer(gs, fa)
	go func() { _ = gs.Serve(lis) }()

	cfg := &config.Config{
		Kafka:      config.Kafka{Brokers: kc.Brokers(), ExecutionTopic: topic},
		Dispatcher: config.Dispatcher{PassInterval: 50 * time.Millisecond, BatchSize: 100, ClaimTTL: 5 * time.Second},
		Consumer:   config.Consumer{Group: "g", MaxInFlight: 16, ReapInterval: 100 * time.Millisecond},
		Capabilities: []config.Capability{{Name: "payments.send", Release: "v1", Adapter: lis.Addr().String(),
			RetryDelays: []time.Duration{10 * time.Millisecond}, LeaseDuration: 2 * time.Second, AttemptTimeout: 2 * time.Second}},
	}
	for _, o := range opts {
		o(cfg)
	}
	logger := slog.New(slog.DiscardHandler)
	if os.Getenv("PIPELINE_LOG") != "" {
		logger = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	prod, err := kafka.NewClient(cfg.Kafka.Brokers, logger, kgo.DefaultProduceTopic(topic))
	require.NoError(t, err)
	for _, cp := range cfg.Capabilities {
		if a := cp.AwaitStep(); a != nil && a.Transport == "kafka" {
			require.NoError(t, kafka.EnsureTopic(ctx, prod, a.RequestTopic, 2))
			require.NoError(t, kafka.EnsureTopic(ctx, prod, a.ResponseTopic, 2))
		}
	}
	var dopts []dispatcher.Option
	var copts []consumer.Option
	if mp != nil {
		dopts = append(dopts, dispatcher.WithMeterProvider(mp))
		copts = append(copts, consumer.WithMeterProvider(mp))
	}
	d := dispatcher.New(st, prod, cfg.Dispatcher, topic, "d1", logger, dopts...)
	offsets := consumer.NewOffsetTracker()
	cons, err := kafka.NewClient(cfg.Kafka.Brokers, logger, consumer.ClientOpts(cfg, offsets, logger)...)
	require.NoError(t, err)
	var sender *consumer.InteractionSender
	if cfg.CallbackSecret != "" {
		key, _ := base64.StdEncoding.DecodeString(cfg.CallbackSecret)
		signer, _ := token.NewSigner(key)
		sender = consumer.NewInteractionSender(st, cfg, signer, prod, logger)
	}
	var listen func(context.Context) error
	if cfg.ObjectStore.Dir != "" {
		local, err := objectstore.NewLocal(cfg.ObjectStore.Dir)
		require.NoError(t, err)
		var objects objectstore.Store = local
		if b, err := os.ReadFile(filepath.Join(cfg.ObjectStore.Dir, failCommitsFile)); err == nil {
			n, err := strconv.Atoi(strings.TrimSpace(string(b)))
			require.NoError(t, err)
			objects = &failingCommits{Store: local, left: int64(n)}
		}
		hub := steps.NewHub()
		var s steps.Sender
		if sender != nil {
			s = sender
		}
		pool := adapterclient.NewPool()
		t.Cleanup(pool.Close)
		runner := steps.NewRunner(st, objects, s, pool, hub, logger)
		runner.Poll = 200 * time.Millisecond
		copts = append(copts, consumer.WithSteps(runner))
		listen = func(ctx context.Context) error { return st.ListenItems(ctx, hub.Notify) }
	}
	c := consumer.New(st, cons, cfg, offsets, "w1", logger, copts...)
	if mp != nil {
		stopLag, err := c.ObserveLag()
		require.NoError(t, err)
		t.Cleanup(stopLag)
	}

	runs := []func(context.Context) error{d.Run, c.Run, func(ctx context.Context) error { return c.Reap(ctx, cfg.Consumer.ReapInterval) }}
	var closers []func()
	if listen != nil {
		runs = append(runs, listen)
	}
	if sender != nil {
		runs = append(runs, sender.Run)
		if topics := consumer.ResponseTopics(cfg); len(topics) > 0 {
			admitter, err := admission.New(st, cfg)
			require.NoError(t, err)
			coffsets := consumer.NewOffsetTracker()
			cc, err := kafka.NewClient(cfg.Kafka.Brokers, logger, consumer.CompletionClientOpts(cfg, coffsets, logger)...)
			require.NoError(t, err)
			closers = append(closers, cc.Close)
			runs = append(runs, consumer.NewCompletionConsumer(cc, admitter, coffsets, logger).Run)
		}
	}
	var wg sync.WaitGroup
	for _, run := range runs {
		wg.Add(1)
		go func() { defer wg.Done(); _ = run(ctx) }()
	}
	t.Cleanup(func() {
		cancel()
		wg.Wait()
		for _, c := range closers {
			c()
		}
		cons.Close()
		prod.Close()
		gs.Stop()
		kc.Close()
		st.Close()
	})
	return &pipeline{store: st, url: url, cfg: cfg, adapter: fa, brokers: kc.Brokers(), app: app, kafka: kc,
		stopDaemons: func() { cancel(); wg.Wait() }}
}

func (p *pipeline) invoke(t testing.TB, n int) []uuid.UUID {
	t.Helper()
	policy := p.cfg.Capabilities[0].Policy()
	ids := make([]uuid.UUID, n)
	for i := range n {
		e, _, err := p.store.ExecutionInsert(context.Background(), pgstore.ExecutionInsertParams{
			ApplicationID: p.app.ID, Capability: "payments.send", Release: "v1", Mode: execution.ModeAsync,
			MaxAttempts: 10, Input: []byte(fmt.Sprintf(`{"i":%d}`, i)), ContentType: "application/json",
			RequestHash: []byte{byte(i)}, AsyncBudget: policy.AsyncBudget, Status: execution.StatusQueued,
		})
		require.NoError(t, err)
		ids[i] = e.ID
	}
	return ids
}

func (p *pipeline) waitSettled(t testing.TB, ids []uuid.UUID) map[uuid.UUID]execution.Execution {
	t.Helper()
	return p.waitSettledWithin(t, ids, 30*time.Second)
}

func (p *pipeline) waitSettledWithin(t testing.TB, ids []uuid.UUID, within time.Duration) map[uuid.UUID]execution.Execution {
	t.Helper()
	out := map[uuid.UUID]execution.Execution{}
	require.Eventually(t, func() bool {
		for _, id := range ids {
			if _, done := out[id]; done {
				continue
			}
			e, err := p.store.ExecutionGet(context.Background(), uuid.Nil, id)
			require.NoError(t, err)
			if !e.Status.Terminal() {
				return false
			}
			out[id] = e
		}
		return true
	}, within, 20*time.Millisecond)
	return out
}

func (p *pipeline) count(t testing.TB, sql string, args ...any) int {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), p.url)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	var n int
	require.NoError(t, conn.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

func TestPipelineHealthyPath(t *testing.T) {
	t.Parallel()
	p := startPipeline(t, ok)
	ids := p.invoke(t, 40)
	settled := p.waitSettled(t, ids)
	for _, id := range ids {
		require.Equal(t, execution.StatusSucceeded, settled[id].Status)
		require.Equal(t, 1, settled[id].Attempt)
		require.Equal(t, 1, p.adapter.callsOf(id))
	}
	require.Equal(t, 40, p.count(t, `SELECT count(*) FROM completion_events`))
}

func TestPipelineRetriesThenSettles(t *testing.T) {
	t.Parallel()
	p := startPipeline(t, func(req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
		if req.GetAttempt() < 3 {
			return &adapterv1.ExecuteResponse{Outcome: &adapterv1.ExecuteResponse_Failure{Failure: &adapterv1.Failure{
				Class: "provider.unavailable", Retryable: true}}}, nil
		}
		return ok(req)
	})
	ids := p.invoke(t, 5)
	settled := p.waitSettled(t, ids)
	for _, id := range ids {
		require.Equal(t, execution.StatusSucceeded, settled[id].Status)
		require.Equal(t, 3, settled[id].Attempt)
		require.Equal(t, 3, p.count(t, `SELECT count(*) FROM attempts WHERE execution_id = $1`, id))
		require.Equal(t, 2, p.count(t, `SELECT count(*) FROM attempts WHERE execution_id = $1 AND outcome = 'RETRYABLE_FAILURE'`, id))
	}
	require.Equal(t, 5, p.count(t, `SELECT count(*) FROM completion_events`))
}

func TestPipelineTerminalFailure(t *testing.T) {
	t.Parallel()
	p := startPipeline(t, func(*adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
		return &adapterv1.ExecuteResponse{Outcome: &adapterv1.ExecuteResponse_Failure{Failure: &adapterv1.Failure{
			Class: "payment.declined", Message: "over the limit"}}}, nil
	})
	ids := p.invoke(t, 3)
	for _, e := range p.waitSettled(t, ids) {
		require.Equal(t, execution.StatusFailed, e.Status)
		require.Equal(t, "payment.declined", e.Failure.Class)
		require.Equal(t, 1, e.Attempt, "a terminal failure is not retried")
	}
}

// TestPipelineDuplicateAndGarbageRecords publishes every dispatch several
// more times, concurrently and out of order, plus undecodable records on the
// same partitions: each execution still runs one attempt, and the garbage
// does not block its partition.
func TestPipelineDuplicateAndGarbageRecords(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	p := startPipeline(t, func(req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
		<-release
		return ok(req)
	})
	ids := p.invoke(t, 10)
	prod, err := kafka.NewClient(p.brokers, slog.New(slog.DiscardHandler), kgo.DefaultProduceTopic(p.cfg.Kafka.ExecutionTopic))
	require.NoError(t, err)
	defer prod.Close()
	var recs []*kgo.Record
	for _, id := range ids {
		v, err := proto.Marshal(&dispatchv1.ExecutionDispatch{DispatchId: uuid.NewString(), ExecutionId: id.String(), Attempt: 1})
		require.NoError(t, err)
		key := []byte(id.String())
		recs = append(recs, &kgo.Record{Key: key, Value: []byte("\xff\xffnot a protobuf")})
		for range 3 {
			recs = append(recs, &kgo.Record{Key: key, Value: v})
		}
		// An obsolete dispatch for an attempt that never comes.
		old, _ := proto.Marshal(&dispatchv1.ExecutionDispatch{DispatchId: uuid.NewString(), ExecutionId: id.String(), Attempt: 7})
		recs = append(recs, &kgo.Record{Key: key, Value: old})
	}
	var wg sync.WaitGroup
	var produced atomic.Int64
	for _, r := range recs {
		wg.Add(1)
		prod.Produce(context.Background(), r, func(_ *kgo.Record, err error) {
			defer wg.Done()
			require.NoError(t, err)
			produced.Add(1)
		})
	}
	wg.Wait()
	close(release)
	settled := p.waitSettled(t, ids)
	for _, id := range ids {
		require.Equal(t, execution.StatusSucceeded, settled[id].Status)
		require.Equal(t, 1, p.count(t, `SELECT count(*) FROM attempts WHERE execution_id = $1`, id), "one attempt despite 4 deliveries")
		require.Equal(t, 1, p.adapter.callsOf(id))
	}
	require.Equal(t, 10, p.count(t, `SELECT count(*) FROM completion_events`))
}

// TestPipelineBudget: a release whose budget is shorter than its retry
// delays settles TIMED_OUT / timeout.async_budget after the first failure,
// keeping the last failure class, through the real consumer.
func TestPipelineBudget(t *testing.T) {
	t.Parallel()
	p := startPipeline(t, func(*adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
		return &adapterv1.ExecuteResponse{Outcome: &adapterv1.ExecuteResponse_Failure{Failure: &adapterv1.Failure{
			Class: "provider.unavailable", Retryable: true}}}, nil
	}, func(c *config.Config) {
		c.Capabilities[0].AsyncBudget = 2 * time.Second
		c.Capabilities[0].RetryDelays = []time.Duration{time.Hour}
	})
	ids := p.invoke(t, 3)
	for _, e := range p.waitSettled(t, ids) {
		require.Equal(t, execution.StatusTimedOut, e.Status)
		require.Equal(t, execution.ReasonAsyncBudget, e.Failure.Reason)
		require.Equal(t, "provider.unavailable", e.Failure.Class)
		require.Equal(t, 1, e.Attempt)
	}
	require.Equal(t, 3, p.count(t, `SELECT count(*) FROM completion_events`))
}

// TestPipelineAttemptLimit: ten retryable failures settle FAILED with the
// last class and retry_exhausted.attempt_limit, ten attempt rows, one event.
func TestPipelineAttemptLimit(t *testing.T) {
	t.Parallel()
	p := startPipeline(t, func(req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
		return &adapterv1.ExecuteResponse{Outcome: &adapterv1.ExecuteResponse_Failure{Failure: &adapterv1.Failure{
			Class: fmt.Sprintf("provider.unavailable.%d", req.GetAttempt()), Retryable: true}}}, nil
	}, func(c *config.Config) { c.Capabilities[0].RetryDelays = []time.Duration{time.Millisecond} })
	ids := p.invoke(t, 2)
	for id, e := range p.waitSettled(t, ids) {
		require.Equal(t, execution.StatusFailed, e.Status)
		require.Equal(t, execution.ReasonAttemptLimit, e.Failure.Reason)
		require.Equal(t, "provider.unavailable.10", e.Failure.Class)
		require.Equal(t, 10, p.count(t, `SELECT count(*) FROM attempts WHERE execution_id = $1`, id))
		require.Equal(t, 10, p.adapter.callsOf(id))
	}
	require.Equal(t, 2, p.count(t, `SELECT count(*) FROM completion_events`))
}

// TestPipelineRidesOutKafkaOutage: while the broker fails every produce and
// fetch request, work is accepted and waits; when the broker is back, the
// dispatcher and the consumer carry on by themselves and everything settles
// once.
func TestPipelineRidesOutKafkaOutage(t *testing.T) {
	t.Parallel()
	p := startPipeline(t, ok)
	first := p.invoke(t, 5)
	p.waitSettled(t, first)

	var down atomic.Bool
	down.Store(true)
	var refused atomic.Int64
	fake := p.kafka.Fake()
	for _, key := range []int16{int16(kmsg.Produce), int16(kmsg.Fetch)} {
		fake.ControlKey(key, func(kmsg.Request) (kmsg.Response, error, bool) {
			if !down.Load() {
				fake.DropControl()
				return nil, nil, false
			}
			fake.KeepControl()
			refused.Add(1)
			return nil, errors.New("broker down"), true
		})
	}
	ids := p.invoke(t, 20)
	require.Eventually(t, func() bool { return refused.Load() >= 2 }, 10*time.Second, 10*time.Millisecond,
		"the outage is felt")
	for _, id := range ids {
		e, err := p.store.ExecutionGet(context.Background(), uuid.Nil, id)
		require.NoError(t, err)
		require.False(t, e.Status.Terminal(), "nothing settles while Kafka is down")
	}
	down.Store(false)
	settled := p.waitSettled(t, ids)
	for _, id := range ids {
		require.Equal(t, execution.StatusSucceeded, settled[id].Status)
		require.Equal(t, 1, p.count(t, `SELECT count(*) FROM completion_events WHERE execution_id = $1`, id))
	}
}

var testSecret = []byte("pipeline-callback-secret-32-bytes!!")

func withCallbacks(c *config.Config) {
	c.CallbackSecret = base64.StdEncoding.EncodeToString(testSecret)
}

func accepted() *adapterv1.ExecuteResponse {
	return &adapterv1.ExecuteResponse{Outcome: &adapterv1.ExecuteResponse_Accepted{Accepted: &adapterv1.Accepted{ExternalReference: "ext-1"}}}
}

// completeByToken completes an attempt as the gateway's CompleteExecution
// does, from the callback token the adapter received.
func completeByToken(st *pgstore.Store, tok string, out execution.Outcome) (pgstore.CompleteResult, error) {
	signer, _ := token.NewSigner(testSecret)
	c, err := signer.Verify(tok, token.KindCallback, time.Now())
	if err != nil {
		return pgstore.CompleteResult{}, err
	}
	e, err := st.ExecutionGet(context.Background(), c.ApplicationID, c.ExecutionID)
	if err != nil {
		return pgstore.CompleteResult{}, err
	}
	return st.CompleteInteraction(context.Background(), pgstore.CompleteParams{
		Open: &pgstore.AwaitOpen{ExecutionID: e.ID, ApplicationID: e.ApplicationID, Attempt: c.Attempt, Step: pgstore.StepAdapter,
			Capability: e.Capability, Transport: pgstore.TransportInteractionAPI, Timeout: time.Hour, Request: e.Input},
		Fence: &pgstore.Fence{Attempt: c.Attempt, LeaseToken: c.Subject}, ApplicationID: c.ApplicationID,
		Outcome: out, Policy: execution.DefaultPolicy()})
}

func TestPipelineAcceptedThenCompleted(t *testing.T) {
	t.Parallel()
	tokens := make(chan string, 10)
	p := startPipeline(t, func(req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
		tokens <- req.GetCallbackToken()
		return accepted(), nil
	}, withCallbacks)
	ids := p.invoke(t, 1)
	tok := <-tokens
	require.NotEmpty(t, tok, "the adapter receives a callback token")
	require.Eventually(t, func() bool {
		e, err := p.store.ExecutionGet(context.Background(), uuid.Nil, ids[0])
		require.NoError(t, err)
		return e.Status == execution.StatusWaitingExternal
	}, 10*time.Second, 10*time.Millisecond, "the execution parks on its await unit")
	res, err := completeByToken(p.store, tok, execution.Outcome{Succeeded: true, Output: []byte(`{"late":1}`)})
	require.NoError(t, err)
	require.Equal(t, execution.StatusSucceeded, res.Execution.Status)
	settled := p.waitSettled(t, ids)
	require.Equal(t, `{"late":1}`, string(settled[ids[0]].Output))
	require.Equal(t, 1, p.count(t, `SELECT count(*) FROM completion_events`))
	require.Equal(t, 1, p.count(t, `SELECT count(*) FROM interactions WHERE external_reference = 'ext-1' AND status = 'COMPLETED'`))
}

// TestPipelineCompletionBeforePark: the adapter completes through its
// callback before its Execute answer ("accepted") reaches the consumer.
func TestPipelineCompletionBeforePark(t *testing.T) {
	t.Parallel()
	var st atomic.Pointer[pgstore.Store]
	p := startPipeline(t, func(req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
		res, err := completeByToken(st.Load(), req.GetCallbackToken(), execution.Outcome{Succeeded: true, Output: []byte(`{"early":1}`)})
		if err != nil || !res.Held {
			return nil, fmt.Errorf("completion before park: held=%v err=%v", res.Held, err)
		}
		return accepted(), nil
	}, withCallbacks)
	st.Store(p.store)
	ids := p.invoke(t, 5)
	for _, id := range ids {
		e := p.waitSettled(t, []uuid.UUID{id})[id]
		require.Equal(t, execution.StatusSucceeded, e.Status)
		require.Equal(t, `{"early":1}`, string(e.Output))
		require.Equal(t, 1, e.Attempt, "released once, no retry")
	}
	require.Equal(t, 5, p.count(t, `SELECT count(*) FROM completion_events`))
	require.Equal(t, 5, p.count(t, `SELECT count(*) FROM interactions`))
}

// TestPipelineCallbackLeaseExpires: an adapter that accepted and never
// renews loses the attempt to the reaper; the next attempt runs, the old
// unit is cancelled and the old token's completion is refused.
func TestPipelineCallbackLeaseExpires(t *testing.T) {
	t.Parallel()
	tokens := make(chan string, 10)
	p := startPipeline(t, func(req *adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
		if req.GetAttempt() == 1 {
			tokens <- req.GetCallbackToken()
			return accepted(), nil
		}
		return ok(req)
	}, withCallbacks, func(c *config.Config) { c.Capabilities[0].LeaseDuration = 300 * time.Millisecond })
	ids := p.invoke(t, 1)
	oldTok := <-tokens
	settled := p.waitSettled(t, ids)
	require.Equal(t, execution.StatusSucceeded, settled[ids[0]].Status)
	require.Equal(t, 2, settled[ids[0]].Attempt)
	require.Equal(t, 1, p.count(t, `SELECT count(*) FROM attempts WHERE outcome = 'LEASE_EXPIRED'`))
	require.Equal(t, 1, p.count(t, `SELECT count(*) FROM await_units WHERE status = 'CANCELLED'`))
	_, err := completeByToken(p.store, oldTok, execution.Outcome{Succeeded: true, Output: []byte(`{}`)})
	require.Error(t, err, "the superseded attempt's completion is refused")
	require.Equal(t, 1, p.count(t, `SELECT count(*) FROM completion_events`))
}

// failCommitsFile, when present in the object store's directory at the
// pipeline's start, holds N: the first N commits of write sessions fail
// with an I/O error (a storage outage at the worst moment).
const failCommitsFile = "FAIL_COMMITS"

// failingCommits is an object store whose first commits fail; the failed
// session is aborted, as a real provider's failed finalize leaves nothing.
type failingCommits struct {
	objectstore.Store
	left int64
}

func (f *failingCommits) Create(ctx context.Context, key string) (objectstore.Writer, error) {
	w, err := f.Store.Create(ctx, key)
	if err != nil {
		return nil, err
	}
	return &failingWriter{Writer: w, f: f}, nil
}

type failingWriter struct {
	objectstore.Writer
	f *failingCommits
}

func (w *failingWriter) Commit(ctx context.Context) error {
	if atomic.AddInt64(&w.f.left, -1) >= 0 {
		_ = w.Writer.Abort(ctx)
		return fmt.Errorf("commit: %w", syscall.EIO)
	}
	return w.Writer.Commit(ctx)
}
