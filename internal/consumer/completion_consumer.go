package consumer

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/capstan-dev/capstan/internal/admission"
	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/pkg/adapter"
)

// CompletionConsumer admits the kafka transport's completions from the
// response topics (SYSTEM §6). Deterministic refusals (malformed record,
// bad or foreign token, late or conflicting completion) are acknowledged,
// counted and dropped; a database outage is retried with backoff in the
// record's own goroutine, so one record never blocks the others of its
// partition — only the committed offset waits for it.
type CompletionConsumer struct {
	client   *kgo.Client
	admitter *admission.Admitter
	offsets  *offsetTracker
	logger   *slog.Logger

	admitted, duplicates, refused atomic.Int64
}

// CompletionStats counts what the completion consumer did.
type CompletionStats struct{ Admitted, Duplicates, Refused int64 }

// Stats returns the counters.
func (c *CompletionConsumer) Stats() CompletionStats {
	return CompletionStats{c.admitted.Load(), c.duplicates.Load(), c.refused.Load()}
}

// ResponseTopics returns the response topics of the releases that use the
// kafka transport.
func ResponseTopics(cfg *config.Config) []string {
	seen := map[string]bool{}
	var out []string
	for _, cp := range cfg.Capabilities {
		if a := cp.AwaitStep(); a != nil && a.Transport == "kafka" && !seen[a.ResponseTopic] {
			seen[a.ResponseTopic] = true
			out = append(out, a.ResponseTopic)
		}
	}
	return out
}

// CompletionClientOpts returns the options of the completion consumer's
// group client (group "<consumer.group>-completions", with the session
// timeout of consumer.session_timeout: completions on a dead consumer's
// partitions wait that long for another one).
func CompletionClientOpts(cfg *config.Config, offsets *offsetTracker, logger *slog.Logger) []kgo.Opt {
	return append(sessionOpts(cfg),
		kgo.ConsumerGroup(cfg.Consumer.Group+"-completions"),
		kgo.ConsumeTopics(ResponseTopics(cfg)...),
		kgo.AutoCommitMarks(),
		kgo.AutoCommitInterval(time.Second),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.OnPartitionsRevoked(func(ctx context.Context, cl *kgo.Client, revoked map[string][]int32) {
			if err := cl.CommitMarkedOffsets(ctx); err != nil {
				logger.Warn("commit on revoke failed; completions may be redelivered (admission is idempotent)", "error", err)
			}
			offsets.forget(revoked)
		}),
	)
}

// NewCompletionConsumer returns a completion consumer over client.
func NewCompletionConsumer(client *kgo.Client, admitter *admission.Admitter, offsets *offsetTracker, logger *slog.Logger) *CompletionConsumer {
	return &CompletionConsumer{client: client, admitter: admitter, offsets: offsets, logger: logger}
}

// maxCompletionsInFlight bounds the completions admitted at once.
const maxCompletionsInFlight = 64

// Run consumes until ctx ends.
func (c *CompletionConsumer) Run(ctx context.Context) error {
	sem := make(chan struct{}, maxCompletionsInFlight)
	var wg sync.WaitGroup
	defer func() {
		wg.Wait()
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = c.client.CommitMarkedOffsets(cctx)
	}()
	for {
		fetches := c.client.PollRecords(ctx, maxCompletionsInFlight)
		if ctx.Err() != nil {
			return nil
		}
		fetches.EachError(func(t string, p int32, err error) {
			c.logger.Warn("completion fetch error", "topic", t, "partition", p, "error", err)
		})
		for _, r := range fetches.Records() {
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				return nil
			}
			c.offsets.start(r)
			wg.Add(1)
			go func(r *kgo.Record) {
				defer wg.Done()
				defer func() { <-sem }()
				if c.handle(ctx, r) {
					c.offsets.markDone(c.client, r)
				}
			}(r)
		}
	}
}

// handle admits one completion record; false means ctx ended before it
// could (the record is redelivered).
func (c *CompletionConsumer) handle(ctx context.Context, r *kgo.Record) bool {
	comp, err := adapter.DecodeCompletion(r.Value)
	if err != nil {
		c.refused.Add(1)
		c.logger.Warn("malformed completion dropped", "topic", r.Topic, "partition", r.Partition, "offset", r.Offset, "error", err)
		return true
	}
	wait := 100 * time.Millisecond
	for {
		res, err := c.admitter.Admit(ctx, comp)
		switch {
		case err == nil && res.Duplicate:
			c.duplicates.Add(1)
			return true
		case err == nil:
			c.admitted.Add(1)
			return true
		case admission.Permanent(err) && !errors.Is(err, context.Canceled):
			c.refused.Add(1)
			c.logger.Info("completion refused and dropped", "topic", r.Topic, "offset", r.Offset, "error", err)
			return true
		}
		c.logger.Warn("completion not admitted yet; retrying", "error", err, "retry_in", wait)
		select {
		case <-ctx.Done():
			return false
		case <-time.After(wait):
		}
		wait = min(wait*2, 5*time.Second)
	}
}
