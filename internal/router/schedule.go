package router

import (
	"math"
	"time"

	"github.com/capstan-dev/capstan/internal/execution"
)

// MaxRetryDelay caps every entry of the retry schedule before jitter is
// applied (30 days), so the arithmetic can never overflow a time.Duration.
const MaxRetryDelay = execution.MaxDelay

// RetryAfter is the delivery schedule (SYSTEM §4 hop 6): what follows the
// failures-th failed delivery attempt of an event.
//
// For 1 ≤ failures ≤ len(delays) it returns delays[failures-1] spread by
// ±jitter (a fraction: 0.1 means ±10 %) and dead=false; for failures >
// len(delays) it returns 0 and dead=true. u in [0, 1] picks the point in
// the spread (0 → -jitter, 0.5 → none, 1 → +jitter); callers pass a uniform
// random number.
//
// The function is pure and total: failures < 1 counts as 1, each delay is
// clamped to [0, MaxRetryDelay], jitter to [0, 1] (NaN → 0) and u to [0, 1]
// (NaN → 0.5). The result is therefore never negative and never above
// 2*MaxRetryDelay.
func RetryAfter(failures int, delays []time.Duration, jitter, u float64) (delay time.Duration, dead bool) {
	if failures < 1 {
		failures = 1
	}
	if failures > len(delays) {
		return 0, true
	}
	d := min(max(delays[failures-1], 0), MaxRetryDelay)
	if math.IsNaN(jitter) || jitter <= 0 {
		return d, false
	}
	jitter = min(jitter, 1)
	if math.IsNaN(u) {
		u = 0.5
	}
	u = min(max(u, 0), 1)
	out := float64(d) * (1 + jitter*(2*u-1))
	// out lies in [0, 2*MaxRetryDelay], far inside int64; the clamps only
	// guard against rounding.
	return min(max(time.Duration(out), 0), 2*MaxRetryDelay), false
}

// nextDelay is the delay after the failures-th failed attempt of the
// current delivery round: RetryAfter's schedule, then, when the receiver
// asked for hint (Retry-After on 429 or 503; 0 for none), the hint clamped
// to [scheduled delay, 2 × scheduled delay], so a receiver can slow the
// schedule down but neither speed it up nor stall it. dead is RetryAfter's.
func nextDelay(failures int, delays []time.Duration, jitter, u float64, hint time.Duration) (delay time.Duration, dead bool) {
	delay, dead = RetryAfter(failures, delays, jitter, u)
	if dead || hint <= 0 {
		return delay, dead
	}
	return min(max(hint, delay), 2*delay), false
}
