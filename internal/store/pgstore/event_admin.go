package pgstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/capstan-dev/capstan/internal/execution"
)

// Event is a completion event as operators see it.
type Event struct {
	ID            uuid.UUID
	ApplicationID uuid.UUID
	ExecutionID   uuid.UUID
	Type          string
	Status        string // EventPending, EventDelivered or EventDead
	// Attempts counts every delivery attempt; RoundAttempts those since the
	// last replay; Replays the replays.
	Attempts       int
	RoundAttempts  int
	Replays        int
	NextAttemptAt  time.Time
	LastStatusCode int // 0: no HTTP answer
	LastError      string
	CreatedAt      time.Time
	DeliveredAt    time.Time // zero unless DELIVERED
	LastReplayedAt time.Time // zero when never replayed
	Version        int64
	// Payload is set only when asked for (EventGet with payload).
	Payload []byte
}

// DeliveryAttempt is one recorded delivery attempt.
type DeliveryAttempt struct {
	Attempt    int // from 1 over the event's history
	Replay     int // the event's replay count when it was made
	StatusCode int // 0: no HTTP answer
	Error      string
	// ConsumerKind and ConsumerVersion: the consumer the attempt used, as
	// claimed ("" and 0 when none was registered).
	ConsumerKind    ConsumerKind
	ConsumerVersion int64
	StartedAt       time.Time
	EndedAt         time.Time
}

const eventColumns = `id, application_id, execution_id, type, status, delivery_attempts, round_attempts, replays,
       next_attempt_at, coalesce(last_status_code, 0), coalesce(last_error, ''), created_at, delivered_at,
       last_replayed_at, version`

func scanEvent(row pgx.Row, extra ...any) (Event, error) {
	var e Event
	var delivered, replayed *time.Time
	dest := append([]any{&e.ID, &e.ApplicationID, &e.ExecutionID, &e.Type, &e.Status, &e.Attempts, &e.RoundAttempts,
		&e.Replays, &e.NextAttemptAt, &e.LastStatusCode, &e.LastError, &e.CreatedAt, &delivered, &replayed, &e.Version},
		extra...)
	if err := row.Scan(dest...); err != nil {
		return Event{}, err
	}
	if delivered != nil {
		e.DeliveredAt = *delivered
	}
	if replayed != nil {
		e.LastReplayedAt = *replayed
	}
	return e, nil
}

// EventListParams filters and pages completion events, newest first. Zero
// values mean "no filter".
type EventListParams struct {
	ApplicationID uuid.UUID
	Status        string // EventPending, EventDelivered, EventDead or ""
	Since         time.Time
	// BeforeCreatedAt and BeforeID are the last event of the previous page
	// (keyset paging on created_at, id); zero for the first page.
	BeforeCreatedAt time.Time
	BeforeID        uuid.UUID
	// Limit is the page size, 1..1000 (other values mean 100).
	Limit int
}

// EventList returns completion events matching p, newest first, without
// payloads. Errors: *execution.InvalidArgumentError for an unknown status.
func (s *Store) EventList(ctx context.Context, p EventListParams) ([]Event, error) {
	switch p.Status {
	case "", EventPending, EventDelivered, EventDead:
	default:
		return nil, &execution.InvalidArgumentError{Field: "status", Reason: fmt.Sprintf("%q: want PENDING, DELIVERED or DEAD", p.Status)}
	}
	if p.Limit <= 0 || p.Limit > 1000 {
		p.Limit = 100
	}
	var app *uuid.UUID
	if p.ApplicationID != uuid.Nil {
		app = &p.ApplicationID
	}
	var since, before *time.Time
	if !p.Since.IsZero() {
		since = &p.Since
	}
	if !p.BeforeCreatedAt.IsZero() {
		before = &p.BeforeCreatedAt
	}
	rows, err := s.pool.Query(ctx, `SELECT `+eventColumns+` FROM completion_events
 WHERE ($1::uuid IS NULL OR application_id = $1)
   AND ($2 = '' OR status = $2)
   AND ($3::timestamptz IS NULL OR created_at >= $3)
   AND ($4::timestamptz IS NULL OR (created_at, id) < ($4, $5))
 ORDER BY created_at DESC, id DESC
 LIMIT $6`, app, p.Status, since, before, p.BeforeID, p.Limit)
	if err != nil {
		return nil, translate(fmt.Errorf("list events: %w", err))
	}
	list, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Event, error) { return scanEvent(r) })
	if err != nil {
		return nil, translate(fmt.Errorf("list events: %w", err))
	}
	return list, nil
}

// EventGet returns one completion event (with its payload when
// withPayload) and its delivery attempts, oldest first. Errors:
// *NotFoundError.
func (s *Store) EventGet(ctx context.Context, id uuid.UUID, withPayload bool) (Event, []DeliveryAttempt, error) {
	var payload []byte
	e, err := scanEvent(s.pool.QueryRow(ctx, `SELECT `+eventColumns+`, CASE WHEN $2 THEN payload END
  FROM completion_events WHERE id = $1`, id, withPayload), &payload)
	if errors.Is(err, pgx.ErrNoRows) {
		return Event{}, nil, &NotFoundError{What: "event", ID: id.String()}
	}
	if err != nil {
		return Event{}, nil, translate(fmt.Errorf("get event: %w", err))
	}
	e.Payload = payload
	rows, err := s.pool.Query(ctx, `
SELECT attempt, replay, coalesce(status_code, 0), coalesce(error, ''), consumer_kind, coalesce(consumer_version, 0),
       started_at, ended_at
  FROM delivery_attempts WHERE event_id = $1 ORDER BY attempt`, id)
	if err != nil {
		return Event{}, nil, translate(fmt.Errorf("get delivery attempts: %w", err))
	}
	atts, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (DeliveryAttempt, error) {
		var a DeliveryAttempt
		err := r.Scan(&a.Attempt, &a.Replay, &a.StatusCode, &a.Error, &a.ConsumerKind, &a.ConsumerVersion,
			&a.StartedAt, &a.EndedAt)
		return a, err
	})
	if err != nil {
		return Event{}, nil, translate(fmt.Errorf("get delivery attempts: %w", err))
	}
	return e, atts, nil
}

// replaySet is the change a replay makes: back to PENDING, due now, the
// schedule started over (round_attempts 0), history kept.
const replaySet = `status = 'PENDING', round_attempts = 0, replays = replays + 1, next_attempt_at = now(),
       claim_token = NULL, claimed_until = NULL, delivered_at = NULL, last_replayed_at = now(),
       version = version + 1`

// EventReplay puts event id back to PENDING with the same id, due at once,
// its delivery schedule started over and its attempt history kept. Guard:
// status DEAD, or DELIVERED when force; zero rows means the event is
// missing (*NotFoundError), DELIVERED without force or PENDING
// (*ConflictError naming the status), and nothing changes.
func (s *Store) EventReplay(ctx context.Context, id uuid.UUID, force bool) (Event, error) {
	e, err := scanEvent(s.pool.QueryRow(ctx, `
UPDATE completion_events SET `+replaySet+`
 WHERE id = $1 AND (status = 'DEAD' OR (status = 'DELIVERED' AND $2))
RETURNING `+eventColumns, id, force))
	if err == nil {
		return e, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return Event{}, translate(fmt.Errorf("replay event %s: %w", id, err))
	}
	var status string
	err = s.pool.QueryRow(ctx, `SELECT status FROM completion_events WHERE id = $1`, id).Scan(&status)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return Event{}, &NotFoundError{What: "event", ID: id.String()}
	case err != nil:
		return Event{}, translate(fmt.Errorf("replay event %s: %w", id, err))
	case status == EventDelivered:
		return Event{}, &ConflictError{Reason: fmt.Sprintf("event %s is DELIVERED: replay it with force to deliver it again", id)}
	default:
		return Event{}, &ConflictError{Reason: fmt.Sprintf("event %s is %s: it is already waiting for delivery", id, status)}
	}
}

// EventReplayDead replays, as EventReplay does, every DEAD event of
// application app created at or after since, in one statement, and returns
// how many it replayed. Guard: status DEAD (events that changed meanwhile
// are not touched).
func (s *Store) EventReplayDead(ctx context.Context, app uuid.UUID, since time.Time) (int64, error) {
	tag, err := s.pool.Exec(ctx, `
UPDATE completion_events SET `+replaySet+`
 WHERE application_id = $1 AND status = 'DEAD' AND created_at >= $2`, app, since)
	if err != nil {
		return 0, translate(fmt.Errorf("replay dead events of %s: %w", app, err))
	}
	return tag.RowsAffected(), nil
}

// PendingEvents summarises one application's PENDING events.
type PendingEvents struct {
	ApplicationID uuid.UUID
	Count         int64
	// OldestAge is the age of the oldest PENDING event (since settlement,
	// database clock).
	OldestAge time.Duration
}

// EventPendingByApplication returns, per application with PENDING events,
// how many there are and the age of the oldest, ordered by application id.
func (s *Store) EventPendingByApplication(ctx context.Context) ([]PendingEvents, error) {
	rows, err := s.pool.Query(ctx, `
SELECT application_id, count(*), now() - min(created_at)
  FROM completion_events WHERE status = 'PENDING' GROUP BY application_id ORDER BY application_id`)
	if err != nil {
		return nil, translate(fmt.Errorf("pending events: %w", err))
	}
	list, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (PendingEvents, error) {
		var p PendingEvents
		return p, r.Scan(&p.ApplicationID, &p.Count, &p.OldestAge)
	})
	if err != nil {
		return nil, translate(fmt.Errorf("pending events: %w", err))
	}
	return list, nil
}
