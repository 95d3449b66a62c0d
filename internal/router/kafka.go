package router

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel"

	"github.com/capstan-dev/capstan/internal/kafka"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
)

// KafkaProducer is what the router needs of a Kafka client (*kgo.Client
// satisfies it): a synchronous produce that returns once the records are
// acknowledged (acks from all in-sync replicas, kgo's default) or failed.
type KafkaProducer interface {
	ProduceSync(ctx context.Context, rs ...*kgo.Record) kgo.ProduceResults
}

// errNoKafka is the reason of an attempt to a Kafka consumer when the router
// has no Kafka client.
const errNoKafka = "kafka consumer: the router has no Kafka client"

// deliverKafka produces ev to the consumer's topic: key = execution id,
// value = the stored payload (protobuf JSON of the CompletionEvent), headers
// webhook-id (the event id, stable across retries), webhook-timestamp,
// webhook-signature (when the consumer has secrets, signed as for webhooks),
// content-type, capstan-event-type and traceparent (the delivery span's
// context, when tracing is on). Success is the broker's
// acknowledgement within config.Router.Timeout; anything else is a failed
// attempt, retried on the schedule.
func (r *Router) deliverKafka(ctx context.Context, ev pgstore.EventDelivery) attemptResult {
	if r.kafka == nil {
		return failed(0, errNoKafka)
	}
	id := ev.ID.String()
	ts := r.now().Unix()
	headers := []kgo.RecordHeader{
		{Key: HeaderWebhookID, Value: []byte(id)},
		{Key: HeaderWebhookTimestamp, Value: []byte(strconv.FormatInt(ts, 10))},
		{Key: "content-type", Value: []byte("application/json")},
		{Key: "capstan-event-type", Value: []byte(ev.Type)},
	}
	if len(ev.Secrets) > 0 {
		sig, err := signatures(id, ts, ev.Payload, ev.Secrets)
		if err != nil {
			return failed(0, errBadSecret)
		}
		headers = append(headers, kgo.RecordHeader{Key: HeaderWebhookSignature, Value: []byte(sig)})
	}
	rec := &kgo.Record{
		Topic:   ev.ConsumerTarget,
		Key:     []byte(ev.ExecutionID.String()),
		Value:   ev.Payload,
		Headers: headers,
	}
	otel.GetTextMapPropagator().Inject(ctx, kafka.HeaderCarrier{Record: rec}) // traceparent
	ctx, cancel := context.WithTimeout(ctx, r.cfg.Timeout)
	defer cancel()
	if err := r.kafka.ProduceSync(ctx, rec).FirstErr(); err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return failed(0, fmt.Sprintf("kafka: timeout after %v", r.cfg.Timeout))
		}
		return failed(0, truncate(sanitize([]byte("kafka: "+err.Error())), maxErrorBytes))
	}
	return attemptResult{Delivered: true}
}
