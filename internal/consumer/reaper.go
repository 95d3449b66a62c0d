package consumer

import (
	"context"
	"errors"
	"time"

	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
)

// reapBatch is the most expired leases or budgets handled per sweep.
const reapBatch = 200

// RepairAfter is how long a QUEUED or RETRY_SCHEDULED execution without a
// dispatch record waits before the reaper re-creates one.
const RepairAfter = 2 * time.Minute

// Reap runs the lease and budget sweeps every interval until ctx ends.
// Several replicas may reap at once: every write is fenced, so a lease that
// was renewed, completed or re-claimed after it was read is left alone.
func (c *Consumer) Reap(ctx context.Context, interval time.Duration) error {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if err := c.ReapOnce(ctx); err != nil && ctx.Err() == nil {
			c.logger.Warn("reap sweep failed", "error", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// ReapOnce fails every attempt whose lease expired as lease.expired
// (scheduling the next attempt or exhausting), times out interactions past
// their deadline (failing the executions parked on them), and settles
// TIMED_OUT every execution whose async budget passed.
func (c *Consumer) ReapOnce(ctx context.Context) error {
	expired, err := c.store.LeaseExpiredList(ctx, reapBatch)
	if err != nil {
		return err
	}
	for _, l := range expired {
		if l.Mode == execution.ModeSync {
			c.reapSync(ctx, l)
			continue
		}
		policy := execution.DefaultPolicy()
		if cp, ok := c.cfg.Lookup(l.Capability); ok {
			policy = cp.Policy()
		}
		res, err := c.store.AttemptRetry(ctx, pgstore.RetryParams{
			ExecutionID: l.ExecutionID,
			Fence:       pgstore.Fence{Attempt: l.Attempt, LeaseToken: l.LeaseToken},
			Failure: execution.Failure{Class: execution.ClassLeaseExpired, Retryable: true,
				Message: "the attempt's lease expired before it finished"},
			Policy:         policy,
			AttemptOutcome: "LEASE_EXPIRED",
			RequireExpired: true,
		})
		switch {
		case errors.Is(err, execution.ErrLeaseLost), errors.Is(err, execution.ErrConflict):
			// Renewed, settled or re-claimed since it was read: nothing to do.
		case err != nil:
			c.logger.Warn("reaping an expired lease failed; next sweep retries", "execution_id", l.ExecutionID, "error", err)
		default:
			c.stats.reaped.Add(1)
			c.m.reaps.Add(ctx, 1)
			c.attempt(ctx, outcomeLeaseExpired, execution.ClassLeaseExpired)
			switch {
			case res.Released:
				c.settledAs(ctx, res.Execution.Status)
			case res.Decision == execution.RetryExhausted:
				c.settledAs(ctx, execution.StatusFailed)
			case res.Decision == execution.RetryBudgetExceeded:
				c.settledAs(ctx, execution.StatusTimedOut)
			}
			c.logger.Info("expired lease reaped", "execution_id", l.ExecutionID, "attempt", l.Attempt)
		}
	}
	if n, err := c.store.AwaitSweepDeadlines(ctx, reapBatch); err != nil {
		c.logger.Warn("interaction deadline sweep failed; next sweep retries", "error", err)
	} else if n > 0 {
		c.logger.Info("interactions timed out", "count", n)
	}
	if n, err := c.store.DispatchRepair(ctx, RepairAfter); err != nil {
		c.logger.Warn("dispatch repair failed; next sweep retries", "error", err)
	} else if n > 0 {
		c.logger.Warn("re-created lost dispatch records", "count", n)
	}
	budgets, err := c.store.BudgetExpiredList(ctx, reapBatch)
	if err != nil {
		return err
	}
	for _, b := range budgets {
		f := execution.Failure{Class: execution.ReasonAsyncBudget, Reason: execution.ReasonAsyncBudget,
			Message: "the async budget passed before the execution finished"}
		if b.LastFailure != nil {
			f.Class, f.Message = b.LastFailure.Class, b.LastFailure.Message
		}
		_, err := c.store.ExecutionSettle(ctx, pgstore.SettleParams{
			ExecutionID: b.ExecutionID, Fence: pgstore.Fence{Version: b.Version, Attempt: b.Attempt},
			Status: execution.StatusTimedOut, Failure: &f, AttemptOutcome: "ABANDONED",
			AttemptFailure: &execution.Failure{Class: execution.ReasonAsyncBudget, Message: f.Message},
		})
		switch {
		case errors.Is(err, execution.ErrConflict):
		case err != nil:
			c.logger.Warn("settling a passed budget failed; next sweep retries", "execution_id", b.ExecutionID, "error", err)
		default:
			c.stats.budgetTimeouts.Add(1)
			c.settledAs(ctx, execution.StatusTimedOut)
			c.logger.Info("async budget passed", "execution_id", b.ExecutionID)
		}
	}
	return nil
}

// reapSync settles FAILED a SYNC attempt whose gateway died mid-call: SYNC
// releases are never retried, and the caller has long had its answer (an
// error).
func (c *Consumer) reapSync(ctx context.Context, l pgstore.LeaseExpired) {
	f := execution.Failure{Class: execution.ClassLeaseExpired, Message: "the gateway running this SYNC execution stopped before settling it"}
	_, err := c.store.ExecutionSettle(ctx, pgstore.SettleParams{
		ExecutionID: l.ExecutionID, Fence: pgstore.Fence{Attempt: l.Attempt, LeaseToken: l.LeaseToken},
		Status: execution.StatusFailed, Failure: &f, AttemptOutcome: "LEASE_EXPIRED", AttemptFailure: &f,
	})
	switch {
	case errors.Is(err, execution.ErrConflict):
	case err != nil:
		c.logger.Warn("reap of a SYNC execution failed", "execution_id", l.ExecutionID, "error", err)
	default:
		c.stats.reaped.Add(1)
		c.m.reaps.Add(ctx, 1)
		c.attempt(ctx, outcomeLeaseExpired, execution.ClassLeaseExpired)
		c.settledAs(ctx, execution.StatusFailed)
		c.logger.Info("expired SYNC execution settled FAILED", "execution_id", l.ExecutionID)
	}
}
