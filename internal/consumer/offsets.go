package consumer

import (
	"sort"
	"sync"

	"github.com/twmb/franz-go/pkg/kgo"
)

// offsetTracker computes, per partition, the offset up to which every
// record's outcome is durable, so that committed offsets never pass a
// record still in flight (records finish out of order because many
// attempts run at once).
type offsetTracker struct {
	mu    sync.Mutex
	parts map[topicPartition]*partitionState
}

type topicPartition struct {
	topic     string
	partition int32
}

type partitionState struct {
	inFlight map[int64]struct{}
	next     int64 // one past the highest offset seen
}

func newOffsetTracker() *offsetTracker {
	return &offsetTracker{parts: map[topicPartition]*partitionState{}}
}

// start records that r is in flight.
func (t *offsetTracker) start(r *kgo.Record) {
	t.mu.Lock()
	defer t.mu.Unlock()
	tp := topicPartition{r.Topic, r.Partition}
	ps := t.parts[tp]
	if ps == nil {
		ps = &partitionState{inFlight: map[int64]struct{}{}}
		t.parts[tp] = ps
	}
	ps.inFlight[r.Offset] = struct{}{}
	if r.Offset+1 > ps.next {
		ps.next = r.Offset + 1
	}
}

// done records that r's outcome is durable and returns the partition's
// committable offset: the lowest offset still in flight, or one past the
// highest seen when none is.
func (t *offsetTracker) done(r *kgo.Record) int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps := t.parts[topicPartition{r.Topic, r.Partition}]
	if ps == nil {
		return -1
	}
	delete(ps.inFlight, r.Offset)
	if len(ps.inFlight) == 0 {
		return ps.next
	}
	offs := make([]int64, 0, len(ps.inFlight))
	for o := range ps.inFlight {
		offs = append(offs, o)
	}
	sort.Slice(offs, func(i, j int) bool { return offs[i] < offs[j] })
	return offs[0]
}

// forget drops the state of revoked partitions.
func (t *offsetTracker) forget(revoked map[string][]int32) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for topic, parts := range revoked {
		for _, p := range parts {
			delete(t.parts, topicPartition{topic, p})
		}
	}
}

// markDone records that r's outcome is durable and marks its partition's
// committable offset on client (the autocommitter commits it).
func (t *offsetTracker) markDone(client *kgo.Client, r *kgo.Record) {
	off := t.done(r)
	client.MarkCommitOffsets(map[string]map[int32]kgo.EpochOffset{r.Topic: {r.Partition: {Epoch: -1, Offset: off}}})
}
