package consumer

import (
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"
)

func TestOffsetTrackerNeverPassesInFlight(t *testing.T) {
	t.Parallel()
	tr := newOffsetTracker()
	rec := func(o int64) *kgo.Record { return &kgo.Record{Topic: "t", Partition: 0, Offset: o} }
	for o := int64(10); o < 15; o++ {
		tr.start(rec(o))
	}
	require.Equal(t, int64(10), tr.done(rec(12)), "10 is still in flight")
	require.Equal(t, int64(10), tr.done(rec(14)))
	require.Equal(t, int64(11), tr.done(rec(10)))
	require.Equal(t, int64(13), tr.done(rec(11)))
	require.Equal(t, int64(15), tr.done(rec(13)), "all done: one past the highest")
	tr.forget(map[string][]int32{"t": {0}})
	require.Equal(t, int64(-1), tr.done(rec(20)), "revoked partitions are forgotten")
}
