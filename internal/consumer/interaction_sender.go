package consumer

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/kafka"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/telemetry"
	"github.com/capstan-dev/capstan/internal/token"
	"github.com/capstan-dev/capstan/pkg/adapter"
)

// InteractionSender pushes interactions of the webhook and kafka transports
// out (SYSTEM §6): a signed HTTP POST of adapter.InteractionRequest, or a
// record on the request topic keyed by correlation id. Each carries a
// resume token bound to the application, execution, interaction and
// deadline. Failed sends are retried with backoff until the deadline.
type InteractionSender struct {
	store    *pgstore.Store
	cfg      *config.Config
	signer   *token.Signer
	producer *kgo.Client // nil when no release uses the kafka transport
	http     *http.Client
	logger   *slog.Logger
}

// NewInteractionSender returns a sender; producer may be nil when no
// release uses the kafka transport.
func NewInteractionSender(store *pgstore.Store, cfg *config.Config, signer *token.Signer, producer *kgo.Client, logger *slog.Logger) *InteractionSender {
	return &InteractionSender{store: store, cfg: cfg, signer: signer, producer: producer, logger: logger,
		http: &http.Client{Timeout: 10 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
}

// Sender timing.
const (
	senderPoll  = 100 * time.Millisecond
	senderBatch = 10
	// senderClaimFor outlasts a batch sent one by one at the HTTP timeout
	// (10 × 10 s), so no interaction is sent after its claim passed to
	// another sender.
	senderClaimFor = 2 * time.Minute
	maxSendBackoff = 30 * time.Second
)

// Run sends due interactions until ctx ends.
func (s *InteractionSender) Run(ctx context.Context) error {
	for ctx.Err() == nil {
		n, err := s.SendOnce(ctx)
		if err != nil && ctx.Err() == nil {
			s.logger.Warn("interaction send pass failed", "error", err)
		}
		if n < senderBatch {
			select {
			case <-ctx.Done():
			case <-time.After(senderPoll):
			}
		}
	}
	return nil
}

// SendOnce claims and sends one batch; it returns how many it claimed.
func (s *InteractionSender) SendOnce(ctx context.Context) (int, error) {
	batch, err := s.store.InteractionClaimDispatch(ctx, senderBatch, senderClaimFor)
	if err != nil {
		return 0, err
	}
	for _, d := range batch {
		err := s.send(ctx, d)
		retryIn := min(time.Duration(d.Dispatches+1)*500*time.Millisecond, maxSendBackoff)
		if err != nil {
			s.logger.Warn("interaction send failed; will retry", "interaction_id", d.ID, "transport", d.Transport,
				"retry_in", retryIn, "error", err)
		}
		if rerr := s.store.InteractionDispatched(context.WithoutCancel(ctx), d.ID, d.ClaimToken, err == nil, retryIn); rerr != nil {
			return len(batch), rerr
		}
	}
	return len(batch), nil
}

// send sends one interaction under an "await.send" span, child of the trace
// context stored with the execution; the span's context travels as the
// traceparent header of the webhook request or of the Kafka record.
func (s *InteractionSender) send(ctx context.Context, d pgstore.InteractionDispatch) (err error) {
	ctx, span := tracer.Start(telemetry.ContextWithTraceparent(ctx, d.TraceContext), "await.send",
		trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(attribute.String("execution_id", d.ExecutionID.String()), attribute.Int("attempt", d.Attempt),
			attribute.String("capability", d.Capability), attribute.String("interaction_id", d.ID.String()),
			attribute.String("transport", d.Transport)))
	defer func() {
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, "send failed")
		}
		span.End()
	}()
	cp, ok := s.cfg.Lookup(d.Capability)
	if !ok || cp.Await == nil {
		return fmt.Errorf("capability %q has no await transport configured", d.Capability)
	}
	req := adapter.InteractionRequest{
		InteractionID: d.ID.String(), CorrelationID: d.CorrelationID, ExecutionID: d.ExecutionID.String(),
		Capability: d.Capability, Request: d.Request, ContentType: d.ContentType, Deadline: d.Deadline.UTC(),
		ResumeToken: s.signer.Issue(token.Claims{Kind: token.KindResume, ApplicationID: d.ApplicationID,
			ExecutionID: d.ExecutionID, Subject: d.ID, Attempt: d.Attempt, ExpiresAt: d.Deadline}),
	}
	switch cp.Await.Transport {
	case "webhook":
		req.CompletionURL = strings.TrimRight(s.cfg.Gateway.PublicURL, "/") + adapter.CompletionPath
		body, err := json.Marshal(req)
		if err != nil {
			return err
		}
		hr, err := http.NewRequestWithContext(ctx, http.MethodPost, cp.Await.URL, bytes.NewReader(body))
		if err != nil {
			return err
		}
		hr.Header.Set("content-type", "application/json")
		otel.GetTextMapPropagator().Inject(ctx, propagation.HeaderCarrier(hr.Header))
		if err := adapter.SignWebhook(hr.Header, cp.Await.Secret, d.ID.String(), time.Now(), body); err != nil {
			return err
		}
		resp, err := s.http.Do(hr)
		if err != nil {
			return fmt.Errorf("post: %w", err)
		}
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
		if resp.StatusCode < 200 || resp.StatusCode > 299 {
			return fmt.Errorf("post: status %d", resp.StatusCode)
		}
		return nil
	case "kafka":
		if s.producer == nil {
			return fmt.Errorf("no Kafka producer for the kafka transport")
		}
		body, err := json.Marshal(req)
		if err != nil {
			return err
		}
		rec := &kgo.Record{Topic: cp.Await.RequestTopic, Key: []byte(d.CorrelationID), Value: body}
		otel.GetTextMapPropagator().Inject(ctx, kafka.HeaderCarrier{Record: rec})
		return s.producer.ProduceSync(ctx, rec).FirstErr()
	}
	return fmt.Errorf("transport %q sends nothing", cp.Await.Transport)
}
