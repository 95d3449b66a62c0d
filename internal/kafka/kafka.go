// Package kafka builds franz-go clients for Capstan's daemons and makes sure
// the topics they need exist.
package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/propagation"
)

// NewClient returns a client for brokers with the given extra options. It
// logs through logger at warn level and above.
func NewClient(brokers []string, logger *slog.Logger, opts ...kgo.Opt) (*kgo.Client, error) {
	base := []kgo.Opt{
		kgo.SeedBrokers(brokers...),
		kgo.WithLogger(&slogAdapter{l: logger}),
		kgo.RetryBackoffFn(func(tries int) time.Duration {
			return min(time.Duration(tries)*100*time.Millisecond, 2*time.Second)
		}),
	}
	cl, err := kgo.NewClient(append(base, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("kafka client: %w", err)
	}
	return cl, nil
}

// EnsureTopic creates topic with partitions (replication factor -1: the
// broker default) unless it exists.
func EnsureTopic(ctx context.Context, cl *kgo.Client, topic string, partitions int32) error {
	adm := kadm.NewClient(cl)
	resp, err := adm.CreateTopic(ctx, partitions, -1, nil, topic)
	if err == nil {
		err = resp.Err
	}
	if err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
		return fmt.Errorf("create topic %s: %w", topic, err)
	}
	return nil
}

// Ping checks that a broker answers.
func Ping(ctx context.Context, cl *kgo.Client) error {
	if err := cl.Ping(ctx); err != nil {
		return fmt.Errorf("kafka: %w", err)
	}
	return nil
}

type slogAdapter struct{ l *slog.Logger }

func (a *slogAdapter) Level() kgo.LogLevel { return kgo.LogLevelWarn }

func (a *slogAdapter) Log(level kgo.LogLevel, msg string, keyvals ...any) {
	lvl := slog.LevelInfo
	switch level {
	case kgo.LogLevelError:
		lvl = slog.LevelError
	case kgo.LogLevelWarn:
		lvl = slog.LevelWarn
	case kgo.LogLevelDebug:
		lvl = slog.LevelDebug
	}
	a.l.Log(context.Background(), lvl, "kafka: "+msg, keyvals...)
}

// HeaderCarrier adapts the headers of a Kafka record to
// propagation.TextMapCarrier, so the global propagator can inject a span
// context into a record (traceparent header) and extract it again.
type HeaderCarrier struct {
	// Record is the record whose headers are read and written.
	Record *kgo.Record
}

var _ propagation.TextMapCarrier = HeaderCarrier{}

// Get returns the value of the first header named key, or "".
func (c HeaderCarrier) Get(key string) string {
	for _, h := range c.Record.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// Set replaces every header named key with one holding value.
func (c HeaderCarrier) Set(key, value string) {
	hs := c.Record.Headers[:0:0]
	for _, h := range c.Record.Headers {
		if h.Key != key {
			hs = append(hs, h)
		}
	}
	c.Record.Headers = append(hs, kgo.RecordHeader{Key: key, Value: []byte(value)})
}

// Keys returns the header names.
func (c HeaderCarrier) Keys() []string {
	out := make([]string, 0, len(c.Record.Headers))
	for _, h := range c.Record.Headers {
		out = append(out, h.Key)
	}
	return out
}
