package dispatcher_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/dispatcher"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/kafka"
	"github.com/capstan-dev/capstan/internal/kafkatest"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/testutil/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.RunMain(m)) }

// TestPartialPublishDeletesOnlyWhatWasPublished: the broker refuses the
// records of one partition; exactly the published records are deleted, the
// refused ones stay for the next pass, and nothing is lost.
func TestPartialPublishDeletesOnlyWhatWasPublished(t *testing.T) {
	ctx := context.Background()
	url := pgtest.NewDatabase(t, func(ctx context.Context, url string) error { _, err := pgstore.Migrate(ctx, url, nil); return err })
	st, err := pgstore.Open(ctx, url, nil)
	require.NoError(t, err)
	defer st.Close()
	app, err := st.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: "a", APIKey: "k"})
	require.NoError(t, err)
	for i := range 40 {
		_, _, err := st.ExecutionInsert(ctx, pgstore.ExecutionInsertParams{ApplicationID: app.ID, Capability: "c", Release: "v1",
			Mode: execution.ModeAsync, MaxAttempts: 3, Input: []byte(fmt.Sprint(i)), ContentType: "x", RequestHash: []byte{byte(i)},
			AsyncBudget: time.Hour, Status: execution.StatusQueued})
		require.NoError(t, err)
	}
	const topic = "capstan.executions"
	kc, err := kafkatest.Start(ctx, kafkatest.Options{Topics: map[string]int32{topic: 4}})
	require.NoError(t, err)
	defer kc.Close()
	accepted := &keySet{m: map[string]bool{}}
	var refusing atomic.Bool
	refusing.Store(true)
	var refused atomic.Int64
	var calls atomic.Int64
	kc.Fake().ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		calls.Add(1)
		kc.Fake().KeepControl()
		if !refusing.Load() {
			return nil, nil, false
		}
		pr := req.(*kmsg.ProduceRequest)
		for _, tp := range pr.Topics {
			for _, p := range tp.Partitions {
				if p.Partition == 0 {
					refused.Add(1)
					resp := pr.ResponseKind().(*kmsg.ProduceResponse)
					for _, t2 := range pr.Topics {
						rt := kmsg.NewProduceResponseTopic()
						rt.Topic, rt.TopicID = t2.Topic, t2.TopicID
						for _, p2 := range t2.Partitions {
							rp := kmsg.NewProduceResponseTopicPartition()
							rp.Partition = p2.Partition
							if p2.Partition == 0 {
								rp.ErrorCode = kerr.InvalidRecord.Code // not retriable
							} else {
								rp.BaseOffset = 0 // accepted, without storing: enough for the producer
								acceptedKeys(p2.Records, accepted)
							}
							rt.Partitions = append(rt.Partitions, rp)
						}
						resp.Topics = append(resp.Topics, rt)
					}
					return resp, nil, true
				}
			}
		}
		return nil, nil, false
	})
	logger := slog.New(slog.DiscardHandler)
	if os.Getenv("DISPATCH_LOG") != "" {
		logger = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	prod, err := kafka.NewClient(kc.Brokers(), logger, kgo.DefaultProduceTopic(topic), kgo.RecordPartitioner(kgo.StickyKeyPartitioner(nil)),
		kgo.ProducerBatchCompression(kgo.NoCompression()))
	require.NoError(t, err)
	defer prod.Close()
	d := dispatcher.New(st, prod, config.Dispatcher{PassInterval: 50 * time.Millisecond, BatchSize: 100, ClaimTTL: 200 * time.Millisecond}, topic, "d", logger)

	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { _ = d.Run(runCtx); close(done) }()
	count := func() int {
		conn, err := pgx.Connect(ctx, url)
		require.NoError(t, err)
		defer conn.Close(ctx)
		var n int
		require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM dispatch_records`).Scan(&n))
		return n
	}
	require.Eventually(t, func() bool { return refused.Load() > 0 && count() < 40 }, 10*time.Second, 20*time.Millisecond, "calls=%d refused=%d count=%d published=%d", calls.Load(), refused.Load(), count(), d.Stats().Published)
	left := count()
	require.Positive(t, left, "the refused partition's records are kept")
	require.Less(t, left, 40, "the published ones are deleted")
	refusing.Store(false)
	require.Eventually(t, func() bool { return count() == 0 }, 20*time.Second, 20*time.Millisecond,
		"once the broker accepts them, the kept records are published and deleted")
	cancel()
	<-done
	require.GreaterOrEqual(t, d.Stats().Published, int64(40))

	// Every execution was published at least once: acknowledged during the
	// refusals, or stored on the topic afterwards.
	cons, err := kafka.NewClient(kc.Brokers(), logger, kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.FetchMaxWait(100*time.Millisecond))
	require.NoError(t, err)
	defer cons.Close()
	pctx, pcancel := context.WithTimeout(ctx, 5*time.Second)
	defer pcancel()
	for pctx.Err() == nil {
		cons.PollFetches(pctx).EachRecord(func(r *kgo.Record) { accepted.add(string(r.Key)) })
	}
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT id::text FROM executions`)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	for _, id := range ids {
		require.True(t, accepted.has(id), "execution %s was never published: its record was deleted unpublished", id)
	}
}

type keySet struct {
	mu sync.Mutex
	m  map[string]bool
}

func (k *keySet) add(s string) { k.mu.Lock(); k.m[s] = true; k.mu.Unlock() }
func (k *keySet) has(s string) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.m[s]
}

// acceptedKeys adds the keys of an uncompressed record batch to set.
func acceptedKeys(batch []byte, set *keySet) {
	var b kmsg.RecordBatch
	if err := b.ReadFrom(batch); err != nil {
		return
	}
	raw := b.Records
	for range b.NumRecords {
		length, n := binary.Varint(raw)
		if n <= 0 || int(length)+n > len(raw) {
			return
		}
		var r kmsg.Record
		if err := r.ReadFrom(raw[:n+int(length)]); err != nil {
			return
		}
		set.add(string(r.Key))
		raw = raw[n+int(length):]
	}
}
