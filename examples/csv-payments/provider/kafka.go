package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/capstan-dev/capstan/pkg/adapter"
)

// maxPollRecords bounds the requests answered concurrently by the kafka
// transport (one poll's worth).
const maxPollRecords = 500

// kafkaTransport consumes the kafka transport's request topic in a
// consumer group and produces each completion to the response topic keyed
// by the request's correlation id. Offsets are committed only after the
// completions of the records before them were produced, so a crash
// redelivers requests rather than losing them; the redelivered request is
// decided the same way (the decision is deterministic) and Capstan admits
// the identical completion as a duplicate.
type kafkaTransport struct {
	p             *provider
	client        *kgo.Client
	responseTopic string
	grace         time.Duration
	logger        *slog.Logger
}

// kafkaOpts are the options of the provider's Kafka client for cfg.
func kafkaOpts(cfg config, logger *slog.Logger) []kgo.Opt {
	return []kgo.Opt{
		kgo.SeedBrokers(splitBrokers(cfg.KafkaBrokers)...),
		kgo.ConsumerGroup(cfg.KafkaGroup),
		kgo.ConsumeTopics(cfg.RequestTopic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.FetchMaxWait(500 * time.Millisecond),
		kgo.AutoCommitMarks(),
		kgo.AutoCommitInterval(time.Second),
		kgo.OnPartitionsRevoked(func(ctx context.Context, cl *kgo.Client, _ map[string][]int32) {
			if err := cl.CommitMarkedOffsets(ctx); err != nil {
				logger.WarnContext(ctx, "commit on revoke failed; requests may be redelivered", slog.Any("error", err))
			}
		}),
		kgo.ProducerLinger(0),
		kgo.WithLogger(kgoLogger{logger}),
	}
}

// splitBrokers splits a comma-separated broker list, dropping blanks.
func splitBrokers(s string) []string {
	var out []string
	for b := range strings.SplitSeq(s, ",") {
		if b = strings.TrimSpace(b); b != "" {
			out = append(out, b)
		}
	}
	return out
}

// serveKafka runs the kafka transport until ctx ends, then lets the
// requests in flight finish for up to cfg.grace(), commits and
// leaves the group.
func serveKafka(ctx context.Context, cfg config, p *provider, logger *slog.Logger) error {
	cl, err := kgo.NewClient(kafkaOpts(cfg, logger)...)
	if err != nil {
		return fmt.Errorf("provider: kafka client: %w", err)
	}
	defer cl.Close()
	k := &kafkaTransport{p: p, client: cl, responseTopic: cfg.ResponseTopic, grace: cfg.grace(), logger: logger}
	logger.InfoContext(ctx, "kafka transport consuming", slog.String("brokers", cfg.KafkaBrokers),
		slog.String("request_topic", cfg.RequestTopic), slog.String("response_topic", cfg.ResponseTopic),
		slog.String("group", cfg.KafkaGroup))
	k.run(ctx)
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := cl.CommitMarkedOffsets(cctx); err != nil {
		logger.WarnContext(cctx, "final commit failed; requests may be redelivered", slog.Any("error", err))
	}
	return nil
}

// run polls and answers batches of requests until ctx ends. A batch is
// answered concurrently; its offsets are marked for commit up to the first
// record per partition that could not be answered (shutdown), which is
// redelivered to the next member.
func (k *kafkaTransport) run(ctx context.Context) {
	work, cancelWork := drainContext(ctx, k.grace)
	defer cancelWork()
	for {
		fetches := k.client.PollRecords(ctx, maxPollRecords)
		if ctx.Err() != nil || fetches.IsClientClosed() {
			return
		}
		fetches.EachError(func(topic string, partition int32, err error) {
			k.logger.WarnContext(ctx, "fetch failed", slog.String("topic", topic), slog.Int("partition", int(partition)), slog.Any("error", err))
		})
		recs := fetches.Records()
		done := make([]bool, len(recs))
		var wg sync.WaitGroup
		for i, r := range recs {
			wg.Go(func() { done[i] = k.handle(work, r) })
		}
		wg.Wait()
		var mark []*kgo.Record
		stopped := map[string]map[int32]bool{}
		for i, r := range recs {
			if stopped[r.Topic][r.Partition] {
				continue
			}
			if !done[i] {
				if stopped[r.Topic] == nil {
					stopped[r.Topic] = map[int32]bool{}
				}
				stopped[r.Topic][r.Partition] = true
				continue
			}
			mark = append(mark, r)
		}
		k.client.MarkCommitRecords(mark...)
	}
}

// handle answers one request record; false means it could not (ctx
// ended) and must be redelivered. Malformed records and resent requests
// are skipped.
func (k *kafkaTransport) handle(ctx context.Context, r *kgo.Record) bool {
	var req adapter.InteractionRequest
	err := json.Unmarshal(r.Value, &req)
	if err == nil {
		err = checkRequest(req, false)
	}
	if err != nil {
		k.logger.WarnContext(ctx, "malformed request skipped", slog.String("topic", r.Topic),
			slog.Int("partition", int(r.Partition)), slog.Int64("offset", r.Offset), slog.Any("error", err))
		return true
	}
	if !k.p.admitInteraction(req, time.Now()) {
		k.logger.DebugContext(ctx, "resent request ignored", slog.String("interaction_id", req.InteractionID))
		return true
	}
	key := req.CorrelationID
	if key == "" {
		key = req.InteractionID
	}
	err = k.p.answer(ctx, req, func(ctx context.Context, c adapter.InteractionCompletion) (bool, error) {
		body, err := json.Marshal(c)
		if err != nil {
			return false, fmt.Errorf("encode completion: %w", err)
		}
		rec := &kgo.Record{Topic: k.responseTopic, Key: []byte(key), Value: body}
		if err := k.client.ProduceSync(ctx, rec).FirstErr(); err != nil {
			return false, fmt.Errorf("produce completion: %w", err)
		}
		return false, nil
	})
	// A request past its deadline is not redelivered: Capstan refuses
	// its completion anyway.
	return err == nil || ctx.Err() == nil
}

// kgoLogger forwards the Kafka client's warnings and errors to slog.
type kgoLogger struct{ l *slog.Logger }

// Level implements kgo.Logger.
func (a kgoLogger) Level() kgo.LogLevel { return kgo.LogLevelWarn }

// Log implements kgo.Logger.
func (a kgoLogger) Log(level kgo.LogLevel, msg string, keyvals ...any) {
	l := slog.LevelWarn
	if level == kgo.LogLevelError {
		l = slog.LevelError
	}
	a.l.Log(context.Background(), l, "kafka: "+msg, keyvals...)
}
