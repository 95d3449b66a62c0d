package gateway

import (
	"context"
	"encoding/base64"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/google/uuid"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	interactionv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/interaction/v1"
)

// InteractionService implements the interaction-api transport (SYSTEM §6):
// pending interactions are listed, and completed over gRPC, by adapters
// authenticated with their key.
type InteractionService struct {
	interactionv1.UnimplementedInteractionServiceServer
	store  *pgstore.Store
	cfg    *config.Config
	auth   *adapterAuth
	logger *slog.Logger
}

// NewInteractionService returns the service.
func NewInteractionService(store *pgstore.Store, cfg *config.Config, logger *slog.Logger) (*InteractionService, error) {
	auth, err := newAdapterAuth(cfg)
	if err != nil {
		return nil, err
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &InteractionService{store: store, cfg: cfg, auth: auth, logger: logger}, nil
}

// Page size bounds of ListPendingInteractions.
const (
	defaultPageSize = 100
	maxPageSize     = 500
)

// ListPendingInteractions lists non-terminal interactions of a capability
// the caller serves, by deadline.
func (s *InteractionService) ListPendingInteractions(ctx context.Context, req *interactionv1.ListPendingInteractionsRequest) (*interactionv1.ListPendingInteractionsResponse, error) {
	caps, err := s.auth.capabilities(ctx)
	if err != nil {
		return nil, err
	}
	if err := checkText("capability", req.GetCapability(), true, maxCapabilityBytes); err != nil {
		return nil, err
	}
	if !caps[req.GetCapability()] {
		return nil, fmt.Errorf("%w: this adapter does not serve %q", execution.ErrPermissionDenied, req.GetCapability())
	}
	size := int(req.GetPageSize())
	switch {
	case size == 0:
		size = defaultPageSize
	case size < 0 || size > maxPageSize:
		return nil, &execution.InvalidArgumentError{Field: "page_size", Reason: fmt.Sprintf("%d: want 1..%d", size, maxPageSize)}
	}
	afterDeadline, afterID, err := decodePageToken(req.GetPageToken())
	if err != nil {
		return nil, err
	}
	list, err := s.store.InteractionListPending(ctx, req.GetCapability(), afterDeadline, afterID, size+1)
	if err != nil {
		return nil, err
	}
	resp := &interactionv1.ListPendingInteractionsResponse{}
	if len(list) > size {
		list = list[:size]
		last := list[size-1]
		resp.NextPageToken = encodePageToken(last.Deadline, last.ID)
	}
	for _, i := range list {
		resp.Interactions = append(resp.Interactions, &interactionv1.Interaction{
			InteractionId: i.ID.String(), CorrelationId: i.CorrelationID, ExecutionId: i.ExecutionID.String(),
			Capability: i.Capability, Status: interactionStatus(i.Status), Request: i.Request, ContentType: i.ContentType,
			Deadline: timestamppb.New(i.Deadline), CreatedAt: timestamppb.New(i.CreatedAt), ExternalReference: i.ExternalReference,
		})
	}
	return resp, nil
}

// CompleteInteraction admits one completion by interaction id.
func (s *InteractionService) CompleteInteraction(ctx context.Context, req *interactionv1.CompleteInteractionRequest) (*interactionv1.CompleteInteractionResponse, error) {
	caps, err := s.auth.capabilities(ctx)
	if err != nil {
		return nil, err
	}
	id, err := uuid.Parse(req.GetInteractionId())
	if err != nil {
		return nil, &execution.InvalidArgumentError{Field: "interaction_id", Reason: "not a UUID"}
	}
	out, err := outcomeOf(req.GetResult(), req.GetFailure())
	if err != nil {
		return nil, err
	}
	res, err := s.store.CompleteInteraction(ctx, pgstore.CompleteParams{InteractionID: id, Capabilities: caps,
		Outcome: out, PolicyFor: policyFor(s.cfg)})
	if err != nil {
		s.logger.Info("completion refused", "interaction_id", id, "error", err)
		return nil, err
	}
	return &interactionv1.CompleteInteractionResponse{Status: interactionStatus(res.InteractionStatus), Duplicate: res.Duplicate}, nil
}

func interactionStatus(s string) interactionv1.InteractionStatus {
	return interactionv1.InteractionStatus(interactionv1.InteractionStatus_value["INTERACTION_STATUS_"+s])
}

func encodePageToken(deadline time.Time, id uuid.UUID) string {
	return base64.RawURLEncoding.EncodeToString([]byte(deadline.UTC().Format(time.RFC3339Nano) + "|" + id.String()))
}

func decodePageToken(t string) (time.Time, uuid.UUID, error) {
	if t == "" {
		return time.Time{}, uuid.Nil, nil
	}
	bad := &execution.InvalidArgumentError{Field: "page_token", Reason: "not a token from a previous page"}
	b, err := base64.RawURLEncoding.DecodeString(t)
	if err != nil {
		return time.Time{}, uuid.Nil, bad
	}
	ts, idText, ok := strings.Cut(string(b), "|")
	if !ok {
		return time.Time{}, uuid.Nil, bad
	}
	d, err := time.Parse(time.RFC3339Nano, ts)
	if err != nil {
		return time.Time{}, uuid.Nil, bad
	}
	id, err := uuid.Parse(idText)
	if err != nil {
		return time.Time{}, uuid.Nil, bad
	}
	return d, id, nil
}
