package execution

import "unicode/utf8"

// Failure classes are dotted strings. The ones Capstan itself produces are
// listed here; adapters may report their own (for example
// "payment.declined"), which Capstan stores as given after bounding them.
const (
	// ClassAdapterUnavailable: the adapter could not be reached or answered
	// UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED, INTERNAL or an unknown code.
	// Retryable.
	ClassAdapterUnavailable = "adapter.unavailable"
	// ClassAdapterDeadlineExceeded: the adapter did not answer within the
	// attempt timeout. Retryable.
	ClassAdapterDeadlineExceeded = "adapter.deadline_exceeded"
	// ClassAdapterRejected: the adapter refused the request
	// (INVALID_ARGUMENT, FAILED_PRECONDITION, UNIMPLEMENTED, PERMISSION_DENIED,
	// UNAUTHENTICATED, NOT_FOUND). Terminal.
	ClassAdapterRejected = "adapter.rejected"
	// ClassAdapterProtocol: the adapter answered with neither a result nor a
	// failure. Retryable.
	ClassAdapterProtocol = "adapter.protocol"
	// ClassLeaseExpired: the attempt's lease expired before it finished.
	// Retryable.
	ClassLeaseExpired = "lease.expired"
	// ClassInputInvalid: the input cannot be executed. Terminal.
	ClassInputInvalid = "input.invalid"
	// ClassConfigMissing: the capability or release is no longer configured.
	// Terminal.
	ClassConfigMissing = "config.capability_missing"
)

// Settlement reasons.
const (
	ReasonAttemptLimit = "retry_exhausted.attempt_limit"
	ReasonAsyncBudget  = "timeout.async_budget"
	ReasonByCaller     = "cancelled.by_caller"
)

// Bounds on what a failure stores.
const (
	MaxClassBytes   = 128
	MaxMessageBytes = 1024
)

// Failure is the outcome of a failed attempt or execution.
type Failure struct {
	Class     string // dotted class, at most MaxClassBytes
	Reason    string // settlement reason, empty when the adapter decided
	Message   string // at most MaxMessageBytes, valid UTF-8
	Retryable bool   // whether another attempt may succeed
}

// Bounded returns f with class and message cut to their limits at a rune
// boundary and invalid UTF-8 replaced, so that anything an adapter sends can
// be stored. An empty class becomes "adapter.unspecified".
func (f Failure) Bounded() Failure {
	f.Class = truncateUTF8(f.Class, MaxClassBytes)
	if f.Class == "" {
		f.Class = "adapter.unspecified"
	}
	f.Reason = truncateUTF8(f.Reason, MaxClassBytes)
	f.Message = truncateUTF8(f.Message, MaxMessageBytes)
	return f
}

func truncateUTF8(s string, max int) string {
	if !utf8.ValidString(s) {
		s = string([]rune(s)) // replaces invalid bytes with U+FFFD
	}
	s = stripNUL(s)
	if len(s) <= max {
		return s
	}
	cut := max
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut]
}

func stripNUL(s string) string {
	out := make([]byte, 0, len(s))
	for i := 0; i < len(s); i++ {
		if s[i] != 0 {
			out = append(out, s[i])
		}
	}
	return string(out)
}
