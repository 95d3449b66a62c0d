package admin

import (
	"context"
	"encoding/base64"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	adminv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/admin/v1"
)

// Service implements adminv1.AdminServiceServer over the store. Handlers
// return domain errors (*execution.InvalidArgumentError,
// *pgstore.NotFoundError, *pgstore.ConflictError, execution.ErrUnavailable)
// that the gateway's rpcerr interceptor turns into gRPC codes.
type Service struct {
	adminv1.UnimplementedAdminServiceServer
	store  *pgstore.Store
	box    *pgstore.SecretBox
	logger *slog.Logger
}

// NewService returns the admin service. box seals signing secrets (nil:
// plaintext, the development fallback). A nil logger discards logs.
func NewService(store *pgstore.Store, box *pgstore.SecretBox, logger *slog.Logger) *Service {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Service{store: store, box: box, logger: logger}
}

// Register serves the admin API on srv when cfg.Gateway.AdminToken is set
// (the server must run AuthInterceptor(cfg.Gateway.AdminToken)); with no
// token it registers nothing. Its only error is a malformed
// cfg.Router.SecretKey (config.Validate refuses those first).
func Register(srv *grpc.Server, store *pgstore.Store, cfg *config.Config, logger *slog.Logger) error {
	if cfg.Gateway.AdminToken == "" {
		logger.Info("admin API disabled: gateway.admin_token is not set")
		return nil
	}
	box, err := pgstore.NewSecretBox(cfg.Router.SecretKey)
	if err != nil {
		return fmt.Errorf("admin: router.secret_key: %w", err)
	}
	if box == nil {
		logger.Warn("router.secret_key is not set: the admin API stores signing secrets in plaintext (development only)")
	}
	adminv1.RegisterAdminServiceServer(srv, NewService(store, box, logger))
	return nil
}

// Page size bounds of the List RPCs.
const (
	defaultPageSize = 100
	maxPageSize     = 1000
)

func parseID(field, v string) (uuid.UUID, error) {
	id, err := uuid.Parse(v)
	if err != nil || len(v) != 36 {
		return uuid.Nil, &execution.InvalidArgumentError{Field: field, Reason: "want a UUID"}
	}
	return id, nil
}

func pageSize(n int32) (int, error) {
	switch {
	case n == 0:
		return defaultPageSize, nil
	case n < 0 || n > maxPageSize:
		return 0, &execution.InvalidArgumentError{Field: "page_size", Reason: fmt.Sprintf("%d: want 1-%d", n, maxPageSize)}
	}
	return int(n), nil
}

var badToken = &execution.InvalidArgumentError{Field: "page_token", Reason: "not a token from a previous response"}

// SetEventConsumer implements AdminService.SetEventConsumer.
func (s *Service) SetEventConsumer(ctx context.Context, req *adminv1.SetEventConsumerRequest) (*adminv1.SetEventConsumerResponse, error) {
	app, err := parseID("application_id", req.GetApplicationId())
	if err != nil {
		return nil, err
	}
	p := pgstore.ConsumerSetParams{ApplicationID: app, ExpectedVersion: req.GetExpectedVersion(), Box: s.box}
	switch t := req.GetTarget().(type) {
	case *adminv1.SetEventConsumerRequest_Webhook:
		p.Kind, p.Target = pgstore.ConsumerWebhook, t.Webhook.GetUrl()
	case *adminv1.SetEventConsumerRequest_Kafka:
		p.Kind, p.Target = pgstore.ConsumerKafka, t.Kafka.GetTopic()
	case *adminv1.SetEventConsumerRequest_Grpc:
		p.Kind, p.Target = pgstore.ConsumerGRPC, t.Grpc.GetTarget()
	default:
		return nil, &execution.InvalidArgumentError{Field: "target", Reason: "one of webhook, kafka or grpc is required"}
	}
	if len(req.GetSecrets()) > 0 {
		p.Secrets = req.GetSecrets()
	}
	c, err := s.store.ConsumerSet(ctx, p)
	if err != nil {
		return nil, err
	}
	s.logger.InfoContext(ctx, "event consumer set", "application_id", app, "kind", c.Kind, "version", c.Version,
		"secrets_replaced", p.Secrets != nil)
	return &adminv1.SetEventConsumerResponse{Consumer: consumerProto(c)}, nil
}

// GetEventConsumer implements AdminService.GetEventConsumer.
func (s *Service) GetEventConsumer(ctx context.Context, req *adminv1.GetEventConsumerRequest) (*adminv1.GetEventConsumerResponse, error) {
	app, err := parseID("application_id", req.GetApplicationId())
	if err != nil {
		return nil, err
	}
	c, err := s.store.ConsumerGet(ctx, app)
	if err != nil {
		return nil, err
	}
	return &adminv1.GetEventConsumerResponse{Consumer: consumerProto(c)}, nil
}

// ListEventConsumers implements AdminService.ListEventConsumers. The page
// token is the last application id of the previous page.
func (s *Service) ListEventConsumers(ctx context.Context, req *adminv1.ListEventConsumersRequest) (*adminv1.ListEventConsumersResponse, error) {
	n, err := pageSize(req.GetPageSize())
	if err != nil {
		return nil, err
	}
	var after uuid.UUID
	if t := req.GetPageToken(); t != "" {
		raw, err := base64.RawURLEncoding.DecodeString(t)
		if err != nil {
			return nil, badToken
		}
		if after, err = uuid.FromBytes(raw); err != nil {
			return nil, badToken
		}
	}
	list, err := s.store.ConsumerList(ctx, pgstore.ConsumerListParams{After: after, Limit: n})
	if err != nil {
		return nil, err
	}
	resp := &adminv1.ListEventConsumersResponse{}
	for _, c := range list {
		resp.Consumers = append(resp.Consumers, consumerProto(c))
	}
	if len(list) == n {
		last := list[len(list)-1].ApplicationID
		resp.NextPageToken = base64.RawURLEncoding.EncodeToString(last[:])
	}
	return resp, nil
}

// RotateSigningSecret implements AdminService.RotateSigningSecret.
func (s *Service) RotateSigningSecret(ctx context.Context, req *adminv1.RotateSigningSecretRequest) (*adminv1.RotateSigningSecretResponse, error) {
	app, err := parseID("application_id", req.GetApplicationId())
	if err != nil {
		return nil, err
	}
	secret, generated := req.GetSecret(), ""
	if secret == "" {
		secret = pgstore.GenerateSecret()
		generated = secret
	}
	p := pgstore.ConsumerAddSecretParams{ApplicationID: app, Secret: secret, Box: s.box}
	if d := req.GetRetirePreviousAfter(); d != nil {
		if err := d.CheckValid(); err != nil {
			return nil, &execution.InvalidArgumentError{Field: "retire_previous_after", Reason: "not a valid duration"}
		}
		v := d.AsDuration()
		p.RetirePreviousAfter = &v
	}
	c, id, err := s.store.ConsumerAddSecret(ctx, p)
	if err != nil {
		return nil, err
	}
	s.logger.InfoContext(ctx, "signing secret added", "application_id", app, "secret_id", id,
		"fingerprint", pgstore.SecretFingerprint(secret), "generated", generated != "",
		"retire_previous", p.RetirePreviousAfter != nil)
	return &adminv1.RotateSigningSecretResponse{Consumer: consumerProto(c), Secret: generated, SecretId: id.String()}, nil
}

// RemoveSigningSecret implements AdminService.RemoveSigningSecret.
func (s *Service) RemoveSigningSecret(ctx context.Context, req *adminv1.RemoveSigningSecretRequest) (*adminv1.RemoveSigningSecretResponse, error) {
	app, err := parseID("application_id", req.GetApplicationId())
	if err != nil {
		return nil, err
	}
	id, err := parseID("secret_id", req.GetSecretId())
	if err != nil {
		return nil, err
	}
	c, err := s.store.ConsumerRemoveSecret(ctx, app, id)
	if err != nil {
		return nil, err
	}
	s.logger.InfoContext(ctx, "signing secret removed", "application_id", app, "secret_id", id)
	return &adminv1.RemoveSigningSecretResponse{Consumer: consumerProto(c)}, nil
}

// EnableEventConsumer implements AdminService.EnableEventConsumer.
func (s *Service) EnableEventConsumer(ctx context.Context, req *adminv1.EnableEventConsumerRequest) (*adminv1.EnableEventConsumerResponse, error) {
	app, err := parseID("application_id", req.GetApplicationId())
	if err != nil {
		return nil, err
	}
	c, err := s.store.ConsumerEnable(ctx, app)
	if err != nil {
		return nil, err
	}
	s.logger.InfoContext(ctx, "event consumer enabled", "application_id", app, "version", c.Version)
	return &adminv1.EnableEventConsumerResponse{Consumer: consumerProto(c)}, nil
}

// ListEvents implements AdminService.ListEvents. The page token encodes the
// creation time and id of the last event of the previous page.
func (s *Service) ListEvents(ctx context.Context, req *adminv1.ListEventsRequest) (*adminv1.ListEventsResponse, error) {
	n, err := pageSize(req.GetPageSize())
	if err != nil {
		return nil, err
	}
	p := pgstore.EventListParams{Limit: n}
	if v := req.GetApplicationId(); v != "" {
		if p.ApplicationID, err = parseID("application_id", v); err != nil {
			return nil, err
		}
	}
	switch req.GetStatus() {
	case adminv1.EventStatus_EVENT_STATUS_UNSPECIFIED:
	case adminv1.EventStatus_EVENT_STATUS_PENDING:
		p.Status = pgstore.EventPending
	case adminv1.EventStatus_EVENT_STATUS_DELIVERED:
		p.Status = pgstore.EventDelivered
	case adminv1.EventStatus_EVENT_STATUS_DEAD:
		p.Status = pgstore.EventDead
	default:
		return nil, &execution.InvalidArgumentError{Field: "status", Reason: "unknown status"}
	}
	if ts := req.GetSince(); ts != nil {
		if err := ts.CheckValid(); err != nil {
			return nil, &execution.InvalidArgumentError{Field: "since", Reason: "not a valid timestamp"}
		}
		p.Since = ts.AsTime()
	}
	if t := req.GetPageToken(); t != "" {
		if p.BeforeCreatedAt, p.BeforeID, err = decodeEventToken(t); err != nil {
			return nil, err
		}
	}
	list, err := s.store.EventList(ctx, p)
	if err != nil {
		return nil, err
	}
	resp := &adminv1.ListEventsResponse{}
	for _, e := range list {
		resp.Events = append(resp.Events, eventProto(e))
	}
	if len(list) == n {
		last := list[len(list)-1]
		resp.NextPageToken = encodeEventToken(last.CreatedAt, last.ID)
	}
	return resp, nil
}

func encodeEventToken(t time.Time, id uuid.UUID) string {
	return base64.RawURLEncoding.EncodeToString([]byte(strconv.FormatInt(t.UnixMicro(), 10) + "/" + id.String()))
}

func decodeEventToken(tok string) (time.Time, uuid.UUID, error) {
	raw, err := base64.RawURLEncoding.DecodeString(tok)
	if err != nil {
		return time.Time{}, uuid.Nil, badToken
	}
	us, idStr, ok := strings.Cut(string(raw), "/")
	if !ok {
		return time.Time{}, uuid.Nil, badToken
	}
	n, err := strconv.ParseInt(us, 10, 64)
	if err != nil {
		return time.Time{}, uuid.Nil, badToken
	}
	id, err := uuid.Parse(idStr)
	if err != nil {
		return time.Time{}, uuid.Nil, badToken
	}
	return time.UnixMicro(n), id, nil
}

// GetEvent implements AdminService.GetEvent.
func (s *Service) GetEvent(ctx context.Context, req *adminv1.GetEventRequest) (*adminv1.GetEventResponse, error) {
	id, err := parseID("event_id", req.GetEventId())
	if err != nil {
		return nil, err
	}
	e, atts, err := s.store.EventGet(ctx, id, req.GetIncludePayload())
	if err != nil {
		return nil, err
	}
	resp := &adminv1.GetEventResponse{Event: eventProto(e)}
	for _, a := range atts {
		resp.Attempts = append(resp.Attempts, &adminv1.DeliveryAttempt{
			Attempt: int32(a.Attempt), Replay: int32(a.Replay), StatusCode: int32(a.StatusCode), Error: a.Error,
			ConsumerKind: string(a.ConsumerKind), StartedAt: timestamppb.New(a.StartedAt), EndedAt: timestamppb.New(a.EndedAt),
		})
	}
	return resp, nil
}

// ReplayEvent implements AdminService.ReplayEvent.
func (s *Service) ReplayEvent(ctx context.Context, req *adminv1.ReplayEventRequest) (*adminv1.ReplayEventResponse, error) {
	id, err := parseID("event_id", req.GetEventId())
	if err != nil {
		return nil, err
	}
	e, err := s.store.EventReplay(ctx, id, req.GetForce())
	if err != nil {
		return nil, err
	}
	s.logger.InfoContext(ctx, "event replayed", "event_id", id, "application_id", e.ApplicationID,
		"force", req.GetForce(), "replays", e.Replays)
	return &adminv1.ReplayEventResponse{Event: eventProto(e)}, nil
}

// ReplayDeadEvents implements AdminService.ReplayDeadEvents.
func (s *Service) ReplayDeadEvents(ctx context.Context, req *adminv1.ReplayDeadEventsRequest) (*adminv1.ReplayDeadEventsResponse, error) {
	app, err := parseID("application_id", req.GetApplicationId())
	if err != nil {
		return nil, err
	}
	ts := req.GetSince()
	if ts == nil {
		return nil, &execution.InvalidArgumentError{Field: "since", Reason: "required"}
	}
	if err := ts.CheckValid(); err != nil {
		return nil, &execution.InvalidArgumentError{Field: "since", Reason: "not a valid timestamp"}
	}
	n, err := s.store.EventReplayDead(ctx, app, ts.AsTime())
	if err != nil {
		return nil, err
	}
	s.logger.InfoContext(ctx, "dead events replayed", "application_id", app, "since", ts.AsTime(), "replayed", n)
	return &adminv1.ReplayDeadEventsResponse{Replayed: n}, nil
}

func tsOrNil(t time.Time) *timestamppb.Timestamp {
	if t.IsZero() {
		return nil
	}
	return timestamppb.New(t)
}

func consumerProto(c pgstore.Consumer) *adminv1.EventConsumer {
	out := &adminv1.EventConsumer{
		ApplicationId:  c.ApplicationID.String(),
		DisabledAt:     tsOrNil(c.DisabledAt),
		DisabledReason: c.DisabledReason,
		Version:        c.Version,
		CreatedAt:      tsOrNil(c.CreatedAt),
		UpdatedAt:      tsOrNil(c.UpdatedAt),
	}
	switch c.Kind {
	case pgstore.ConsumerWebhook:
		out.Target = &adminv1.EventConsumer_Webhook{Webhook: &adminv1.WebhookTarget{Url: c.Target}}
	case pgstore.ConsumerKafka:
		out.Target = &adminv1.EventConsumer_Kafka{Kafka: &adminv1.KafkaTarget{Topic: c.Target}}
	case pgstore.ConsumerGRPC:
		out.Target = &adminv1.EventConsumer_Grpc{Grpc: &adminv1.GrpcTarget{Target: c.Target}}
	}
	for _, sec := range c.Secrets {
		out.Secrets = append(out.Secrets, &adminv1.SigningSecret{
			Id: sec.ID.String(), Fingerprint: sec.Fingerprint, CreatedAt: tsOrNil(sec.CreatedAt),
			ExpiresAt: tsOrNil(sec.ExpiresAt), Active: sec.Active,
		})
	}
	return out
}

func eventStatusProto(s string) adminv1.EventStatus {
	switch s {
	case pgstore.EventPending:
		return adminv1.EventStatus_EVENT_STATUS_PENDING
	case pgstore.EventDelivered:
		return adminv1.EventStatus_EVENT_STATUS_DELIVERED
	case pgstore.EventDead:
		return adminv1.EventStatus_EVENT_STATUS_DEAD
	}
	return adminv1.EventStatus_EVENT_STATUS_UNSPECIFIED
}

func eventProto(e pgstore.Event) *adminv1.Event {
	out := &adminv1.Event{
		EventId:          e.ID.String(),
		ApplicationId:    e.ApplicationID.String(),
		ExecutionId:      e.ExecutionID.String(),
		Type:             e.Type,
		Status:           eventStatusProto(e.Status),
		DeliveryAttempts: int32(e.Attempts),
		RoundAttempts:    int32(e.RoundAttempts),
		Replays:          int32(e.Replays),
		LastStatusCode:   int32(e.LastStatusCode),
		LastError:        e.LastError,
		CreatedAt:        tsOrNil(e.CreatedAt),
		DeliveredAt:      tsOrNil(e.DeliveredAt),
		LastReplayedAt:   tsOrNil(e.LastReplayedAt),
		Version:          e.Version,
		Payload:          e.Payload,
	}
	if e.Status == pgstore.EventPending {
		out.NextAttemptAt = tsOrNil(e.NextAttemptAt)
	}
	return out
}
