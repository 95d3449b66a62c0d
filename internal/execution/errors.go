package execution

import "errors"

// Sentinel errors of the domain. Callers branch on them with errors.Is; the
// gRPC edge translates them to status codes in one place.
var (
	// ErrNotFound: no such execution (for this application).
	ErrNotFound = errors.New("execution not found")
	// ErrIdempotencyConflict: the idempotency key was used with a different
	// request.
	ErrIdempotencyConflict = errors.New("idempotency key already used with a different request")
	// ErrUnknownCapability: no release is configured for the capability.
	ErrUnknownCapability = errors.New("unknown capability")
	// ErrConflict: a guarded update matched zero rows; another writer won.
	ErrConflict = errors.New("guarded update lost: state changed meanwhile")
	// ErrLeaseLost: the lease token or attempt no longer matches.
	ErrLeaseLost = errors.New("lease lost")
	// ErrUnauthenticated: missing or unknown credentials.
	ErrUnauthenticated = errors.New("unauthenticated")
	// ErrUnavailable: a dependency (the database) could not be reached.
	ErrUnavailable = errors.New("unavailable")
	// ErrPermissionDenied: the caller is authenticated but does not own
	// what it names (another application's execution, a capability the
	// adapter does not serve).
	ErrPermissionDenied = errors.New("permission denied")
	// ErrCompletionRefused: a completion that is no longer applicable: the
	// interaction is already terminal with another outcome, its deadline
	// passed, or the execution is SYNC.
	ErrCompletionRefused = errors.New("completion refused")
)

// InvalidArgumentError says which field of a request is invalid and why.
type InvalidArgumentError struct {
	Field  string
	Reason string
}

func (e *InvalidArgumentError) Error() string { return e.Field + ": " + e.Reason }
