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
	ID            uuid.UUID
	Name          string
	WebhookURL    string
	WebhookSecret string
	Version       int64
	CreatedAt     time.Time
}

// HashAPIKey returns the SHA-256 of an API key, the only form stored.
func HashAPIKey(key string) []byte {
	h := sha256.Sum256([]byte(key))
	return h[:]
}

// ApplicationUpsertParams creates or replaces an application by name.
type ApplicationUpsertParams struct {
	Name          string
	APIKey        string // stored only as HashAPIKey(APIKey)
	WebhookURL    string
	WebhookSecret string
}

// ApplicationUpsert creates the application named p.Name, or replaces its
// API key and webhook consumer when it exists (bumping its version).
func (s *Store) ApplicationUpsert(ctx context.Context, p ApplicationUpsertParams) (Application, error) {
	var a Application
	err := s.pool.QueryRow(ctx, `
INSERT INTO applications (id, name, api_key_hash, webhook_url, webhook_secret)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (name) DO UPDATE
   SET api_key_hash = EXCLUDED.api_key_hash, webhook_url = EXCLUDED.webhook_url,
       webhook_secret = EXCLUDED.webhook_secret, version = applications.version + 1, updated_at = now()
RETURNING id, name, webhook_url, webhook_secret, version, created_at`,
		uuid.New(), p.Name, HashAPIKey(p.APIKey), p.WebhookURL, p.WebhookSecret,
	).Scan(&a.ID, &a.Name, &a.WebhookURL, &a.WebhookSecret, &a.Version, &a.CreatedAt)
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
SELECT id, name, webhook_url, webhook_secret, version, created_at
  FROM applications WHERE api_key_hash = $1`, HashAPIKey(key),
	).Scan(&a.ID, &a.Name, &a.WebhookURL, &a.WebhookSecret, &a.Version, &a.CreatedAt)
	if err == pgx.ErrNoRows {
		return Application{}, execution.ErrUnauthenticated
	}
	if err != nil {
		return Application{}, translate(fmt.Errorf("application by key: %w", err))
	}
	return a, nil
}
