// Package kafkatest runs an embedded, in-memory Kafka broker
// (github.com/twmb/franz-go/pkg/kfake) for tests and local development.
//
// [Start] gives a single-broker cluster on a loopback port with the requested
// topics already created; [Run] hosts one until a context ends, for a dev
// command that serves Kafka from its own process. The fake speaks the real
// wire protocol, so production clients (kgo) connect to [Cluster.Brokers]
// unchanged. Nothing is persisted: all data is lost on Close.
package kafkatest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"

	"github.com/twmb/franz-go/pkg/kfake"
)

// DefaultAddr is the listen address used when [Options].Addr is empty: a
// free port on the IPv4 loopback interface.
const DefaultAddr = "127.0.0.1:0"

// Options configures [Start]. The zero value is valid.
type Options struct {
	// Addr is the host:port the broker listens on, and the address it
	// advertises to clients in metadata, so the host must be an address
	// clients can dial (not 0.0.0.0 or ::). Port 0 picks a free port.
	// Default: DefaultAddr ("127.0.0.1:0").
	Addr string

	// Topics maps topic names to partition counts; they exist before Start
	// returns. A count <= 0 means kfake's default of 10 partitions. Other
	// topics can be created by clients (CreateTopics) or via Fake().
	Topics map[string]int32

	// Logger receives the broker's logs: kfake errors and warnings at the
	// same slog levels, its per-request info and debug logs at slog's Debug
	// level and below. nil discards them.
	Logger *slog.Logger

	// Extra are additional kfake options (e.g. kfake.GroupMinSessionTimeout,
	// kfake.BrokerConfigs), applied after ours. Options changing the number
	// of brokers or their listeners (NumBrokers, Ports, ListenFn) break
	// Brokers and are not supported.
	Extra []kfake.Opt
}

// Cluster is a running embedded Kafka broker. It is safe for concurrent use.
// Callers must call [Cluster.Close].
type Cluster struct {
	fake    *kfake.Cluster
	brokers []string
	log     *slog.Logger
	once    sync.Once
}

// Start listens on opts.Addr, starts a single kfake broker with opts.Topics
// created, and returns it once it accepts connections. ctx is only checked
// before starting: kfake starts synchronously. Errors: an invalid or
// unspecified Addr, a port already in use, or a kfake configuration error.
func Start(ctx context.Context, opts Options) (*Cluster, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("kafkatest: start: %w", err)
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	addr := opts.Addr
	if addr == "" {
		addr = DefaultAddr
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("kafkatest: invalid address %q: %w", addr, err)
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		return nil, fmt.Errorf("kafkatest: address %q: the host is advertised to clients and must be dialable, not unspecified", addr)
	}

	// We bind the listener ourselves and hand it to kfake: kfake.Ports
	// would need a port number picked in advance, which another process
	// could take before kfake binds it.
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("kafkatest: listen on %s: %w", addr, err)
	}
	var lnOnce sync.Once
	listen := func(network, address string) (net.Listener, error) {
		var l net.Listener
		lnOnce.Do(func() { l = ln })
		if l != nil {
			return l, nil
		}
		return nil, fmt.Errorf("kafkatest: only a single broker is supported (asked to listen on %s %s)", network, address)
	}

	kopts := []kfake.Opt{
		kfake.NumBrokers(1),
		kfake.ListenFn(listen),
		kfake.WithLogger(slogAdapter{ctx: context.WithoutCancel(ctx), log: log}),
	}
	for topic, partitions := range opts.Topics {
		kopts = append(kopts, kfake.SeedTopics(partitions, topic))
	}
	kopts = append(kopts, opts.Extra...)

	fake, err := kfake.NewCluster(kopts...)
	if err != nil {
		ln.Close() // kfake closes it too on most errors; closing twice is harmless
		return nil, fmt.Errorf("kafkatest: start kfake: %w", err)
	}
	c := &Cluster{fake: fake, brokers: []string{ln.Addr().String()}, log: log}
	log.InfoContext(ctx, "kafkatest: broker listening", "addr", c.brokers[0], "topics", len(opts.Topics))
	return c, nil
}

// Brokers returns the seed broker addresses (host:port) for kgo.SeedBrokers.
// It is valid after Close, but nothing listens there then.
func (c *Cluster) Brokers() []string {
	return append([]string(nil), c.brokers...)
}

// Fake returns the underlying kfake cluster for fault injection (ControlKey,
// Fault), topic management and group inspection.
//
// Do not call its methods after Close: most of them (ListenAddrs,
// CreateTopic, PartitionInfos, ...) hand work to the cluster's event loop and
// block forever once it has stopped.
func (c *Cluster) Fake() *kfake.Cluster { return c.fake }

// Close stops the broker, closing its listener and client connections. It
// is idempotent. Data is discarded.
func (c *Cluster) Close() {
	c.once.Do(func() {
		c.fake.Close()
		c.log.Info("kafkatest: broker stopped", "addr", c.brokers[0])
	})
}

// Run starts a broker on addr (see [Options].Addr; empty means
// DefaultAddr) with topics created (see [Options].Topics) and serves until
// ctx is done, then closes it and returns nil. It returns an error only if
// the broker cannot start. logger may be nil.
func Run(ctx context.Context, addr string, topics map[string]int32, logger *slog.Logger) error {
	c, err := Start(ctx, Options{Addr: addr, Topics: topics, Logger: logger})
	if err != nil {
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			return nil // asked to stop before we started
		}
		return err
	}
	defer c.Close()
	<-ctx.Done()
	return nil
}

// slogAdapter forwards kfake's printf-style logs to slog.
type slogAdapter struct {
	ctx context.Context
	log *slog.Logger
}

// Logf implements kfake.Logger. kfake logs every request at info level, so
// its info and debug levels map to slog Debug and Debug-4.
func (a slogAdapter) Logf(level kfake.LogLevel, format string, args ...any) {
	var l slog.Level
	switch level {
	case kfake.LogLevelError:
		l = slog.LevelError
	case kfake.LogLevelWarn:
		l = slog.LevelWarn
	case kfake.LogLevelInfo:
		l = slog.LevelDebug
	case kfake.LogLevelDebug:
		l = slog.LevelDebug - 4
	default:
		return
	}
	if !a.log.Enabled(a.ctx, l) {
		return
	}
	a.log.Log(a.ctx, l, "kfake: "+fmt.Sprintf(format, args...))
}
