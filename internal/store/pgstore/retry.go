package pgstore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/capstan-dev/capstan/internal/execution"
)

// Final reports whether a store error is an answer (the guard lost, the
// row is gone, the input is refused) rather than a failure to get one.
func Final(err error) bool {
	var inv *execution.InvalidArgumentError
	return errors.Is(err, execution.ErrConflict) || errors.Is(err, execution.ErrLeaseLost) ||
		errors.Is(err, execution.ErrNotFound) || errors.Is(err, execution.ErrCompletionRefused) ||
		errors.Is(err, execution.ErrPermissionDenied) || errors.As(err, &inv)
}

// Retry runs fn until it succeeds, fails with a final error, or ctx
// ends. Every other error — the database unreachable, but also a deadlock,
// a statement timeout or a full disk — is retried with backoff: giving up
// would drop a dispatch whose record is already deleted.
func Retry(ctx context.Context, log *slog.Logger, fn func() error) error {
	wait := 100 * time.Millisecond
	for {
		err := fn()
		if err == nil || Final(err) {
			return err
		}
		if ctx.Err() != nil {
			return err
		}
		log.Warn("store write failed; retrying", "error", err, "retry_in", wait)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%w (gave up at shutdown)", err)
		case <-t.C:
		}
		wait = min(wait*2, 5*time.Second)
	}
}
