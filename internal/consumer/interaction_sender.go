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
	"sync"
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
		retryIn := min(time.Duration(d.Dispatches+1)*500*time.Millisecond, maxSendBackoff) // d.Dispatches: tries before this one
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
	if !ok || cp.AwaitStep() == nil {
		return fmt.Errorf("capability %q has no await transport configured", d.Capability)
	}
	a := cp.AwaitStep()
	switch a.Transport {
	case "webhook":
		return s.post(ctx, a, s.request(d, a))
	case "kafka":
		if s.producer == nil {
			return fmt.Errorf("no Kafka producer for the kafka transport")
		}
		rec, err := s.record(ctx, d, a)
		if err != nil {
			return err
		}
		return s.producer.ProduceSync(ctx, rec).FirstErr()
	}
	return fmt.Errorf("transport %q sends nothing", a.Transport)
}

// request is the InteractionRequest of d, with a resume token bound to the
// application, execution, the unit's attempt, the interaction and its
// deadline.
func (s *InteractionSender) request(d pgstore.InteractionDispatch, a *config.AwaitStep) adapter.InteractionRequest {
	req := adapter.InteractionRequest{
		InteractionID: d.ID.String(), CorrelationID: d.CorrelationID, ExecutionID: d.ExecutionID.String(),
		Capability: d.Capability, Request: d.Request, ContentType: d.ContentType, Deadline: d.Deadline.UTC(),
		ResumeToken: s.signer.Issue(token.Claims{Kind: token.KindResume, ApplicationID: d.ApplicationID,
			ExecutionID: d.ExecutionID, Subject: d.ID, Attempt: d.Attempt, ExpiresAt: d.Deadline}),
	}
	if a.Transport == "webhook" {
		req.CompletionURL = strings.TrimRight(s.cfg.Gateway.PublicURL, "/") + adapter.CompletionPath
	}
	return req
}

// post sends req as a signed webhook POST; a non-2xx answer is an error.
func (s *InteractionSender) post(ctx context.Context, a *config.AwaitStep, req adapter.InteractionRequest) error {
	body, err := json.Marshal(req)
	if err != nil {
		return err
	}
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, a.URL, bytes.NewReader(body))
	if err != nil {
		return err
	}
	hr.Header.Set("content-type", "application/json")
	otel.GetTextMapPropagator().Inject(ctx, propagation.HeaderCarrier(hr.Header))
	if err := adapter.SignWebhook(hr.Header, a.Secret, req.InteractionID, time.Now(), body); err != nil {
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
}

// record is the kafka transport's request record of d.
func (s *InteractionSender) record(ctx context.Context, d pgstore.InteractionDispatch, a *config.AwaitStep) (*kgo.Record, error) {
	body, err := json.Marshal(s.request(d, a))
	if err != nil {
		return nil, err
	}
	rec := &kgo.Record{Topic: a.RequestTopic, Key: []byte(d.CorrelationID), Value: body}
	otel.GetTextMapPropagator().Inject(ctx, kafka.HeaderCarrier{Record: rec})
	return rec, nil
}

// sendParallelism bounds the webhook POSTs of one SendBatch.
const sendParallelism = 16

// SendBatch sends the interactions of a live session at once: one
// produce per item, all in flight together (kafka), or up to 16 POSTs at a
// time (webhook). It returns one error per interaction, nil for a send.
// The interaction-api transport sends nothing and returns nils.
func (s *InteractionSender) SendBatch(ctx context.Context, a *config.AwaitStep, ds []pgstore.InteractionDispatch) []error {
	errs := make([]error, len(ds))
	var wg sync.WaitGroup
	switch a.Transport {
	case "kafka":
		if s.producer == nil {
			for k := range errs {
				errs[k] = fmt.Errorf("no Kafka producer for the kafka transport")
			}
			return errs
		}
		for k, d := range ds {
			rec, err := s.record(ctx, d, a)
			if err != nil {
				errs[k] = err
				continue
			}
			wg.Add(1)
			s.producer.Produce(ctx, rec, func(_ *kgo.Record, err error) {
				errs[k] = err
				wg.Done()
			})
		}
	case "webhook":
		sem := make(chan struct{}, sendParallelism)
		for k, d := range ds {
			sem <- struct{}{}
			wg.Add(1)
			go func() {
				defer func() { <-sem; wg.Done() }()
				errs[k] = s.post(ctx, a, s.request(d, a))
			}()
		}
	}
	wg.Wait()
	return errs
}
