package pgstore_test

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/testutil/pgtest"
)

func secret(t testing.TB, n int) string {
	t.Helper()
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return "whsec_" + base64.StdEncoding.EncodeToString(b)
}

func newBox(t testing.TB) *pgstore.SecretBox {
	t.Helper()
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	box, err := pgstore.NewSecretBox(base64.StdEncoding.EncodeToString(key))
	require.NoError(t, err)
	return box
}

// settledEvent settles a new execution of app and returns its event id.
func settledEvent(t testing.TB, st *pgstore.Store, app uuid.UUID) uuid.UUID {
	t.Helper()
	ctx := context.Background()
	e, _, err := st.ExecutionInsert(ctx, insertParams(app, "", `{}`))
	require.NoError(t, err)
	e, err = st.AttemptStart(ctx, pgstore.AttemptStartParams{ExecutionID: e.ID, Attempt: 1, Owner: "w", LeaseFor: time.Minute})
	require.NoError(t, err)
	_, err = st.ExecutionSettle(ctx, pgstore.SettleParams{
		ExecutionID: e.ID, Fence: pgstore.Fence{Attempt: 1, LeaseToken: e.LeaseToken},
		Status: execution.StatusSucceeded, Output: []byte(`{}`), OutputType: "application/json", AttemptOutcome: "SUCCEEDED",
	})
	require.NoError(t, err)
	var id uuid.UUID
	require.NoError(t, st.QueryRowForTest(ctx, `SELECT id FROM completion_events WHERE execution_id = $1`, e.ID).Scan(&id))
	return id
}

func TestConsumerSetValidation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	good := secret(t, 32)
	tests := []struct {
		name      string
		p         pgstore.ConsumerSetParams
		wantField string // InvalidArgumentError field; "" for no error
		wantErr   error
		fresh     bool // on an application without a consumer
	}{
		{name: "webhook ok", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerWebhook, Target: "https://example.com/hook?x=1", Secrets: []string{good}}},
		{name: "kafka ok without secret", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerKafka, Target: "app-a.events_v1"}},
		{name: "grpc ok", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerGRPC, Target: "events.internal:8443"}},
		{name: "spec-size secret (24 bytes)", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerWebhook, Target: "http://h/", Secrets: []string{"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}}},
		{name: "unknown kind", p: pgstore.ConsumerSetParams{Kind: "smtp", Target: "x"}, wantField: "kind"},
		{name: "ftp scheme", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerWebhook, Target: "ftp://example.com/", Secrets: []string{good}}, wantField: "target"},
		{name: "no host", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerWebhook, Target: "https:///path", Secrets: []string{good}}, wantField: "target"},
		{name: "port only", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerWebhook, Target: "http://:80/", Secrets: []string{good}}, wantField: "target"},
		{name: "user info", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerWebhook, Target: "https://u:p@example.com/", Secrets: []string{good}}, wantField: "target"},
		{name: "too long", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerWebhook, Target: "https://example.com/" + strings.Repeat("a", 2048), Secrets: []string{good}}, wantField: "target"},
		{name: "space", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerWebhook, Target: "https://example.com/a b", Secrets: []string{good}}, wantField: "target"},
		{name: "relative", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerWebhook, Target: "/hook", Secrets: []string{good}}, wantField: "target"},
		{name: "bad port", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerWebhook, Target: "http://example.com:99999/", Secrets: []string{good}}, wantField: "target"},
		{name: "empty target", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerKafka}, wantField: "target"},
		{name: "bad topic", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerKafka, Target: "a/b"}, wantField: "target"},
		{name: "dot topic", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerKafka, Target: ".."}, wantField: "target"},
		{name: "grpc without port", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerGRPC, Target: "events.internal"}, wantField: "target"},
		{name: "webhook without secret", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerWebhook, Target: "https://example.com/"}, wantField: "secrets", fresh: true},
		{name: "back to webhook keeps its secrets", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerWebhook, Target: "https://example.com/"}},
		{name: "secret without prefix", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerWebhook, Target: "https://example.com/", Secrets: []string{strings.TrimPrefix(good, "whsec_")}}, wantField: "secrets[0]"},
		{name: "secret too short", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerWebhook, Target: "https://example.com/", Secrets: []string{good, secret(t, 16)}}, wantField: "secrets[1]"},
		{name: "secret too long", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerWebhook, Target: "https://example.com/", Secrets: []string{secret(t, 65)}}, wantField: "secrets[0]"},
		{name: "secret not base64", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerWebhook, Target: "https://example.com/", Secrets: []string{"whsec_%%%%"}}, wantField: "secrets[0]"},
		{name: "too many secrets", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerKafka, Target: "t", Secrets: make([]string, 11)}, wantField: "secrets"},
		{name: "unknown application", p: pgstore.ConsumerSetParams{ApplicationID: uuid.New(), Kind: pgstore.ConsumerKafka, Target: "t"}, wantErr: execution.ErrNotFound},
		{name: "stale expected version", p: pgstore.ConsumerSetParams{Kind: pgstore.ConsumerKafka, Target: "t", ExpectedVersion: 999}, wantErr: execution.ErrConflict},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Sequential: the cases share one application's consumer.
			if tt.fresh {
				a, err := b.store.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: uuid.NewString(), APIKey: uuid.NewString()})
				require.NoError(t, err)
				tt.p.ApplicationID = a.ID
			}
			if tt.p.ApplicationID == uuid.Nil {
				tt.p.ApplicationID = b.app.ID
			}
			before, _ := b.store.ConsumerGet(ctx, tt.p.ApplicationID)
			_, err := b.store.ConsumerSet(ctx, tt.p)
			switch {
			case tt.wantField != "":
				var inv *execution.InvalidArgumentError
				require.ErrorAs(t, err, &inv)
				require.Equal(t, tt.wantField, inv.Field)
				for _, s := range tt.p.Secrets {
					if s != "" {
						require.NotContains(t, err.Error(), strings.TrimPrefix(s, "whsec_"), "errors never quote secrets")
					}
				}
			case tt.wantErr != nil:
				require.ErrorIs(t, err, tt.wantErr)
			default:
				require.NoError(t, err)
				return
			}
			after, _ := b.store.ConsumerGet(ctx, tt.p.ApplicationID)
			require.Equal(t, before, after, "a refused change writes nothing")
		})
	}
}

func TestConsumerLifecycle(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	s1, s2, s3 := secret(t, 32), secret(t, 32), secret(t, 48)

	_, err := b.store.ConsumerGet(ctx, b.app.ID)
	require.ErrorIs(t, err, execution.ErrNotFound)

	c, err := b.store.ConsumerSet(ctx, pgstore.ConsumerSetParams{
		ApplicationID: b.app.ID, Kind: pgstore.ConsumerWebhook, Target: "https://example.com/a", Secrets: []string{s1, s2},
	})
	require.NoError(t, err)
	require.EqualValues(t, 1, c.Version)
	require.Len(t, c.Secrets, 2)
	fps := []string{c.Secrets[0].Fingerprint, c.Secrets[1].Fingerprint}
	require.ElementsMatch(t, []string{pgstore.SecretFingerprint(s1), pgstore.SecretFingerprint(s2)}, fps)
	for _, sec := range c.Secrets {
		require.True(t, sec.Active)
		require.True(t, sec.ExpiresAt.IsZero())
	}

	// Optimistic concurrency: the version as read wins once.
	c2, err := b.store.ConsumerSet(ctx, pgstore.ConsumerSetParams{
		ApplicationID: b.app.ID, Kind: pgstore.ConsumerGRPC, Target: "h:1", ExpectedVersion: c.Version,
	})
	require.NoError(t, err)
	require.EqualValues(t, 2, c2.Version)
	require.Len(t, c2.Secrets, 2, "no secrets given: kept")
	_, err = b.store.ConsumerSet(ctx, pgstore.ConsumerSetParams{
		ApplicationID: b.app.ID, Kind: pgstore.ConsumerGRPC, Target: "h:2", ExpectedVersion: c.Version,
	})
	require.ErrorIs(t, err, execution.ErrConflict)

	// Rotation: the new secret signs, the old ones retire after the grace
	// period (0: at once).
	zero := time.Duration(0)
	c3, id3, err := b.store.ConsumerAddSecret(ctx, pgstore.ConsumerAddSecretParams{
		ApplicationID: b.app.ID, Secret: s3, RetirePreviousAfter: &zero,
	})
	require.NoError(t, err)
	active := 0
	for _, sec := range c3.Secrets {
		if sec.Active {
			active++
			require.Equal(t, id3, sec.ID)
		}
	}
	require.Equal(t, 1, active)
	hour := time.Hour
	_, _, err = b.store.ConsumerAddSecret(ctx, pgstore.ConsumerAddSecretParams{
		ApplicationID: b.app.ID, Secret: s1, RetirePreviousAfter: &hour,
	})
	require.NoError(t, err)
	c4, err := b.store.ConsumerGet(ctx, b.app.ID)
	require.NoError(t, err)
	require.Len(t, c4.Secrets, 2, "expired secrets are removed by the next rotation")
	for _, sec := range c4.Secrets {
		require.True(t, sec.Active)
		if sec.ID == id3 {
			require.WithinDuration(t, time.Now().Add(time.Hour), sec.ExpiresAt, time.Minute)
		}
	}
	tooLong := 31 * 24 * time.Hour
	_, _, err = b.store.ConsumerAddSecret(ctx, pgstore.ConsumerAddSecretParams{ApplicationID: b.app.ID, Secret: s2, RetirePreviousAfter: &tooLong})
	var inv *execution.InvalidArgumentError
	require.ErrorAs(t, err, &inv)
	_, _, err = b.store.ConsumerAddSecret(ctx, pgstore.ConsumerAddSecretParams{ApplicationID: uuid.New(), Secret: s2})
	require.ErrorIs(t, err, execution.ErrNotFound)

	// Removal: never the last active secret of a webhook.
	c5, err := b.store.ConsumerSet(ctx, pgstore.ConsumerSetParams{
		ApplicationID: b.app.ID, Kind: pgstore.ConsumerWebhook, Target: "https://example.com/b", Secrets: []string{s2},
	})
	require.NoError(t, err)
	_, err = b.store.ConsumerRemoveSecret(ctx, b.app.ID, c5.Secrets[0].ID)
	require.ErrorIs(t, err, execution.ErrConflict)
	_, err = b.store.ConsumerRemoveSecret(ctx, b.app.ID, uuid.New())
	require.ErrorIs(t, err, execution.ErrNotFound)
	c6, _, err := b.store.ConsumerAddSecret(ctx, pgstore.ConsumerAddSecretParams{ApplicationID: b.app.ID, Secret: s1})
	require.NoError(t, err)
	c7, err := b.store.ConsumerRemoveSecret(ctx, b.app.ID, c5.Secrets[0].ID)
	require.NoError(t, err)
	require.Len(t, c7.Secrets, 1)
	require.Greater(t, c7.Version, c6.Version)

	// Enable is idempotent and bumps the version only when it changes.
	c8, err := b.store.ConsumerEnable(ctx, b.app.ID)
	require.NoError(t, err)
	require.Equal(t, c7.Version, c8.Version)
	_, err = b.store.ConsumerEnable(ctx, uuid.New())
	require.ErrorIs(t, err, execution.ErrNotFound)

	// List pages by application id.
	other, err := b.store.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: "app-b", APIKey: "key-b",
		WebhookURL: "http://other.example/", WebhookSecret: s2})
	require.NoError(t, err)
	var all []uuid.UUID
	after := uuid.Nil
	for {
		page, err := b.store.ConsumerList(ctx, pgstore.ConsumerListParams{After: after, Limit: 1})
		require.NoError(t, err)
		if len(page) == 0 {
			break
		}
		require.Len(t, page, 1)
		all = append(all, page[0].ApplicationID)
		after = page[0].ApplicationID
	}
	require.ElementsMatch(t, []uuid.UUID{b.app.ID, other.ID}, all)
}

func TestConsumerSecretsEncryptedAtRest(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	box, wrong := newBox(t), newBox(t)
	s := secret(t, 32)
	_, err := b.store.ConsumerSet(ctx, pgstore.ConsumerSetParams{
		ApplicationID: b.app.ID, Kind: pgstore.ConsumerWebhook, Target: "https://example.com/", Secrets: []string{s}, Box: box,
	})
	require.NoError(t, err)
	var stored string
	require.NoError(t, b.store.QueryRowForTest(ctx, `SELECT sealed FROM event_consumer_secrets`).Scan(&stored))
	require.True(t, strings.HasPrefix(stored, "aesgcm1:"))
	require.NotContains(t, stored, strings.TrimPrefix(s, "whsec_"))

	claim := func(box *pgstore.SecretBox) pgstore.EventDelivery {
		t.Helper()
		id := settledEvent(t, b.store, b.app.ID)
		got, err := b.store.EventClaim(ctx, pgstore.EventClaimParams{Owner: "t", Limit: 1, ClaimFor: time.Minute, PerApplication: 100, Box: box})
		require.NoError(t, err)
		require.Len(t, got, 1)
		require.Equal(t, id, got[0].ID)
		return got[0]
	}
	d := claim(box)
	require.NoError(t, d.SecretErr)
	require.Equal(t, []string{s}, d.Secrets)
	require.Equal(t, pgstore.ConsumerWebhook, d.ConsumerKind)

	for name, bx := range map[string]*pgstore.SecretBox{"no key": nil, "wrong key": wrong} {
		d := claim(bx)
		require.ErrorIs(t, d.SecretErr, pgstore.ErrSecretKey, name)
		require.Empty(t, d.Secrets, name)
		require.NotContains(t, d.SecretErr.Error(), strings.TrimPrefix(s, "whsec_"))
	}

	// The ciphertext is bound to its application: copied to another
	// application's consumer it does not open.
	other, err := b.store.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: "app-b", APIKey: "key-b"})
	require.NoError(t, err)
	_, err = b.store.ConsumerSet(ctx, pgstore.ConsumerSetParams{ApplicationID: other.ID, Kind: pgstore.ConsumerKafka, Target: "t"})
	require.NoError(t, err)
	var n int
	require.NoError(t, b.store.QueryRowForTest(ctx, `
WITH c AS (INSERT INTO event_consumer_secrets (id, application_id, sealed, fingerprint) VALUES ($1, $2, $3, 'x') RETURNING 1)
SELECT count(*) FROM c`, uuid.New(), other.ID, stored).Scan(&n))
	require.Equal(t, 1, n)
	settledEvent(t, b.store, other.ID)
	got, err := b.store.EventClaim(ctx, pgstore.EventClaimParams{Owner: "t", Limit: 10, ClaimFor: time.Minute, PerApplication: 100, Box: box})
	require.NoError(t, err)
	require.Len(t, got, 1)
	require.Equal(t, other.ID, got[0].ApplicationID)
	require.ErrorIs(t, got[0].SecretErr, pgstore.ErrSecretKey)

	// Plaintext secrets (no key at registration) are sealed in place.
	plain, err := b.store.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: "app-c", APIKey: "key-c",
		WebhookURL: "https://c.example/", WebhookSecret: s})
	require.NoError(t, err)
	sealed, err := b.store.ConsumerSealSecrets(ctx, box)
	require.NoError(t, err)
	require.Equal(t, 1, sealed)
	require.NoError(t, b.store.QueryRowForTest(ctx, `SELECT sealed FROM event_consumer_secrets WHERE application_id = $1`, plain.ID).Scan(&stored))
	require.True(t, strings.HasPrefix(stored, "aesgcm1:"))
	sealed, err = b.store.ConsumerSealSecrets(ctx, box)
	require.NoError(t, err)
	require.Zero(t, sealed, "idempotent")
}

func TestNewSecretBox(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		key     string
		wantNil bool
		wantErr bool
	}{
		{key: "", wantNil: true},
		{key: base64.StdEncoding.EncodeToString(make([]byte, 32))},
		{key: base64.StdEncoding.EncodeToString(make([]byte, 16)), wantErr: true},
		{key: "not base64!", wantErr: true},
	} {
		box, err := pgstore.NewSecretBox(tt.key)
		if tt.wantErr {
			require.Error(t, err, tt.key)
			continue
		}
		require.NoError(t, err)
		require.Equal(t, tt.wantNil, box == nil)
		require.Equal(t, !tt.wantNil, box.Encrypts())
	}
}

func TestEventClaimFairness(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	appB, err := b.store.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: "app-b", APIKey: "key-b"})
	require.NoError(t, err)
	for range 10 {
		settledEvent(t, b.store, b.app.ID) // A's backlog, all older than B's
	}
	for range 2 {
		settledEvent(t, b.store, appB.ID)
	}
	claim := func(limit int) map[uuid.UUID]int {
		t.Helper()
		got, err := b.store.EventClaim(ctx, pgstore.EventClaimParams{Owner: "t", Limit: limit, ClaimFor: time.Minute, PerApplication: 3})
		require.NoError(t, err)
		per := map[uuid.UUID]int{}
		for _, d := range got {
			per[d.ApplicationID]++
			require.Empty(t, d.ConsumerKind, "no consumer registered")
		}
		return per
	}
	require.Equal(t, map[uuid.UUID]int{b.app.ID: 2, appB.ID: 2}, claim(4), "least loaded first, not A's backlog")
	require.Equal(t, map[uuid.UUID]int{b.app.ID: 1}, claim(10), "A up to its bound of 3 in flight")
	require.Empty(t, claim(10), "A at its bound, B drained")
}

// deadEvent makes a new event of app DEAD through a claim and a record.
func deadEvent(t testing.TB, st *pgstore.Store, app uuid.UUID) uuid.UUID {
	t.Helper()
	ctx := context.Background()
	id := settledEvent(t, st, app)
	got, err := st.EventClaim(ctx, pgstore.EventClaimParams{Owner: "t", Limit: 100, ClaimFor: time.Minute, PerApplication: 100})
	require.NoError(t, err)
	for _, d := range got {
		_, err := st.EventRecordResult(ctx, pgstore.EventResultParams{
			ID: d.ID, ClaimToken: d.ClaimToken, Attempt: d.Attempts + 1, StartedAt: time.Now(),
			StatusCode: 500, Error: "HTTP 500", Dead: d.ID == id,
		})
		require.NoError(t, err)
	}
	return id
}

func TestEventReplay(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	other, err := b.store.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: "app-b", APIKey: "key-b"})
	require.NoError(t, err)
	old := deadEvent(t, b.store, b.app.ID)
	since, err := b.store.Now(ctx)
	require.NoError(t, err)
	recent := []uuid.UUID{deadEvent(t, b.store, b.app.ID), deadEvent(t, b.store, b.app.ID)}
	foreign := deadEvent(t, b.store, other.ID)
	pending := settledEvent(t, b.store, b.app.ID)

	n, err := b.store.EventReplayDead(ctx, b.app.ID, since)
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	for _, id := range recent {
		e, atts, err := b.store.EventGet(ctx, id, false)
		require.NoError(t, err)
		require.Equal(t, pgstore.EventPending, e.Status)
		require.Equal(t, 1, e.Attempts, "history kept")
		require.Zero(t, e.RoundAttempts, "schedule started over")
		require.Equal(t, 1, e.Replays)
		require.False(t, e.LastReplayedAt.IsZero())
		require.Len(t, atts, 1)
	}
	for _, id := range []uuid.UUID{old, foreign} {
		e, _, err := b.store.EventGet(ctx, id, false)
		require.NoError(t, err)
		require.Equal(t, pgstore.EventDead, e.Status, "outside the window or the application")
	}

	tests := []struct {
		name    string
		id      uuid.UUID
		force   bool
		wantErr error
		msg     string
	}{
		{"dead event", old, false, nil, ""},
		{"pending event refused", pending, true, execution.ErrConflict, "is PENDING"},
		{"unknown event", uuid.New(), false, execution.ErrNotFound, "not found"},
	}
	for _, tt := range tests {
		e, err := b.store.EventReplay(ctx, tt.id, tt.force)
		if tt.wantErr != nil {
			require.ErrorIs(t, err, tt.wantErr, tt.name)
			require.ErrorContains(t, err, tt.msg, tt.name)
			continue
		}
		require.NoError(t, err, tt.name)
		require.Equal(t, pgstore.EventPending, e.Status)
		require.Equal(t, tt.id, e.ID, "same event id")
	}

	// DELIVERED: refused unless forced.
	got, err := b.store.EventClaim(ctx, pgstore.EventClaimParams{Owner: "t", Limit: 100, ClaimFor: time.Minute, PerApplication: 100})
	require.NoError(t, err)
	for _, d := range got {
		_, err := b.store.EventRecordResult(ctx, pgstore.EventResultParams{ID: d.ID, ClaimToken: d.ClaimToken,
			Attempt: d.Attempts + 1, StartedAt: time.Now(), StatusCode: 200, Delivered: true})
		require.NoError(t, err)
	}
	_, err = b.store.EventReplay(ctx, pending, false)
	require.ErrorIs(t, err, execution.ErrConflict)
	require.ErrorContains(t, err, "DELIVERED")
	e, err := b.store.EventReplay(ctx, pending, true)
	require.NoError(t, err)
	require.Equal(t, pgstore.EventPending, e.Status)
	require.True(t, e.DeliveredAt.IsZero())
}

func TestEventListAndGet(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	other, err := b.store.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: "app-b", APIKey: "key-b"})
	require.NoError(t, err)
	dead := deadEvent(t, b.store, b.app.ID)
	var mine []uuid.UUID
	for range 5 {
		mine = append(mine, settledEvent(t, b.store, b.app.ID))
	}
	theirs := settledEvent(t, b.store, other.ID)

	all, err := b.store.EventList(ctx, pgstore.EventListParams{})
	require.NoError(t, err)
	require.Len(t, all, 7)
	require.Equal(t, theirs, all[0].ID, "newest first")
	require.Nil(t, all[0].Payload, "no payloads in lists")

	// Paging by (created_at, id) returns every event once.
	var paged []uuid.UUID
	p := pgstore.EventListParams{ApplicationID: b.app.ID, Limit: 2}
	for {
		page, err := b.store.EventList(ctx, p)
		require.NoError(t, err)
		for _, e := range page {
			require.Equal(t, b.app.ID, e.ApplicationID)
			paged = append(paged, e.ID)
		}
		if len(page) < p.Limit {
			break
		}
		p.BeforeCreatedAt, p.BeforeID = page[len(page)-1].CreatedAt, page[len(page)-1].ID
	}
	require.ElementsMatch(t, append([]uuid.UUID{dead}, mine...), paged)

	deadOnly, err := b.store.EventList(ctx, pgstore.EventListParams{Status: pgstore.EventDead})
	require.NoError(t, err)
	require.Len(t, deadOnly, 1)
	require.Equal(t, dead, deadOnly[0].ID)
	require.Equal(t, 500, deadOnly[0].LastStatusCode)
	future, err := b.store.EventList(ctx, pgstore.EventListParams{Since: time.Now().Add(time.Hour)})
	require.NoError(t, err)
	require.Empty(t, future)
	_, err = b.store.EventList(ctx, pgstore.EventListParams{Status: "LOST"})
	var inv *execution.InvalidArgumentError
	require.ErrorAs(t, err, &inv)

	e, atts, err := b.store.EventGet(ctx, dead, true)
	require.NoError(t, err)
	require.NotEmpty(t, e.Payload)
	require.Len(t, atts, 1)
	require.Equal(t, 500, atts[0].StatusCode)
	require.Equal(t, "HTTP 500", atts[0].Error)
	e, _, err = b.store.EventGet(ctx, dead, false)
	require.NoError(t, err)
	require.Nil(t, e.Payload)
	_, _, err = b.store.EventGet(ctx, uuid.New(), false)
	require.ErrorIs(t, err, execution.ErrNotFound)

	pend, err := b.store.EventPendingByApplication(ctx)
	require.NoError(t, err)
	counts := map[uuid.UUID]int64{}
	for _, p := range pend {
		counts[p.ApplicationID] = p.Count
		require.GreaterOrEqual(t, p.OldestAge, time.Duration(0))
	}
	require.Equal(t, map[uuid.UUID]int64{b.app.ID: 5, other.ID: 1}, counts)
}

func TestApplicationUpsertRegistersWebhookConsumer(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	s := secret(t, 32)
	a, err := b.store.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: "hooked", APIKey: "k1",
		WebhookURL: "http://127.0.0.1:9/events", WebhookSecret: s})
	require.NoError(t, err)
	c, err := b.store.ConsumerGet(ctx, a.ID)
	require.NoError(t, err)
	require.Equal(t, pgstore.ConsumerWebhook, c.Kind)
	require.Equal(t, "http://127.0.0.1:9/events", c.Target)
	require.Len(t, c.Secrets, 1)

	// Without a URL the consumer is left alone; the key changes.
	_, err = b.store.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: "hooked", APIKey: "k2"})
	require.NoError(t, err)
	again, err := b.store.ConsumerGet(ctx, a.ID)
	require.NoError(t, err)
	require.Equal(t, c, again)
	byKey, err := b.store.ApplicationByAPIKey(ctx, "k2")
	require.NoError(t, err)
	require.Equal(t, "http://127.0.0.1:9/events", byKey.WebhookURL)
	require.Empty(t, byKey.WebhookSecret, "secrets are never read back")

	_, err = b.store.ApplicationUpsert(ctx, pgstore.ApplicationUpsertParams{Name: "bad", APIKey: "k3",
		WebhookURL: "javascript:alert(1)", WebhookSecret: s})
	var inv *execution.InvalidArgumentError
	require.ErrorAs(t, err, &inv)
	require.Equal(t, "webhook_url", inv.Field)
	_, err = b.store.ApplicationByAPIKey(ctx, "k3")
	require.ErrorIs(t, err, execution.ErrUnauthenticated, "nothing written")
}

// TestMigrationMovesWebhooksToConsumers applies migration 2 to a database
// holding a webhook on the applications row, and rolls it back.
func TestMigrationMovesWebhooksToConsumers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDatabase(t, func(ctx context.Context, url string) error {
		return pgstore.MigrateToForTest(ctx, url, 1, false)
	})
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	s := secret(t, 32)
	app, bare := uuid.New(), uuid.New()
	_, err = conn.Exec(ctx, `
INSERT INTO applications (id, name, api_key_hash, webhook_url, webhook_secret)
VALUES ($1, 'hooked', $3, 'https://example.com/events', $4), ($2, 'bare', $5, '', '')`,
		app, bare, pgstore.HashAPIKey("a"), s, pgstore.HashAPIKey("b"))
	require.NoError(t, err)

	require.NoError(t, pgstore.MigrateToForTest(ctx, url, 2, false))
	var kind, target, sealed, fp, oldURL, oldSecret string
	require.NoError(t, conn.QueryRow(ctx, `
SELECT c.kind, c.target, s.sealed, s.fingerprint, a.webhook_url, a.webhook_secret
  FROM event_consumers c JOIN event_consumer_secrets s USING (application_id) JOIN applications a ON a.id = c.application_id`).
		Scan(&kind, &target, &sealed, &fp, &oldURL, &oldSecret))
	require.Equal(t, "webhook", kind)
	require.Equal(t, "https://example.com/events", target)
	require.Equal(t, s, sealed, "copied as plaintext; routers with a key seal it")
	require.Equal(t, pgstore.SecretFingerprint(s), fp)
	require.Empty(t, oldURL+oldSecret, "no second copy left on the applications row")
	var consumers int
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM event_consumers`).Scan(&consumers))
	require.Equal(t, 1, consumers, "applications without a webhook get no consumer")

	require.NoError(t, pgstore.MigrateToForTest(ctx, url, 1, true))
	require.NoError(t, conn.QueryRow(ctx, `SELECT webhook_url, webhook_secret FROM applications WHERE id = $1`, app).
		Scan(&oldURL, &oldSecret))
	require.Equal(t, "https://example.com/events", oldURL)
	require.Equal(t, s, oldSecret)
}
