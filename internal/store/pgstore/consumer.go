package pgstore

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/capstan-dev/capstan/internal/execution"
)

// ConsumerKind says how an application receives its completion events.
type ConsumerKind string

// Consumer kinds.
const (
	// ConsumerWebhook: an HTTP POST signed per Standard Webhooks; the
	// target is the URL.
	ConsumerWebhook ConsumerKind = "webhook"
	// ConsumerKafka: a record on a topic the application reads; the target
	// is the topic.
	ConsumerKafka ConsumerKind = "kafka"
	// ConsumerGRPC: a call of capstan.event.v1.EventConsumerService/Deliver;
	// the target is host:port.
	ConsumerGRPC ConsumerKind = "grpc"
)

// Bounds on consumer registrations.
const (
	// MaxWebhookURLBytes bounds a webhook URL.
	MaxWebhookURLBytes = 2048
	// MaxGRPCTargetBytes bounds a gRPC target.
	MaxGRPCTargetBytes = 512
	// MaxKafkaTopicBytes bounds a Kafka topic name (Kafka's own limit).
	MaxKafkaTopicBytes = 249
	// MaxConsumerSecrets bounds the signing secrets of one consumer,
	// expired ones included until the next rotation removes them.
	MaxConsumerSecrets = 10
	// MaxRetireAfter bounds the grace period of a rotation (30 days).
	MaxRetireAfter = 30 * 24 * time.Hour
)

// NotFoundError says which object does not exist. It matches
// execution.ErrNotFound with errors.Is (gRPC NOT_FOUND).
type NotFoundError struct {
	What string // "application", "event consumer", "event", "signing secret"
	ID   string
}

// Error returns, for example, "event 1b4e… not found".
func (e *NotFoundError) Error() string { return e.What + " " + e.ID + " not found" }

// Is reports whether target is execution.ErrNotFound.
func (e *NotFoundError) Is(target error) bool { return target == execution.ErrNotFound }

// ConflictError says why a guarded change was refused because of the
// object's current state. It matches execution.ErrConflict with errors.Is
// (gRPC FAILED_PRECONDITION).
type ConflictError struct {
	Reason string
}

// Error returns the reason.
func (e *ConflictError) Error() string { return e.Reason }

// Is reports whether target is execution.ErrConflict.
func (e *ConflictError) Is(target error) bool { return target == execution.ErrConflict }

// Consumer is the event consumer of one application. Secret values are
// never read back: Secrets describes them.
type Consumer struct {
	ApplicationID uuid.UUID
	Kind          ConsumerKind
	// Target is the webhook URL, Kafka topic or gRPC host:port.
	Target  string
	Secrets []ConsumerSecret
	// DisabledAt is set (non-zero) when the consumer was disabled because
	// its webhook answered 410 Gone; DisabledReason says so.
	DisabledAt     time.Time
	DisabledReason string
	Version        int64
	CreatedAt      time.Time
	UpdatedAt      time.Time
}

// ConsumerSecret describes one signing secret without its value.
type ConsumerSecret struct {
	ID          uuid.UUID
	Fingerprint string // SecretFingerprint of the secret
	CreatedAt   time.Time
	ExpiresAt   time.Time // zero: signs until removed
	Active      bool      // signs deliveries now (database clock)
}

// querier is what both a pool and a transaction offer.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// ValidateConsumerTarget checks a consumer's target for its kind: a webhook
// URL (http or https, a host, no user info, at most MaxWebhookURLBytes, no
// spaces or control characters), a Kafka topic (1..249 of [a-zA-Z0-9._-],
// not "." or "..") or a gRPC target (host:port with port 1..65535, at most
// MaxGRPCTargetBytes). Errors are *execution.InvalidArgumentError naming
// field; an unknown kind names "kind".
func ValidateConsumerTarget(field string, kind ConsumerKind, target string) error {
	bad := func(reason string) error { return &execution.InvalidArgumentError{Field: field, Reason: reason} }
	if target == "" {
		return bad("required")
	}
	if !utf8.ValidString(target) || strings.IndexFunc(target, func(r rune) bool {
		return unicode.IsControl(r) || unicode.IsSpace(r)
	}) >= 0 {
		return bad("must be valid UTF-8 without spaces or control characters")
	}
	switch kind {
	case ConsumerWebhook:
		if len(target) > MaxWebhookURLBytes {
			return bad(fmt.Sprintf("%d bytes, at most %d", len(target), MaxWebhookURLBytes))
		}
		u, err := url.Parse(target)
		if err != nil {
			return bad("not a URL")
		}
		if s := strings.ToLower(u.Scheme); s != "http" && s != "https" {
			return bad("scheme must be http or https")
		}
		if u.User != nil {
			return bad("must not carry user info (user:password@)")
		}
		if u.Hostname() == "" {
			return bad("host required")
		}
		if p := u.Port(); p != "" {
			if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
				return bad("port must be 1-65535")
			}
		}
	case ConsumerKafka:
		if len(target) > MaxKafkaTopicBytes || target == "." || target == ".." {
			return bad("not a valid Kafka topic name")
		}
		for _, r := range target {
			if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
				return bad("Kafka topic names use only [a-zA-Z0-9._-]")
			}
		}
	case ConsumerGRPC:
		if len(target) > MaxGRPCTargetBytes {
			return bad(fmt.Sprintf("%d bytes, at most %d", len(target), MaxGRPCTargetBytes))
		}
		host, port, err := net.SplitHostPort(target)
		if err != nil || host == "" {
			return bad("want host:port")
		}
		if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
			return bad("port must be 1-65535")
		}
	default:
		return &execution.InvalidArgumentError{Field: "kind", Reason: fmt.Sprintf("%q: want webhook, kafka or grpc", kind)}
	}
	return nil
}

// ConsumerSetParams registers or replaces an application's consumer.
type ConsumerSetParams struct {
	ApplicationID uuid.UUID
	Kind          ConsumerKind
	Target        string
	// Secrets, when non-nil, replace every current secret (each checked
	// with ValidateSecret, at most MaxConsumerSecrets); nil keeps them.
	Secrets []string
	// ExpectedVersion, when non-zero, must equal the consumer's version
	// (optimistic concurrency); 0 applies the change unconditionally.
	ExpectedVersion int64
	// Box seals the secrets; nil stores them in plaintext.
	Box *SecretBox
}

// ConsumerSet registers p.ApplicationID's consumer or replaces it (kind,
// target and, when given, secrets), clears its disabled flag and bumps its
// version, in one transaction. Deliveries already claimed keep the
// configuration they read; later claims read the new one.
//
// Errors: *execution.InvalidArgumentError (bad target or secret, too many
// secrets, or a webhook consumer without a secret); *NotFoundError (no such
// application); *ConflictError (ExpectedVersion given and not current,
// including when no consumer exists yet).
func (s *Store) ConsumerSet(ctx context.Context, p ConsumerSetParams) (Consumer, error) {
	if err := ValidateConsumerTarget("target", p.Kind, p.Target); err != nil {
		return Consumer{}, err
	}
	if err := validateSecrets(p.Secrets); err != nil {
		return Consumer{}, err
	}
	var c Consumer
	err := s.withTx(ctx, func(tx pgx.Tx) error {
		if err := consumerSetTx(ctx, tx, p); err != nil {
			return err
		}
		var err error
		c, err = consumerGet(ctx, tx, p.ApplicationID)
		return err
	})
	if err != nil {
		return Consumer{}, translate(fmt.Errorf("set event consumer of %s: %w", p.ApplicationID, err))
	}
	return c, nil
}

func validateSecrets(secrets []string) error {
	if len(secrets) > MaxConsumerSecrets {
		return &execution.InvalidArgumentError{Field: "secrets",
			Reason: fmt.Sprintf("%d secrets, at most %d", len(secrets), MaxConsumerSecrets)}
	}
	for i, sec := range secrets {
		if err := ValidateSecret(fmt.Sprintf("secrets[%d]", i), sec); err != nil {
			return err
		}
	}
	return nil
}

// consumerSetTx writes the consumer and its secrets inside tx; the
// parameters were validated.
func consumerSetTx(ctx context.Context, tx pgx.Tx, p ConsumerSetParams) error {
	var exists bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM applications WHERE id = $1)`, p.ApplicationID).
		Scan(&exists); err != nil {
		return fmt.Errorf("read application: %w", err)
	}
	if !exists {
		return &NotFoundError{What: "application", ID: p.ApplicationID.String()}
	}
	var tag pgconn.CommandTag
	var err error
	if p.ExpectedVersion != 0 {
		// Guard: version as the caller read it; zero rows: changed or gone.
		tag, err = tx.Exec(ctx, `
UPDATE event_consumers
   SET kind = $2, target = $3, disabled_at = NULL, disabled_reason = NULL,
       version = version + 1, updated_at = now()
 WHERE application_id = $1 AND version = $4`, p.ApplicationID, p.Kind, p.Target, p.ExpectedVersion)
	} else {
		tag, err = tx.Exec(ctx, `
INSERT INTO event_consumers (application_id, kind, target) VALUES ($1, $2, $3)
ON CONFLICT (application_id) DO UPDATE
   SET kind = EXCLUDED.kind, target = EXCLUDED.target, disabled_at = NULL, disabled_reason = NULL,
       version = event_consumers.version + 1, updated_at = now()`, p.ApplicationID, p.Kind, p.Target)
	}
	if err != nil {
		return fmt.Errorf("write consumer: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return &ConflictError{Reason: fmt.Sprintf("event consumer of %s is not at version %d", p.ApplicationID, p.ExpectedVersion)}
	}
	if p.Secrets != nil {
		if _, err := tx.Exec(ctx, `DELETE FROM event_consumer_secrets WHERE application_id = $1`, p.ApplicationID); err != nil {
			return fmt.Errorf("replace secrets: %w", err)
		}
		for _, sec := range p.Secrets {
			if _, err := insertSecret(ctx, tx, p.Box, p.ApplicationID, sec); err != nil {
				return err
			}
		}
	}
	return requireActiveSecret(ctx, tx, p.ApplicationID)
}

// insertSecret seals and stores one validated secret.
func insertSecret(ctx context.Context, tx pgx.Tx, box *SecretBox, app uuid.UUID, secret string) (uuid.UUID, error) {
	sealed, err := box.seal(app, secret)
	if err != nil {
		return uuid.Nil, err
	}
	id := uuid.New()
	_, err = tx.Exec(ctx, `
INSERT INTO event_consumer_secrets (id, application_id, sealed, fingerprint) VALUES ($1, $2, $3, $4)`,
		id, app, sealed, SecretFingerprint(secret))
	if err != nil {
		return uuid.Nil, fmt.Errorf("insert secret: %w", err)
	}
	return id, nil
}

// requireActiveSecret refuses a webhook consumer left without an active
// secret (an unsigned webhook could not be authenticated by its receiver).
func requireActiveSecret(ctx context.Context, tx pgx.Tx, app uuid.UUID) error {
	var kind ConsumerKind
	var active, total int
	err := tx.QueryRow(ctx, `
SELECT c.kind,
       (SELECT count(*) FROM event_consumer_secrets s
         WHERE s.application_id = c.application_id AND (s.expires_at IS NULL OR s.expires_at > now())),
       (SELECT count(*) FROM event_consumer_secrets s WHERE s.application_id = c.application_id)
  FROM event_consumers c WHERE c.application_id = $1`, app).Scan(&kind, &active, &total)
	if err != nil {
		return fmt.Errorf("count secrets: %w", err)
	}
	if total > MaxConsumerSecrets {
		return &execution.InvalidArgumentError{Field: "secrets",
			Reason: fmt.Sprintf("the consumer would have %d secrets, at most %d", total, MaxConsumerSecrets)}
	}
	if kind == ConsumerWebhook && active == 0 {
		return &execution.InvalidArgumentError{Field: "secrets", Reason: "a webhook consumer needs at least one active signing secret"}
	}
	return nil
}

// ConsumerGet returns the consumer of application app, or a *NotFoundError
// when none is registered.
func (s *Store) ConsumerGet(ctx context.Context, app uuid.UUID) (Consumer, error) {
	c, err := consumerGet(ctx, s.pool, app)
	if err != nil {
		return Consumer{}, translate(fmt.Errorf("get event consumer: %w", err))
	}
	return c, nil
}

const consumerColumns = `c.application_id, c.kind, c.target, c.disabled_at, coalesce(c.disabled_reason, ''),
       c.version, c.created_at, c.updated_at`

func scanConsumer(row pgx.Row) (Consumer, error) {
	var c Consumer
	var disabled *time.Time
	err := row.Scan(&c.ApplicationID, &c.Kind, &c.Target, &disabled, &c.DisabledReason, &c.Version, &c.CreatedAt, &c.UpdatedAt)
	if disabled != nil {
		c.DisabledAt = *disabled
	}
	return c, err
}

func consumerGet(ctx context.Context, q querier, app uuid.UUID) (Consumer, error) {
	c, err := scanConsumer(q.QueryRow(ctx, `SELECT `+consumerColumns+` FROM event_consumers c WHERE c.application_id = $1`, app))
	if errors.Is(err, pgx.ErrNoRows) {
		return Consumer{}, &NotFoundError{What: "event consumer of application", ID: app.String()}
	}
	if err != nil {
		return Consumer{}, err
	}
	list := []Consumer{c}
	if err := attachSecrets(ctx, q, list); err != nil {
		return Consumer{}, err
	}
	return list[0], nil
}

// attachSecrets fills the Secrets of each consumer in list.
func attachSecrets(ctx context.Context, q querier, list []Consumer) error {
	if len(list) == 0 {
		return nil
	}
	ids := make([]uuid.UUID, len(list))
	at := make(map[uuid.UUID]int, len(list))
	for i, c := range list {
		ids[i], at[c.ApplicationID] = c.ApplicationID, i
	}
	rows, err := q.Query(ctx, `
SELECT application_id, id, fingerprint, created_at, expires_at, (expires_at IS NULL OR expires_at > now())
  FROM event_consumer_secrets WHERE application_id = ANY($1) ORDER BY created_at, id`, ids)
	if err != nil {
		return fmt.Errorf("read secrets: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var app uuid.UUID
		var sec ConsumerSecret
		var expires *time.Time
		if err := rows.Scan(&app, &sec.ID, &sec.Fingerprint, &sec.CreatedAt, &expires, &sec.Active); err != nil {
			return fmt.Errorf("read secrets: %w", err)
		}
		if expires != nil {
			sec.ExpiresAt = *expires
		}
		list[at[app]].Secrets = append(list[at[app]].Secrets, sec)
	}
	return rows.Err()
}

// ConsumerListParams pages through consumers by application id.
type ConsumerListParams struct {
	// After is the last application id of the previous page; uuid.Nil for
	// the first page.
	After uuid.UUID
	// Limit is the page size, 1..1000 (other values mean 100).
	Limit int
}

// ConsumerList returns up to p.Limit consumers with application id greater
// than p.After, ordered by application id.
func (s *Store) ConsumerList(ctx context.Context, p ConsumerListParams) ([]Consumer, error) {
	if p.Limit <= 0 || p.Limit > 1000 {
		p.Limit = 100
	}
	rows, err := s.pool.Query(ctx, `SELECT `+consumerColumns+` FROM event_consumers c
 WHERE c.application_id > $1 ORDER BY c.application_id LIMIT $2`, p.After, p.Limit)
	if err != nil {
		return nil, translate(fmt.Errorf("list event consumers: %w", err))
	}
	list, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Consumer, error) { return scanConsumer(r) })
	if err != nil {
		return nil, translate(fmt.Errorf("list event consumers: %w", err))
	}
	if err := attachSecrets(ctx, s.pool, list); err != nil {
		return nil, translate(fmt.Errorf("list event consumers: %w", err))
	}
	return list, nil
}

// ConsumerAddSecretParams adds a signing secret (rotation).
type ConsumerAddSecretParams struct {
	ApplicationID uuid.UUID
	// Secret is the new secret (checked with ValidateSecret).
	Secret string
	// RetirePreviousAfter, when non-nil, makes every active secret without
	// an expiry stop signing this long from now (database clock),
	// 0..MaxRetireAfter. nil leaves them signing.
	RetirePreviousAfter *time.Duration
	// Box seals the secret; nil stores it in plaintext.
	Box *SecretBox
}

// ConsumerAddSecret adds p.Secret to the consumer of p.ApplicationID and
// returns the consumer and the new secret's id. Secrets that already
// expired are removed in the same transaction. The consumer's version is
// bumped (guard: the consumer row, locked by the update).
//
// Errors: *execution.InvalidArgumentError (bad secret or grace period, or
// more than MaxConsumerSecrets secrets); *NotFoundError (no consumer).
func (s *Store) ConsumerAddSecret(ctx context.Context, p ConsumerAddSecretParams) (Consumer, uuid.UUID, error) {
	if err := ValidateSecret("secret", p.Secret); err != nil {
		return Consumer{}, uuid.Nil, err
	}
	if d := p.RetirePreviousAfter; d != nil && (*d < 0 || *d > MaxRetireAfter) {
		return Consumer{}, uuid.Nil, &execution.InvalidArgumentError{Field: "retire_previous_after",
			Reason: fmt.Sprintf("%v: want 0..%v", *d, MaxRetireAfter)}
	}
	var c Consumer
	var id uuid.UUID
	err := s.withTx(ctx, func(tx pgx.Tx) error {
		if err := bumpConsumer(ctx, tx, p.ApplicationID); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `
DELETE FROM event_consumer_secrets WHERE application_id = $1 AND expires_at <= now()`, p.ApplicationID); err != nil {
			return fmt.Errorf("remove expired secrets: %w", err)
		}
		if d := p.RetirePreviousAfter; d != nil {
			if _, err := tx.Exec(ctx, `
UPDATE event_consumer_secrets SET expires_at = now() + make_interval(secs => $2)
 WHERE application_id = $1 AND expires_at IS NULL`, p.ApplicationID, d.Seconds()); err != nil {
				return fmt.Errorf("retire secrets: %w", err)
			}
		}
		var err error
		if id, err = insertSecret(ctx, tx, p.Box, p.ApplicationID, p.Secret); err != nil {
			return err
		}
		if err := requireActiveSecret(ctx, tx, p.ApplicationID); err != nil {
			return err
		}
		c, err = consumerGet(ctx, tx, p.ApplicationID)
		return err
	})
	if err != nil {
		return Consumer{}, uuid.Nil, translate(fmt.Errorf("add signing secret: %w", err))
	}
	return c, id, nil
}

// bumpConsumer increments the consumer's version, locking its row for the
// transaction; zero rows: no consumer (*NotFoundError).
func bumpConsumer(ctx context.Context, tx pgx.Tx, app uuid.UUID) error {
	tag, err := tx.Exec(ctx, `
UPDATE event_consumers SET version = version + 1, updated_at = now() WHERE application_id = $1`, app)
	if err != nil {
		return fmt.Errorf("lock consumer: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return &NotFoundError{What: "event consumer of application", ID: app.String()}
	}
	return nil
}

// ConsumerRemoveSecret deletes one signing secret of app's consumer and
// returns the consumer.
//
// Errors: *NotFoundError (no consumer, or no such secret for it);
// *execution.InvalidArgumentError when it would leave a webhook consumer
// without an active secret (nothing changes).
func (s *Store) ConsumerRemoveSecret(ctx context.Context, app, secretID uuid.UUID) (Consumer, error) {
	var c Consumer
	err := s.withTx(ctx, func(tx pgx.Tx) error {
		if err := bumpConsumer(ctx, tx, app); err != nil {
			return err
		}
		// Guard: the secret belongs to this application; zero rows: not found.
		tag, err := tx.Exec(ctx, `DELETE FROM event_consumer_secrets WHERE id = $1 AND application_id = $2`, secretID, app)
		if err != nil {
			return fmt.Errorf("remove secret: %w", err)
		}
		if tag.RowsAffected() == 0 {
			return &NotFoundError{What: "signing secret", ID: secretID.String()}
		}
		if err := requireActiveSecret(ctx, tx, app); err != nil {
			var inv *execution.InvalidArgumentError
			if errors.As(err, &inv) {
				return &ConflictError{Reason: "it is the last active signing secret of a webhook consumer: rotate first"}
			}
			return err
		}
		c, err = consumerGet(ctx, tx, app)
		return err
	})
	if err != nil {
		return Consumer{}, translate(fmt.Errorf("remove signing secret: %w", err))
	}
	return c, nil
}

// ConsumerEnable clears the disabled flag of app's consumer (bumping its
// version only when it was disabled) and returns the consumer. Events that
// waited while it was disabled become claimable. Errors: *NotFoundError.
func (s *Store) ConsumerEnable(ctx context.Context, app uuid.UUID) (Consumer, error) {
	var c Consumer
	err := s.withTx(ctx, func(tx pgx.Tx) error {
		// Guard: the consumer exists; zero rows: not found.
		tag, err := tx.Exec(ctx, `
UPDATE event_consumers
   SET version = version + CASE WHEN disabled_at IS NULL THEN 0 ELSE 1 END,
       updated_at = CASE WHEN disabled_at IS NULL THEN updated_at ELSE now() END,
       disabled_at = NULL, disabled_reason = NULL
 WHERE application_id = $1`, app)
		if err != nil {
			return fmt.Errorf("enable consumer: %w", err)
		}
		if tag.RowsAffected() == 0 {
			return &NotFoundError{What: "event consumer of application", ID: app.String()}
		}
		c, err = consumerGet(ctx, tx, app)
		return err
	})
	if err != nil {
		return Consumer{}, translate(fmt.Errorf("enable event consumer: %w", err))
	}
	return c, nil
}

// ConsumerSealSecrets encrypts with box every signing secret still stored
// in plaintext (registered without a key, or migrated from the
// applications table) and returns how many it sealed. Each update is
// guarded by the stored value as read: a secret changed meanwhile is left
// alone (zero rows) and not counted. A nil box seals nothing.
func (s *Store) ConsumerSealSecrets(ctx context.Context, box *SecretBox) (int, error) {
	if box == nil {
		return 0, nil
	}
	rows, err := s.pool.Query(ctx, `
SELECT id, application_id, sealed FROM event_consumer_secrets WHERE sealed NOT LIKE 'aesgcm1:%'`)
	if err != nil {
		return 0, translate(fmt.Errorf("read plaintext secrets: %w", err))
	}
	type plain struct {
		id, app uuid.UUID
		secret  string
	}
	list, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (plain, error) {
		var p plain
		return p, r.Scan(&p.id, &p.app, &p.secret)
	})
	if err != nil {
		return 0, translate(fmt.Errorf("read plaintext secrets: %w", err))
	}
	n := 0
	for _, p := range list {
		sealed, err := box.seal(p.app, p.secret)
		if err != nil {
			return n, err
		}
		tag, err := s.pool.Exec(ctx, `
UPDATE event_consumer_secrets SET sealed = $3, fingerprint = $4 WHERE id = $1 AND sealed = $2`,
			p.id, p.secret, sealed, SecretFingerprint(p.secret))
		if err != nil {
			return n, translate(fmt.Errorf("seal secret %s: %w", p.id, err))
		}
		n += int(tag.RowsAffected())
	}
	return n, nil
}
