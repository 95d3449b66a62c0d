package execution

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"time"
)

// Mode says who runs a release: the consumer (ASYNC) or the gateway inside
// the call (SYNC, SYSTEM §7).
type Mode string

const (
	ModeAsync Mode = "ASYNC"
	ModeSync  Mode = "SYNC"
)

// Policy defaults (SYSTEM §4).
const (
	DefaultMaxAttempts    = 10
	DefaultJitter         = 0.10
	DefaultAttemptTimeout = 30 * time.Second
	DefaultLeaseDuration  = 60 * time.Second
	DefaultAsyncBudget    = 24 * time.Hour
	// MaxDelay caps any single retry delay so the arithmetic can never
	// overflow a time.Duration.
	MaxDelay = 30 * 24 * time.Hour
)

// DefaultRetryDelays is the execution retry schedule: 1 min, 5 min, 30 min,
// 2 h, 6 h, then 6 h for every later attempt.
var DefaultRetryDelays = []time.Duration{
	time.Minute, 5 * time.Minute, 30 * time.Minute, 2 * time.Hour, 6 * time.Hour,
}

// Policy is the retry and timeout policy of one capability release.
type Policy struct {
	Mode Mode
	// MaxAttempts is the attempt ceiling: the MaxAttempts-th retryable
	// failure settles FAILED / retry_exhausted.attempt_limit. 1..1000.
	MaxAttempts int
	// RetryDelays[i] is the delay after the (i+1)-th failed attempt; the last
	// entry repeats. At least one entry, each in (0, MaxDelay].
	RetryDelays []time.Duration
	// Jitter is the relative spread applied to each delay, in [0, 0.5];
	// 0.1 means ±10 %.
	Jitter float64
	// AttemptTimeout bounds one adapter call.
	AttemptTimeout time.Duration
	// LeaseDuration is how long a lease lasts without a heartbeat.
	LeaseDuration time.Duration
	// AsyncBudget is the time from acceptance after which the execution
	// settles TIMED_OUT.
	AsyncBudget time.Duration
}

// DefaultPolicy returns the SYSTEM §4 defaults for an ASYNC release.
func DefaultPolicy() Policy {
	return Policy{
		Mode:           ModeAsync,
		MaxAttempts:    DefaultMaxAttempts,
		RetryDelays:    append([]time.Duration(nil), DefaultRetryDelays...),
		Jitter:         DefaultJitter,
		AttemptTimeout: DefaultAttemptTimeout,
		LeaseDuration:  DefaultLeaseDuration,
		AsyncBudget:    DefaultAsyncBudget,
	}
}

// ErrInvalidPolicy is wrapped by every error Validate returns.
var ErrInvalidPolicy = errors.New("invalid release policy")

// Validate checks the policy against its bounds; maxBudget is the
// configured ceiling for AsyncBudget (0 means no ceiling). The error names
// the offending field.
func (p Policy) Validate(maxBudget time.Duration) error {
	switch {
	case p.Mode != ModeAsync && p.Mode != ModeSync:
		return fmt.Errorf("%w: mode %q: want ASYNC or SYNC", ErrInvalidPolicy, p.Mode)
	case p.MaxAttempts < 1 || p.MaxAttempts > 1000:
		return fmt.Errorf("%w: max_attempts %d: want 1..1000", ErrInvalidPolicy, p.MaxAttempts)
	case len(p.RetryDelays) == 0:
		return fmt.Errorf("%w: retry_delays: want at least one delay", ErrInvalidPolicy)
	case p.Jitter < 0 || p.Jitter > 0.5:
		return fmt.Errorf("%w: jitter %v: want 0..0.5", ErrInvalidPolicy, p.Jitter)
	case p.AttemptTimeout <= 0:
		return fmt.Errorf("%w: attempt_timeout %v: want > 0", ErrInvalidPolicy, p.AttemptTimeout)
	case p.LeaseDuration <= 0:
		return fmt.Errorf("%w: lease_duration %v: want > 0", ErrInvalidPolicy, p.LeaseDuration)
	case p.AsyncBudget <= 0:
		return fmt.Errorf("%w: async_budget %v: want > 0", ErrInvalidPolicy, p.AsyncBudget)
	case maxBudget > 0 && p.AsyncBudget > maxBudget:
		return fmt.Errorf("%w: async_budget %v: more than the configured maximum %v", ErrInvalidPolicy, p.AsyncBudget, maxBudget)
	}
	for i, d := range p.RetryDelays {
		if d <= 0 || d > MaxDelay {
			return fmt.Errorf("%w: retry_delays[%d] %v: want (0, %v]", ErrInvalidPolicy, i, d, MaxDelay)
		}
	}
	return nil
}

// RetryDelay returns the delay before attempt failed+1, after `failed`
// attempts have failed (failed ≥ 1; smaller values are treated as 1). The
// result is the schedule's entry with ±Jitter applied using r (nil means
// the global source), never negative and never above MaxDelay+Jitter.
func (p Policy) RetryDelay(failed int, r *rand.Rand) time.Duration {
	if len(p.RetryDelays) == 0 {
		return 0
	}
	i := failed - 1
	if i < 0 {
		i = 0
	}
	if i >= len(p.RetryDelays) {
		i = len(p.RetryDelays) - 1
	}
	d := min(max(p.RetryDelays[i], 0), MaxDelay)
	if p.Jitter <= 0 {
		return d
	}
	var f float64
	if r != nil {
		f = r.Float64()
	} else {
		f = rand.Float64()
	}
	spread := float64(d) * p.Jitter * (2*f - 1)
	out := time.Duration(float64(d) + spread)
	if out < 0 {
		return 0
	}
	return out
}

// Exhausted reports whether an execution whose attempt `attempt` just failed
// has reached the attempt ceiling.
func (p Policy) Exhausted(attempt int) bool { return attempt >= p.MaxAttempts }
