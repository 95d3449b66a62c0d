package kafkatest_test

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/goleak"

	"github.com/capstan-dev/capstan/internal/kafkatest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// testLogger sends logs to the test log until the test's cleanups have
// run; kfake goroutines may still log while shutting down.
func testLogger(t testing.TB, level slog.Level) *slog.Logger {
	w := &tWriter{t: t}
	t.Cleanup(func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		w.done = true
	})
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: level}))
}

type tWriter struct {
	t    testing.TB
	mu   sync.Mutex
	done bool
}

func (w *tWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done {
		w.t.Log(strings.TrimRight(string(p), "\n"))
	}
	return len(p), nil
}

func start(t *testing.T, opts kafkatest.Options) *kafkatest.Cluster {
	t.Helper()
	if opts.Logger == nil {
		opts.Logger = testLogger(t, slog.LevelInfo)
	}
	c, err := kafkatest.Start(t.Context(), opts)
	require.NoError(t, err)
	t.Cleanup(c.Close)
	return c
}

func newClient(t *testing.T, brokers []string, opts ...kgo.Opt) *kgo.Client {
	t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(brokers...)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(cl.Close)
	return cl
}

// pollOne polls cl until it returns at least one record or ctx ends.
func pollOne(ctx context.Context, t *testing.T, cl *kgo.Client) []*kgo.Record {
	t.Helper()
	for {
		fetches := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			t.Fatalf("no record before timeout: %v", err)
		}
		for _, fe := range fetches.Errors() {
			t.Fatalf("fetch %s[%d]: %v", fe.Topic, fe.Partition, fe.Err)
		}
		if recs := fetches.Records(); len(recs) > 0 {
			return recs
		}
	}
}

// TestProduceConsumeWithGroup produces through a real kgo client and
// consumes with a consumer group, checking that the group's commit is
// honoured by the next member.
func TestProduceConsumeWithGroup(t *testing.T) {
	t.Parallel()
	const topic, group = "payments", "capstan-consumer"
	c := start(t, kafkatest.Options{Topics: map[string]int32{topic: 3}})
	require.Len(t, c.Fake().PartitionInfos(topic), 3, "topic seeded with 3 partitions")

	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()

	// Manual partitioning keeps both records on one partition, so the second
	// consumer must start from the committed offset to skip the first.
	producer := newClient(t, c.Brokers(), kgo.DefaultProduceTopic(topic), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	require.NoError(t, producer.ProduceSync(ctx, &kgo.Record{Value: []byte("first"), Partition: 1}).FirstErr())

	consume := func() *kgo.Record {
		consumer := newClient(t, c.Brokers(),
			kgo.ConsumerGroup(group),
			kgo.ConsumeTopics(topic),
			kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
			kgo.DisableAutoCommit(),
			// With one broker, kgo has one fetch in flight; a long poll on
			// an empty partition (default 5 s) delays the others.
			kgo.FetchMaxWait(100*time.Millisecond),
		)
		defer consumer.Close()
		recs := pollOne(ctx, t, consumer)
		require.Len(t, recs, 1)
		require.NoError(t, consumer.CommitRecords(ctx, recs...))
		return recs[0]
	}

	got := consume()
	assert.Equal(t, "first", string(got.Value))
	assert.Equal(t, topic, got.Topic)
	assert.Equal(t, int32(1), got.Partition)

	info := c.Fake().GroupInfo(group)
	require.NotNil(t, info)
	assert.Equal(t, got.Offset+1, info.Commits[topic][got.Partition].Offset)

	// The group resumes after its commit: a new member sees only new records.
	require.NoError(t, producer.ProduceSync(ctx, &kgo.Record{Value: []byte("second"), Partition: 1}).FirstErr())
	second := consume()
	assert.Equal(t, "second", string(second.Value))
	assert.Equal(t, int64(1), second.Offset)
}

// TestFaultInjection drops the connection of the first produce request
// through Fake().ControlKey; kgo retries and the record still arrives.
func TestFaultInjection(t *testing.T) {
	t.Parallel()
	const topic = "events"
	c := start(t, kafkatest.Options{Topics: map[string]int32{topic: 1}})
	fake := c.Fake()

	var produces atomic.Int32
	fake.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		if produces.Add(1) == 1 {
			fake.KeepControl() // keep counting after handling this one
			return nil, errors.New("injected failure"), true
		}
		return nil, nil, false
	})

	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	// A failed request makes kgo refresh metadata, which it rate-limits to
	// MetadataMinAge (default 5 s).
	cl := newClient(t, c.Brokers(), kgo.DefaultProduceTopic(topic), kgo.MetadataMinAge(50*time.Millisecond))
	require.NoError(t, cl.ProduceSync(ctx, kgo.StringRecord("v")).FirstErr())
	assert.GreaterOrEqual(t, produces.Load(), int32(2), "first produce failed and was retried")
	assert.Equal(t, int64(1), fake.PartitionInfo(topic, 0).HighWatermark)
}

func TestStartOptions(t *testing.T) {
	t.Parallel()
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { busy.Close() })

	tests := []struct {
		name    string
		addr    func(t *testing.T) string
		wantErr string
	}{
		{name: "default", addr: func(*testing.T) string { return "" }},
		{name: "explicit free port", addr: func(t *testing.T) string { return freeAddr(t) }},
		{name: "loopback any port", addr: func(*testing.T) string { return "127.0.0.1:0" }},
		{name: "port in use", addr: func(*testing.T) string { return busy.Addr().String() }, wantErr: "address already in use"},
		{name: "unspecified host", addr: func(*testing.T) string { return "0.0.0.0:0" }, wantErr: "must be dialable"},
		{name: "empty host", addr: func(*testing.T) string { return ":0" }, wantErr: "must be dialable"},
		{name: "no port", addr: func(*testing.T) string { return "127.0.0.1" }, wantErr: "invalid address"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			addr := tt.addr(t)
			c, err := kafkatest.Start(t.Context(), kafkatest.Options{Addr: addr, Logger: testLogger(t, slog.LevelInfo)})
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				assert.Nil(t, c)
				return
			}
			require.NoError(t, err)
			defer c.Close()
			brokers := c.Brokers()
			require.Len(t, brokers, 1)
			host, port, err := net.SplitHostPort(brokers[0])
			require.NoError(t, err)
			assert.Equal(t, "127.0.0.1", host)
			assert.NotEqual(t, "0", port)
			if !strings.HasSuffix(addr, ":0") && addr != "" {
				assert.Equal(t, addr, brokers[0])
			}

			// The advertised address works for a real client.
			cl := newClient(t, brokers)
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			require.NoError(t, cl.Ping(ctx))
			cl.Close()

			c.Close()
			c.Close() // idempotent
		})
	}
}

func TestStartCancelledContext(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, err := kafkatest.Start(ctx, kafkatest.Options{})
	require.ErrorIs(t, err, context.Canceled)
}

// TestRun hosts a broker with Run, uses it, and stops it by cancelling ctx.
func TestRun(t *testing.T) {
	t.Parallel()
	const topic = "dev"
	addr := freeAddr(t)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- kafkatest.Run(ctx, addr, map[string]int32{topic: 2}, testLogger(t, slog.LevelInfo)) }()

	// Wait for the listener, as a process depending on the dev broker
	// would; kgo would also retry, but only after MetadataMinAge (5 s).
	require.Eventually(t, func() bool {
		conn, err := net.DialTimeout("tcp", addr, 100*time.Millisecond)
		if err == nil {
			conn.Close()
		}
		return err == nil
	}, 10*time.Second, 10*time.Millisecond, "Run did not start listening on %s", addr)

	pctx, pcancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer pcancel()
	cl := newClient(t, []string{addr}, kgo.DefaultProduceTopic(topic))
	require.NoError(t, cl.ProduceSync(pctx, kgo.StringRecord("hello")).FirstErr())
	cl.Close()

	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after ctx was cancelled")
	}
	_, err := net.DialTimeout("tcp", addr, time.Second)
	assert.Error(t, err, "nothing listens after Run returns")
}

func TestRunBadAddr(t *testing.T) {
	t.Parallel()
	err := kafkatest.Run(t.Context(), "not an address", nil, nil)
	require.ErrorContains(t, err, "invalid address")
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().String()
}
