package router

import (
	"context"
	"encoding/base64"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/capstan-dev/capstan/internal/kafka"
	"github.com/capstan-dev/capstan/internal/kafkatest"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	eventv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/event/v1"
)

// TestRouterKafkaConsumer: an application whose consumer is a Kafka topic
// gets one record per event, keyed by execution id, with the payload as
// value and Standard Webhooks headers whose signature verifies.
func TestRouterKafkaConsumer(t *testing.T) {
	t.Parallel()
	const topic = "app.events"
	kc, err := kafkatest.Start(t.Context(), kafkatest.Options{Topics: map[string]int32{topic: 1}})
	require.NoError(t, err)
	t.Cleanup(kc.Close)
	producer, err := kafka.NewClient(kc.Brokers(), slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	t.Cleanup(producer.Close)

	h := newHarness(t)
	secret := newSecret(t)
	app := h.app(t, "", "")
	h.consumer(t, app.ID, pgstore.ConsumerKafka, topic, secret)
	id := h.event(t, app.ID)
	out := make(chan outcome, 4)

	h.start(t, compressedConfig(), out, nil, WithKafkaProducer(producer))
	await(t, out, finished(id))
	row := h.eventRow(t, id)
	require.Equal(t, pgstore.EventDelivered, row.Status)
	require.Nil(t, row.StatusCode, "no HTTP status for Kafka")

	reader, err := kgo.NewClient(kgo.SeedBrokers(kc.Brokers()...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	require.NoError(t, err)
	t.Cleanup(reader.Close)
	ctx, cancel := context.WithTimeout(t.Context(), waitTimeout)
	defer cancel()
	var recs []*kgo.Record
	for len(recs) == 0 {
		f := reader.PollFetches(ctx)
		require.NoError(t, ctx.Err(), "no record on the topic")
		require.Empty(t, f.Errors())
		recs = f.Records()
	}
	require.Len(t, recs, 1)
	rec := recs[0]
	var execID string
	require.NoError(t, h.pool.QueryRow(t.Context(), `SELECT execution_id::text FROM completion_events WHERE id = $1`, id).Scan(&execID))
	require.Equal(t, execID, string(rec.Key))
	require.Equal(t, row.Payload, rec.Value)
	hdr := http.Header{}
	for _, kv := range rec.Headers {
		hdr.Set(kv.Key, string(kv.Value))
	}
	require.Equal(t, id.String(), hdr.Get(HeaderWebhookID))
	require.Equal(t, "execution.succeeded", hdr.Get("capstan-event-type"))
	verifyEach(t, hdr, rec.Value, secret)
}

// TestRouterKafkaWithoutClient: a Kafka consumer and no client is a failed,
// retried attempt, never a crash.
func TestRouterKafkaWithoutClient(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	app := h.app(t, "", "")
	h.consumer(t, app.ID, pgstore.ConsumerKafka, "app.events")
	id := h.event(t, app.ID)
	out := make(chan outcome, 4)

	h.start(t, compressedConfig(), out, nil)
	o := wait(t, out, "the first attempt")
	require.NoError(t, o.Err)
	require.Equal(t, id, o.P.ID)
	require.False(t, o.P.Delivered || o.P.Dead)
	require.Equal(t, errNoKafka, o.P.Error)
}

// eventConsumer is an application-hosted EventConsumerService that fails
// the first failures calls with UNAVAILABLE.
type eventConsumer struct {
	eventv1.UnimplementedEventConsumerServiceServer
	failures int
	mu       sync.Mutex
	calls    []grpcCall
}

type grpcCall struct {
	md  metadata.MD
	req *eventv1.DeliverRequest
}

func (c *eventConsumer) Deliver(ctx context.Context, req *eventv1.DeliverRequest) (*eventv1.DeliverResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls = append(c.calls, grpcCall{md: md, req: req})
	if len(c.calls) <= c.failures {
		return nil, status.Error(codes.Unavailable, "warming up")
	}
	return &eventv1.DeliverResponse{}, nil
}

// TestRouterGRPCConsumer: a gRPC consumer gets Deliver calls carrying the
// event, its exact payload and Standard Webhooks metadata; a non-OK answer
// is a failed attempt retried on the schedule.
func TestRouterGRPCConsumer(t *testing.T) {
	t.Parallel()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer()
	ec := &eventConsumer{failures: 1}
	eventv1.RegisterEventConsumerServiceServer(srv, ec)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)

	h := newHarness(t)
	secret := newSecret(t)
	app := h.app(t, "", "")
	h.consumer(t, app.ID, pgstore.ConsumerGRPC, lis.Addr().String(), secret)
	id := h.event(t, app.ID)
	out := make(chan outcome, 4)

	r := h.start(t, compressedConfig(), out, nil)
	await(t, out, finished(id))
	r.stop(t)

	row := h.eventRow(t, id)
	require.Equal(t, pgstore.EventDelivered, row.Status)
	atts := h.attempts(t, id)
	require.Len(t, atts, 2)
	require.Nil(t, atts[0].StatusCode)
	require.Equal(t, "grpc Unavailable: warming up", *atts[0].Error)
	require.Equal(t, "grpc", atts[0].ConsumerKind)
	require.Nil(t, atts[1].Error)

	ec.mu.Lock()
	defer ec.mu.Unlock()
	require.Len(t, ec.calls, 2)
	for i, c := range ec.calls {
		require.Equal(t, id.String(), c.req.GetEvent().GetEventId())
		require.Equal(t, row.Payload, c.req.GetPayload())
		require.EqualValues(t, i+1, c.req.GetAttempt())
		hdr := http.Header{}
		for _, k := range []string{HeaderWebhookID, HeaderWebhookTimestamp, HeaderWebhookSignature} {
			require.Len(t, c.md.Get(k), 1, k)
			hdr.Set(k, c.md.Get(k)[0])
		}
		require.Equal(t, id.String(), hdr.Get(HeaderWebhookID))
		verifyEach(t, hdr, c.req.GetPayload(), secret)
		var decoded eventv1.CompletionEvent
		require.NoError(t, protojson.Unmarshal(c.req.GetPayload(), &decoded))
	}
}

// TestRouterGRPCConsumerGuard: with private addresses refused, a gRPC
// consumer on loopback is never dialled.
func TestRouterGRPCConsumerGuard(t *testing.T) {
	t.Parallel()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer()
	ec := &eventConsumer{}
	eventv1.RegisterEventConsumerServiceServer(srv, ec)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	h := newHarness(t)
	app := h.app(t, "", "")
	h.consumer(t, app.ID, pgstore.ConsumerGRPC, lis.Addr().String())
	id := h.event(t, app.ID)
	cfg := compressedConfig()
	cfg.AllowPrivateAddresses = false
	out := make(chan outcome, 4)

	h.start(t, cfg, out, nil)
	o := wait(t, out, "the first attempt")
	require.Equal(t, id, o.P.ID)
	require.False(t, o.P.Delivered)
	require.Contains(t, o.P.Error, "is loopback")
	ec.mu.Lock()
	defer ec.mu.Unlock()
	require.Empty(t, ec.calls)
}

// TestRouterSealsPlaintextSecrets: a router with a secret key encrypts
// secrets stored in plaintext (registered without the key) and still signs
// with them; a router without the key cannot use them and says so.
func TestRouterSealsPlaintextSecrets(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	rc := newReceiver(t, func(int, http.ResponseWriter, *http.Request) {})
	secret := newSecret(t)
	app := h.app(t, rc.URL, secret) // no box: plaintext
	var stored string
	require.NoError(t, h.pool.QueryRow(t.Context(), `SELECT sealed FROM event_consumer_secrets WHERE application_id = $1`, app.ID).Scan(&stored))
	require.Equal(t, secret, stored, "registered without a key: plaintext")
	id := h.event(t, app.ID)
	cfg := compressedConfig()
	cfg.SecretKey = base64.StdEncoding.EncodeToString([]byte("0123456789abcdef0123456789abcdef"))
	var logs logBuffer
	out := make(chan outcome, 4)

	r := h.start(t, cfg, out, teeLogger(t, &logs))
	await(t, out, finished(id))
	r.stop(t)
	require.Equal(t, pgstore.EventDelivered, h.eventRow(t, id).Status)
	verifySignature(t, secret, rc.requests()[0].Header, rc.requests()[0].Body)
	require.NoError(t, h.pool.QueryRow(t.Context(), `SELECT sealed FROM event_consumer_secrets WHERE application_id = $1`, app.ID).Scan(&stored))
	require.True(t, strings.HasPrefix(stored, "aesgcm1:"), "sealed at rest")
	require.NotContains(t, stored, strings.TrimPrefix(secret, "whsec_"))
	require.NotContains(t, logs.String(), strings.TrimPrefix(secret, "whsec_"))

	next := h.event(t, app.ID)
	h.start(t, compressedConfig(), out, nil) // no key
	o := wait(t, out, "an attempt without the key")
	require.Equal(t, next, o.P.ID)
	require.False(t, o.P.Delivered)
	require.Contains(t, o.P.Error, "signing secret cannot be decrypted")
	require.Len(t, rc.requests(), 1, "nothing unsigned is sent")
}

// fakeMeter records what the router's instruments see.
type fakeMeter struct {
	noop.Meter
	mu       sync.Mutex
	adds     map[string][]point // instrument name → points
	callback metric.Callback
}

type point struct {
	value float64
	attrs map[string]string
}

func attrMap(set attribute.Set) map[string]string {
	m := map[string]string{}
	for _, kv := range set.ToSlice() {
		m[string(kv.Key)] = kv.Value.Emit()
	}
	return m
}

func (m *fakeMeter) add(name string, v float64, set attribute.Set) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.adds[name] = append(m.adds[name], point{value: v, attrs: attrMap(set)})
}

func (m *fakeMeter) points(name string) []point {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]point(nil), m.adds[name]...)
}

type fakeProvider struct {
	noop.MeterProvider
	m *fakeMeter
}

func (p fakeProvider) Meter(string, ...metric.MeterOption) metric.Meter { return p.m }

type fakeCounter struct {
	noop.Int64Counter
	m    *fakeMeter
	name string
}

func (c fakeCounter) Add(_ context.Context, v int64, opts ...metric.AddOption) {
	c.m.add(c.name, float64(v), metric.NewAddConfig(opts).Attributes())
}

type fakeHistogram struct {
	noop.Float64Histogram
	m    *fakeMeter
	name string
}

func (h fakeHistogram) Record(_ context.Context, v float64, opts ...metric.RecordOption) {
	h.m.add(h.name, v, metric.NewRecordConfig(opts).Attributes())
}

func (m *fakeMeter) Int64Counter(name string, _ ...metric.Int64CounterOption) (metric.Int64Counter, error) {
	return fakeCounter{m: m, name: name}, nil
}

func (m *fakeMeter) Float64Histogram(name string, _ ...metric.Float64HistogramOption) (metric.Float64Histogram, error) {
	return fakeHistogram{m: m, name: name}, nil
}

func (m *fakeMeter) RegisterCallback(f metric.Callback, _ ...metric.Observable) (metric.Registration, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.callback = f
	return noop.Registration{}, nil
}

// fakeObserver records observations by value type: float64 for the age
// gauge, int64 for the count gauge.
type fakeObserver struct {
	noop.Observer
	ages   map[string]float64
	counts map[string]int64
}

func (o *fakeObserver) ObserveFloat64(_ metric.Float64Observable, v float64, opts ...metric.ObserveOption) {
	o.ages[attrMap(metric.NewObserveConfig(opts).Attributes())["application_id"]] = v
}

func (o *fakeObserver) ObserveInt64(_ metric.Int64Observable, v int64, opts ...metric.ObserveOption) {
	o.counts[attrMap(metric.NewObserveConfig(opts).Attributes())["application_id"]] = v
}

// TestRouterMetrics checks the OpenTelemetry instruments: deliveries by
// outcome and status code, latency from settlement, dead events by reason,
// and the pending gauges read from the database.
func TestRouterMetrics(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ok := newReceiver(t, func(int, http.ResponseWriter, *http.Request) {})
	gone := newReceiver(t, func(_ int, w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusGone) })
	okApp, goneApp := h.app(t, ok.URL, newSecret(t)), h.app(t, gone.URL, newSecret(t))
	delivered, dead := h.event(t, okApp.ID), h.event(t, goneApp.ID)
	fm := &fakeMeter{adds: map[string][]point{}}
	out := make(chan outcome, 8)

	r := h.start(t, compressedConfig(), out, nil, WithMeterProvider(fakeProvider{m: fm}))
	done := map[uuid.UUID]bool{}
	await(t, out, func(o outcome) bool {
		if finished(delivered)(o) || finished(dead)(o) {
			done[o.P.ID] = true
		}
		return len(done) == 2
	})
	r.stop(t)

	deliveries := fm.points(MetricDeliveries)
	require.ElementsMatch(t, []point{
		{1, map[string]string{"outcome": "delivered", "consumer_kind": "webhook", "status_code": "200"}},
		{1, map[string]string{"outcome": "gone", "consumer_kind": "webhook", "status_code": "410"}},
	}, deliveries)
	require.Equal(t, []point{{1, map[string]string{"reason": "gone"}}}, fm.points(MetricDead))
	lat := fm.points(MetricDeliveryLatency)
	require.Len(t, lat, 1)
	require.GreaterOrEqual(t, lat[0].value, 0.0)
	require.Equal(t, map[string]string{"consumer_kind": "webhook"}, lat[0].attrs)

	// The goneApp's consumer is disabled: this event stays PENDING.
	h.event(t, goneApp.ID)
	fm.mu.Lock()
	cb := fm.callback
	fm.mu.Unlock()
	require.NotNil(t, cb, "pending gauges registered")
	obs := &fakeObserver{ages: map[string]float64{}, counts: map[string]int64{}}
	require.NoError(t, cb(t.Context(), obs))
	require.Equal(t, map[string]int64{goneApp.ID.String(): 1}, obs.counts)
	require.Contains(t, obs.ages, goneApp.ID.String())
	require.GreaterOrEqual(t, obs.ages[goneApp.ID.String()], 0.0)
	require.Less(t, obs.ages[goneApp.ID.String()], time.Hour.Seconds())
}
