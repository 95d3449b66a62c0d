package pgstore

import (
	"context"
	"crypto/sha256"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/capstan-dev/capstan/internal/execution"
)

// Application is a tenant that invokes capabilities.
type Application struct {
	ID   uuid.UUID
	Name string
	// WebhookURL is the URL of the application's webhook consumer, "" when
	// its consumer is not a webhook or none is registered (see ConsumerGet).
	WebhookURL string
	// WebhookSecret is the secret given to ApplicationUpsert, returned by it
	// only: stored secrets are never read back, so ApplicationByAPIKey
	// leaves it empty.
	WebhookSecret string
	Version       int64
	CreatedAt     time.Time
}

// HashAPIKey returns the SHA-256 of an API key, the only form stored.
func HashAPIKey(key string) []byte {
	h := sha256.Sum256([]byte(key))
	return h[:]
}

// ValidateApplicationName checks an application's name: 1-128 bytes of
// ASCII letters, digits, '.', '_' and '-', starting with a letter or digit.
// The name is also the application's prefix in the object store
// ("<name>/…"), so it can contain no '/' and be no dot segment. The error
// is an *execution.InvalidArgumentError naming the field "name".
func ValidateApplicationName(name string) error {
	bad := len(name) == 0 || len(name) > 128
	for i := 0; i < len(name) && !bad; i++ {
		c := name[i]
		alnum := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
		bad = !alnum && (i == 0 || c != '.' && c != '_' && c != '-')
	}
	if bad {
		return &execution.InvalidArgumentError{Field: "name",
			Reason: fmt.Sprintf("%q: want 1-128 of A-Z a-z 0-9 . _ -, starting with a letter or digit", name)}
	}
	return nil
}

// ApplicationUpsertParams creates or replaces an application by name.
type ApplicationUpsertParams struct {
	Name   string
	APIKey string // stored only as HashAPIKey(APIKey)
	// WebhookURL and WebhookSecret, when WebhookURL is set, register a
	// webhook consumer with that one signing secret (replacing the
	// consumer and its secrets, and clearing its disabled flag, as
	// ConsumerSet does). An empty WebhookURL leaves the consumer as it is.
	WebhookURL    string
	WebhookSecret string
	// Box seals WebhookSecret at rest; nil stores it in plaintext (the
	// development fallback, see SecretBox).
	Box *SecretBox
}

// ApplicationUpsert creates the application named p.Name, or replaces its
// API key when it exists (bumping its version), and registers its webhook
// consumer when p.WebhookURL is set, all in one transaction.
//
// Errors: *execution.InvalidArgumentError for a bad webhook URL or secret
// (see ValidateConsumerTarget and ValidateSecret); nothing is written then.
func (s *Store) ApplicationUpsert(ctx context.Context, p ApplicationUpsertParams) (Application, error) {
	if err := ValidateApplicationName(p.Name); err != nil {
		return Application{}, err
	}
	var secrets []string
	if p.WebhookURL != "" {
		if err := ValidateConsumerTarget("webhook_url", ConsumerWebhook, p.WebhookURL); err != nil {
			return Application{}, err
		}
		if err := ValidateSecret("webhook_secret", p.WebhookSecret); err != nil {
			return Application{}, err
		}
		secrets = []string{p.WebhookSecret}
	}
	var a Application
	err := s.withTx(ctx, func(tx pgx.Tx) error {
		err := tx.QueryRow(ctx, `
INSERT INTO applications (id, name, api_key_hash)
VALUES ($1, $2, $3)
ON CONFLICT (name) DO UPDATE
   SET api_key_hash = EXCLUDED.api_key_hash, version = applications.version + 1, updated_at = now()
RETURNING id, name, version, created_at`,
			uuid.New(), p.Name, HashAPIKey(p.APIKey),
		).Scan(&a.ID, &a.Name, &a.Version, &a.CreatedAt)
		if err != nil {
			return err
		}
		if p.WebhookURL == "" {
			return nil
		}
		a.WebhookURL, a.WebhookSecret = p.WebhookURL, p.WebhookSecret
		return consumerSetTx(ctx, tx, ConsumerSetParams{
			ApplicationID: a.ID, Kind: ConsumerWebhook, Target: p.WebhookURL, Secrets: secrets, Box: p.Box,
		})
	})
	if err != nil {
		return Application{}, translate(fmt.Errorf("upsert application %q: %w", p.Name, err))
	}
	return a, nil
}

// ApplicationByAPIKey returns the application whose API key is key. It
// returns execution.ErrUnauthenticated for an unknown key.
func (s *Store) ApplicationByAPIKey(ctx context.Context, key string) (Application, error) {
	var a Application
	err := s.pool.QueryRow(ctx, `
SELECT a.id, a.name, coalesce(c.target, ''), a.version, a.created_at
  FROM applications a LEFT JOIN event_consumers c ON c.application_id = a.id AND c.kind = 'webhook'
 WHERE a.api_key_hash = $1`, HashAPIKey(key),
	).Scan(&a.ID, &a.Name, &a.WebhookURL, &a.Version, &a.CreatedAt)
	if err == pgx.ErrNoRows {
		return Application{}, fmt.Errorf("%w: unknown API key", execution.ErrUnauthenticated)
	}
	if err != nil {
		return Application{}, translate(fmt.Errorf("application by key: %w", err))
	}
	return a, nil
}
