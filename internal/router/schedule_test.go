package router

import (
	"encoding/binary"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

var defaultDelays = []time.Duration{time.Minute, 5 * time.Minute, 30 * time.Minute, 2 * time.Hour, 6 * time.Hour}

func TestRetryAfter(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		failures  int
		delays    []time.Duration
		jitter, u float64
		want      time.Duration
		wantDead  bool
	}{
		{"first failure", 1, defaultDelays, 0, 0.5, time.Minute, false},
		{"fifth failure", 5, defaultDelays, 0, 0.5, 6 * time.Hour, false},
		{"sixth failure is dead", 6, defaultDelays, 0, 0.5, 0, true},
		{"far past the schedule is dead", math.MaxInt, defaultDelays, 0.1, 0.5, 0, true},
		{"zero failures count as one", 0, defaultDelays, 0, 0.5, time.Minute, false},
		{"negative failures count as one", math.MinInt, defaultDelays, 0, 0.5, time.Minute, false},
		{"empty schedule: first failure is dead", 1, nil, 0.1, 0.5, 0, true},
		{"jitter low end", 2, defaultDelays, 0.1, 0, 4*time.Minute + 30*time.Second, false},
		{"jitter high end", 2, defaultDelays, 0.1, 1, 5*time.Minute + 30*time.Second, false},
		{"jitter midpoint", 2, defaultDelays, 0.1, 0.5, 5 * time.Minute, false},
		{"u below range is clamped", 2, defaultDelays, 0.1, -3, 4*time.Minute + 30*time.Second, false},
		{"u NaN is the midpoint", 2, defaultDelays, 0.1, math.NaN(), 5 * time.Minute, false},
		{"jitter NaN is none", 2, defaultDelays, math.NaN(), 1, 5 * time.Minute, false},
		{"negative jitter is none", 2, defaultDelays, -1, 1, 5 * time.Minute, false},
		{"jitter above one is clamped", 1, defaultDelays, 7, 0, 0, false},
		{"negative delay is zero", 1, []time.Duration{-time.Hour}, 0.5, 1, 0, false},
		{"huge delay is capped", 1, []time.Duration{math.MaxInt64}, 1, 1, 2 * MaxRetryDelay, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, dead := RetryAfter(tt.failures, tt.delays, tt.jitter, tt.u)
			require.Equal(t, tt.wantDead, dead)
			require.Equal(t, tt.want, got)
		})
	}
}

// FuzzRetryAfter checks RetryAfter's invariants for any input: the delay is
// never negative and never above 2*MaxRetryDelay (no overflow); the event is
// dead exactly when failures (at least 1) exceed the schedule; a live
// delay lies within ±jitter of its clamped schedule entry.
func FuzzRetryAfter(f *testing.F) {
	f.Add(1, int64(time.Minute), int64(time.Hour), 0.1, 0.5)
	f.Add(6, int64(time.Minute), int64(time.Hour), 0.1, 0.5)
	f.Add(0, int64(-1), int64(math.MaxInt64), 1.0, 1.0)
	f.Add(2, int64(math.MinInt64), int64(math.MaxInt64), math.Inf(1), math.Inf(-1))
	f.Add(math.MaxInt, int64(0), int64(0), math.NaN(), math.NaN())
	f.Fuzz(func(t *testing.T, failures int, d1, d2 int64, jitter, u float64) {
		delays := []time.Duration{time.Duration(d1), time.Duration(d2)}
		// Vary the schedule's length with the input too.
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], uint64(d1))
		delays = delays[:int(b[0])%3]

		got, dead := RetryAfter(failures, delays, jitter, u)
		if got < 0 || got > 2*MaxRetryDelay {
			t.Fatalf("RetryAfter(%d, %v, %v, %v) = %v: out of [0, 2*MaxRetryDelay]", failures, delays, jitter, u, got)
		}
		k := max(failures, 1)
		if dead != (k > len(delays)) {
			t.Fatalf("RetryAfter(%d, %v, …) dead = %v, want %v", failures, delays, dead, k > len(delays))
		}
		if dead {
			if got != 0 {
				t.Fatalf("dead with delay %v, want 0", got)
			}
			return
		}
		base := float64(min(max(delays[k-1], 0), MaxRetryDelay))
		j := jitter
		if math.IsNaN(j) || j < 0 {
			j = 0
		}
		j = min(j, 1)
		lo, hi := base*(1-j)-1, base*(1+j)+1
		if float64(got) < lo || float64(got) > hi {
			t.Fatalf("RetryAfter(%d, %v, %v, %v) = %v, want within [%v, %v]", failures, delays, jitter, u, got,
				time.Duration(lo), time.Duration(hi))
		}
	})
}
