package main

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/capstan-dev/capstan/internal/kafkatest"
	"github.com/capstan-dev/capstan/pkg/adapter"
)

const (
	testRequestTopic  = "payments.requests"
	testResponseTopic = "payments.responses"
	testGroup         = "provider-test"
)

// startKafka starts an embedded broker with the request and response
// topics and returns its brokers and a client for producing requests and
// reading completions.
func startKafka(t *testing.T) (string, *kgo.Client) {
	t.Helper()
	kc, err := kafkatest.Start(t.Context(), kafkatest.Options{Topics: map[string]int32{testRequestTopic: 3, testResponseTopic: 3}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close)
	cl, err := kgo.NewClient(kgo.SeedBrokers(kc.Brokers()...), kgo.ConsumeTopics(testResponseTopic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close) // before kc.Close (cleanups run last first)
	return kc.Brokers()[0], cl
}

// produceRequests produces each value keyed by its correlation id.
func produceRequests(t *testing.T, cl *kgo.Client, reqs []adapter.InteractionRequest, extra ...[]byte) {
	t.Helper()
	var recs []*kgo.Record
	for _, req := range reqs {
		b, err := json.Marshal(req)
		if err != nil {
			t.Fatal(err)
		}
		recs = append(recs, &kgo.Record{Topic: testRequestTopic, Key: []byte(req.CorrelationID), Value: b})
	}
	for _, b := range extra {
		recs = append(recs, &kgo.Record{Topic: testRequestTopic, Key: []byte("junk"), Value: b})
	}
	if err := cl.ProduceSync(t.Context(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

// readCompletions reads n records from the response topic, or fails after
// a minute.
func readCompletions(t *testing.T, cl *kgo.Client, n int) []*kgo.Record {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	var out []*kgo.Record
	for len(out) < n {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("%d of %d completions after a minute", len(out), n)
		}
		fs.EachError(func(topic string, p int32, err error) { t.Logf("fetch %s/%d: %v", topic, p, err) })
		out = append(out, fs.Records()...)
	}
	return out
}

func TestKafkaMode(t *testing.T) {
	t.Parallel()
	rows := readPayments(t)
	tests := []struct {
		name       string
		fraction   float64
		duplicates bool
	}{
		{name: "decides per payment.Decide"},
		{name: "retryable fraction 1 fails every interaction retryably", fraction: 1},
		{name: "duplicate completions are produced twice", duplicates: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			brokers, cl := startKafka(t)
			reqs := interactionRequests(rows, "")
			// A resent request and a malformed record are answered not
			// at all.
			produceRequests(t, cl, append(reqs, reqs[3]), []byte("{not json"), []byte(`{"interaction_id":"x"}`))
			sp := runProvider(t, config{Mode: modeKafka, KafkaBrokers: brokers, RequestTopic: testRequestTopic,
				ResponseTopic: testResponseTopic, KafkaGroup: testGroup, LatencyMin: time.Millisecond, LatencyMax: 3 * time.Millisecond,
				RetryableFraction: tt.fraction, Seed: 1, DuplicateCompletions: tt.duplicates}, nil)
			copies := 1
			if tt.duplicates {
				copies = 2
			}
			recs := readCompletions(t, cl, copies*len(reqs))
			if err := sp.stop(); err != nil {
				t.Fatal(err)
			}

			byKey := map[string][]adapter.InteractionCompletion{}
			for _, r := range recs {
				c, err := adapter.DecodeCompletion(r.Value)
				if err != nil {
					t.Fatalf("completion %s: %v", r.Value, err)
				}
				byKey[string(r.Key)] = append(byKey[string(r.Key)], c)
			}
			for _, req := range reqs {
				cs := byKey[req.CorrelationID]
				if len(cs) != copies {
					t.Errorf("%s: %d completions keyed by its correlation id, want %d", req.InteractionID, len(cs), copies)
					continue
				}
				for _, c := range cs {
					checkCompletion(t, req, c, tt.fraction == 1)
				}
			}
			// Nothing more was produced: the resend is not answered.
			adm := kadm.NewClient(cl)
			if n := topicRecords(t, adm, testResponseTopic); n != int64(copies*len(reqs)) {
				t.Errorf("%d completions produced, want %d", n, copies*len(reqs))
			}
			want := stats{Calls: int64(len(reqs) + 1), Executions: len(reqs), Interactions: len(reqs), Resent: 1,
				Completions: int64(copies * len(reqs))}
			if s := sp.final(t); s != want {
				t.Errorf("stats = %+v, want %+v", s, want)
			}

			// Every request record, the skipped ones included, is committed.
			ends, err := adm.ListEndOffsets(t.Context(), testRequestTopic)
			if err != nil {
				t.Fatal(err)
			}
			committed, err := adm.FetchOffsets(t.Context(), testGroup)
			if err != nil {
				t.Fatal(err)
			}
			ends.Each(func(o kadm.ListedOffset) {
				c, _ := committed.Lookup(o.Topic, o.Partition)
				if c.At != o.Offset {
					t.Errorf("partition %d: committed %d, end %d", o.Partition, c.At, o.Offset)
				}
			})
		})
	}
}

// topicRecords returns the number of records of topic (all start at 0).
func topicRecords(t *testing.T, adm *kadm.Client, topic string) int64 {
	t.Helper()
	ends, err := adm.ListEndOffsets(t.Context(), topic)
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	ends.Each(func(o kadm.ListedOffset) { n += o.Offset })
	return n
}

// TestKafkaModeShutdownRedelivers stops a provider while its answers wait
// out a long latency past the grace period: nothing is committed, and the
// next provider of the group answers every request.
func TestKafkaModeShutdownRedelivers(t *testing.T) {
	t.Parallel()
	brokers, cl := startKafka(t)
	reqs := interactionRequests(readPayments(t), "")
	produceRequests(t, cl, reqs)
	cfg := config{Mode: modeKafka, KafkaBrokers: brokers, RequestTopic: testRequestTopic, ResponseTopic: testResponseTopic,
		KafkaGroup: testGroup, LatencyMin: time.Hour, LatencyMax: time.Hour, Seed: 1, drainGrace: 50 * time.Millisecond}

	first := runProvider(t, cfg, nil)
	// Wait until the first provider holds the requests.
	deadline := time.Now().Add(time.Minute)
	for readStats(t, first.admin).Calls < int64(len(reqs)) {
		if time.Now().After(deadline) {
			t.Fatal("the first provider received no requests")
		}
		time.Sleep(10 * time.Millisecond) // polling an HTTP counter; no signal to wait on
	}
	if err := first.stop(); err != nil { // waits drainGrace, then gives up
		t.Fatal(err)
	}
	if s := first.final(t); s.Dropped != int64(len(reqs)) || s.Completions != 0 {
		t.Fatalf("first provider: %+v", s)
	}

	cfg.LatencyMin, cfg.LatencyMax = 0, time.Millisecond
	second := runProvider(t, cfg, nil)
	recs := readCompletions(t, cl, len(reqs))
	if err := second.stop(); err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, r := range recs {
		seen[string(r.Key)] = true
	}
	if len(seen) != len(reqs) {
		t.Errorf("%d distinct completions, want %d", len(seen), len(reqs))
	}
}
