package router

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
)

// The published test vector of the Standard Webhooks reference libraries
// (libraries/go/webhook_test.go TestWebhookSign, and the same constants in
// the other languages' tests).
const (
	specSecret    = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
	specMsgID     = "msg_p5jXN8AQM9LWM0D4loKWxJek"
	specTimestamp = 1614265330
	specPayload   = `{"test": 2432232314}`
	specSignature = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
)

// hmacSignature computes one v1 signature independently of signatures().
func hmacSignature(t testing.TB, secret, id, ts string, body []byte) string {
	t.Helper()
	key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(secret, "whsec_"))
	require.NoError(t, err)
	mac := hmac.New(sha256.New, key)
	_, _ = fmt.Fprintf(mac, "%s.%s.%s", id, ts, body)
	return "v1," + base64.StdEncoding.EncodeToString(mac.Sum(nil))
}

// verifyEach checks that the webhook-signature of h holds exactly one
// entry per secret, in order, each equal to an independently computed
// HMAC, and that the reference library, holding only that one secret,
// accepts the message.
func verifyEach(t testing.TB, h http.Header, body []byte, secrets ...string) {
	t.Helper()
	entries := strings.Split(h.Get(HeaderWebhookSignature), " ")
	require.Len(t, entries, len(secrets), "one signature per active secret")
	for i, sec := range secrets {
		require.Equal(t, hmacSignature(t, sec, h.Get(HeaderWebhookID), h.Get(HeaderWebhookTimestamp), body), entries[i])
		wh, err := standardwebhooks.NewWebhook(sec)
		require.NoError(t, err)
		require.NoError(t, wh.VerifyIgnoringTimestamp(body, h), "library verification with secret %d alone", i)
	}
}

func TestSignatures(t *testing.T) {
	t.Parallel()
	other := newSecret(t)
	tests := []struct {
		name    string
		secrets []string
		want    string // exact header, or "" to check with verifyEach
		wantErr bool
	}{
		{name: "published test vector", secrets: []string{specSecret}, want: specSignature},
		{name: "two secrets sign twice", secrets: []string{specSecret, other}},
		{name: "no secret, no signature", secrets: nil, want: ""},
		{name: "missing prefix is accepted", secrets: []string{strings.TrimPrefix(specSecret, "whsec_")}, want: specSignature},
		{name: "empty secret", secrets: []string{"whsec_"}, wantErr: true},
		{name: "not base64", secrets: []string{specSecret, "whsec_***"}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := signatures(specMsgID, specTimestamp, []byte(specPayload), tt.secrets)
			if tt.wantErr {
				require.ErrorIs(t, err, errSecretFormat)
				require.NotContains(t, err.Error(), "***")
				return
			}
			require.NoError(t, err)
			if tt.want != "" || len(tt.secrets) == 0 {
				require.Equal(t, tt.want, got)
				return
			}
			h := http.Header{}
			h.Set(HeaderWebhookID, specMsgID)
			h.Set(HeaderWebhookTimestamp, strconv.Itoa(specTimestamp))
			h.Set(HeaderWebhookSignature, got)
			require.True(t, strings.HasPrefix(got, specSignature+" "), "the first secret's entry is the spec's")
			verifyEach(t, h, []byte(specPayload), tt.secrets...)
			third, err := standardwebhooks.NewWebhook(newSecret(t))
			require.NoError(t, err)
			require.Error(t, third.VerifyIgnoringTimestamp([]byte(specPayload), h), "a foreign secret must not verify")
		})
	}
}

func TestParseRetryAfterAndNextDelay(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	parse := []struct {
		in   string
		want time.Duration
	}{
		{"", 0},
		{"120", 2 * time.Minute},
		{" 7 ", 7 * time.Second},
		{"0", 0},
		{"-5", 0},
		{"soon", 0},
		{now.Add(90 * time.Second).Format(http.TimeFormat), 90 * time.Second},
		{now.Add(-time.Hour).Format(http.TimeFormat), 0},
		{"99999999999999", MaxRetryDelay},
	}
	for _, tt := range parse {
		require.Equal(t, tt.want, parseRetryAfter(tt.in, now), "Retry-After %q", tt.in)
	}
	delays := []time.Duration{time.Minute, 5 * time.Minute}
	next := []struct {
		name     string
		failures int
		hint     time.Duration
		want     time.Duration
		wantDead bool
	}{
		{"no hint: the schedule", 1, 0, time.Minute, false},
		{"hint within [d, 2d]", 1, 90 * time.Second, 90 * time.Second, false},
		{"hint below d: d", 1, time.Second, time.Minute, false},
		{"hint above 2d: 2d", 2, time.Hour, 10 * time.Minute, false},
		{"dead ignores the hint", 3, time.Hour, 0, true},
	}
	for _, tt := range next {
		got, dead := nextDelay(tt.failures, delays, 0, 0.5, tt.hint)
		require.Equal(t, tt.wantDead, dead, tt.name)
		require.Equal(t, tt.want, got, tt.name)
	}
}

// TestRouterScheduleOffsets checks the delivery schedule end to end: an
// always failing receiver sees six attempts, the gap before attempt k+1 is
// at least RetryDelays[k-1] (jitter 0) and at most that plus a tolerance
// for polling and scheduling, and the event is then DEAD.
func TestRouterScheduleOffsets(t *testing.T) {
	t.Parallel()
	// tolerance covers PollInterval (20ms), the claim and record round trips
	// and a loaded machine; it is not what the test measures.
	const tolerance = 600 * time.Millisecond
	h := newHarness(t)
	var (
		mu       sync.Mutex
		arrivals []time.Time
	)
	var want atomic.Value // the event id: a loopback port can be reused by another test's leftovers
	want.Store("")
	rc := newReceiver(t, func(_ int, w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("webhook-id") == want.Load().(string) {
			mu.Lock()
			arrivals = append(arrivals, time.Now())
			mu.Unlock()
		}
		w.WriteHeader(http.StatusBadGateway)
	})
	app := h.app(t, rc.URL, newSecret(t))
	id := h.event(t, app.ID)
	want.Store(id.String())
	cfg := compressedConfig()
	cfg.Jitter = 0
	cfg.RetryDelays = []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 300 * time.Millisecond,
		400 * time.Millisecond, 500 * time.Millisecond}
	out := make(chan outcome, 16)

	h.start(t, cfg, out, nil)
	await(t, out, finished(id))

	row := h.eventRow(t, id)
	require.Equal(t, pgstore.EventDead, row.Status)
	require.Equal(t, 6, row.Attempts)
	require.Equal(t, 6, row.RoundAttempts)
	atts := h.attempts(t, id)
	require.Len(t, atts, 6)
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, arrivals, 6)
	for k, d := range cfg.RetryDelays {
		gap := arrivals[k+1].Sub(arrivals[k])
		require.GreaterOrEqual(t, gap, d, "gap before attempt %d", k+2)
		require.LessOrEqual(t, gap, d+tolerance, "gap before attempt %d", k+2)
		// The recorded rows agree: attempt k+2 started at least d after
		// attempt k+1 was recorded (the due time is set from the database
		// clock in the record's transaction).
		require.GreaterOrEqual(t, atts[k+1].StartedAt.Sub(atts[k].EndedAt), d-time.Millisecond, "recorded gap %d", k+2)
		require.Equal(t, 502, *atts[k].StatusCode)
	}
}

// TestRouterGoneDisablesConsumer: a 410 makes the event DEAD after one
// attempt and disables the consumer (version-guarded); the application's
// other events then wait unclaimed until the consumer is enabled again.
func TestRouterGoneDisablesConsumer(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	rc := newReceiver(t, func(n int, w http.ResponseWriter, _ *http.Request) {
		if n == 1 {
			w.WriteHeader(http.StatusGone)
		}
	})
	app := h.app(t, rc.URL, newSecret(t))
	gone := h.event(t, app.ID)
	out := make(chan outcome, 16)

	r := h.start(t, compressedConfig(), out, nil)
	await(t, out, finished(gone))
	r.stop(t)

	row := h.eventRow(t, gone)
	require.Equal(t, pgstore.EventDead, row.Status)
	require.Equal(t, 1, row.Attempts, "DEAD at once, no retries")
	require.Equal(t, 410, *row.StatusCode)
	require.Equal(t, Stats{Failed: 1, Dead: 1, Gone: 1}, r.Stats())
	c, err := h.store.ConsumerGet(t.Context(), app.ID)
	require.NoError(t, err)
	require.False(t, c.DisabledAt.IsZero(), "consumer flagged")
	require.Equal(t, "HTTP 410 Gone", c.DisabledReason)

	waiting := h.event(t, app.ID)
	claimed, err := h.store.EventClaim(t.Context(), pgstore.EventClaimParams{
		Owner: "probe", Limit: 10, ClaimFor: time.Minute, PerApplication: 8,
	})
	require.NoError(t, err)
	require.Empty(t, claimed, "events of a disabled consumer are not claimed")
	require.Equal(t, pgstore.EventPending, h.eventRow(t, waiting).Status)

	_, err = h.store.ConsumerEnable(t.Context(), app.ID)
	require.NoError(t, err)
	h.start(t, compressedConfig(), out, nil)
	await(t, out, finished(waiting))
	require.Equal(t, pgstore.EventDelivered, h.eventRow(t, waiting).Status)
	require.Len(t, rc.requests(), 2)
}

// TestRouterGoneDoesNotDisableNewConsumer: when the consumer changed while
// the attempt that got 410 was in flight, the new consumer stays enabled.
func TestRouterGoneDoesNotDisableNewConsumer(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	arrived, answer := make(chan struct{}, 1), make(chan struct{})
	old := newReceiver(t, func(_ int, w http.ResponseWriter, _ *http.Request) {
		arrived <- struct{}{}
		<-answer
		w.WriteHeader(http.StatusGone)
	})
	fresh := newReceiver(t, func(int, http.ResponseWriter, *http.Request) {})
	secret := newSecret(t)
	app := h.app(t, old.URL, secret)
	id := h.event(t, app.ID)
	out := make(chan outcome, 16)

	h.start(t, compressedConfig(), out, nil)
	wait(t, arrived, "the attempt to the old webhook")
	h.consumer(t, app.ID, pgstore.ConsumerWebhook, fresh.URL)
	close(answer)
	await(t, out, finished(id))

	require.Equal(t, pgstore.EventDead, h.eventRow(t, id).Status)
	c, err := h.store.ConsumerGet(t.Context(), app.ID)
	require.NoError(t, err)
	require.True(t, c.DisabledAt.IsZero(), "the new configuration was not disabled by the old one's 410")
	next := h.event(t, app.ID)
	await(t, out, finished(next))
	require.Equal(t, pgstore.EventDelivered, h.eventRow(t, next).Status)
	require.Len(t, fresh.requests(), 1)
}

// TestRouterRetryAfter checks that 429 and 503 honour Retry-After (seconds
// or HTTP date) clamped to [scheduled delay, 2 × scheduled delay], and that
// other statuses ignore it. The delay is read back from the database: the
// due time and the attempt's end come from one transaction's clock.
func TestRouterRetryAfter(t *testing.T) {
	t.Parallel()
	const d = 1500 * time.Millisecond
	clock := time.Now().Truncate(time.Second)
	tests := []struct {
		name       string
		code       int
		retryAfter string
		want       time.Duration
	}{
		{"429 seconds within bounds", 429, "2", 2 * time.Second},
		{"503 seconds above 2d", 503, "10", 2 * d},
		{"429 seconds below d", 429, "1", d},
		{"429 without header", 429, "", d},
		{"503 date far ahead", 503, clock.Add(time.Hour).UTC().Format(http.TimeFormat), 2 * d},
		{"429 date in the past", 429, clock.Add(-time.Hour).UTC().Format(http.TimeFormat), d},
		{"500 ignores it", 500, "2", d},
		{"502 ignores it", 502, "2", d},
	}
	h := newHarness(t)
	want := map[uuid.UUID]time.Duration{}
	names := map[uuid.UUID]string{}
	for _, tt := range tests {
		rc := newReceiver(t, func(_ int, w http.ResponseWriter, _ *http.Request) {
			if tt.retryAfter != "" {
				w.Header().Set("Retry-After", tt.retryAfter)
			}
			w.WriteHeader(tt.code)
		})
		id := h.event(t, h.app(t, rc.URL, newSecret(t)).ID)
		want[id], names[id] = tt.want, tt.name
	}
	cfg := compressedConfig()
	cfg.Jitter = 0
	cfg.RetryDelays = []time.Duration{d, d, d, d, d}
	out := make(chan outcome, 64)

	h.start(t, cfg, out, nil, WithClock(func() time.Time { return clock }))
	seen := map[uuid.UUID]bool{}
	await(t, out, func(o outcome) bool {
		require.NoError(t, o.Err)
		if !seen[o.P.ID] {
			seen[o.P.ID] = true
			require.Equal(t, want[o.P.ID], o.P.RetryAfter, names[o.P.ID])
		}
		return len(seen) == len(tests)
	})
	for id, w := range want {
		var got time.Duration
		require.NoError(t, h.pool.QueryRow(t.Context(), `
SELECT e.next_attempt_at - a.ended_at FROM completion_events e JOIN delivery_attempts a ON a.event_id = e.id AND a.attempt = 1
 WHERE e.id = $1`, id).Scan(&got))
		require.InDelta(t, w, got, float64(time.Millisecond), names[id])
	}
}

// TestRouterSecretRotation: with two active secrets every delivery carries
// two signatures, each verifiable alone; after a rotation that retires the
// old secrets at once, only the new secret signs.
func TestRouterSecretRotation(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	rc := newReceiver(t, func(int, http.ResponseWriter, *http.Request) {})
	first, second, third := newSecret(t), newSecret(t), newSecret(t)
	app := h.app(t, "", "")
	h.consumer(t, app.ID, pgstore.ConsumerWebhook, rc.URL, first, second)
	id := h.event(t, app.ID)
	out := make(chan outcome, 16)

	h.start(t, compressedConfig(), out, nil)
	await(t, out, finished(id))
	reqs := rc.requests()
	require.Len(t, reqs, 1)
	// Newest first: both were created in one transaction, so the order
	// follows their ids; check the set rather than the order.
	sig := reqs[0].Header.Get(HeaderWebhookSignature)
	entries := strings.Split(sig, " ")
	require.Len(t, entries, 2)
	for _, sec := range []string{first, second} {
		require.Contains(t, entries, hmacSignature(t, sec, id.String(), reqs[0].Header.Get(HeaderWebhookTimestamp), reqs[0].Body))
		wh, err := standardwebhooks.NewWebhook(sec)
		require.NoError(t, err)
		require.NoError(t, wh.Verify(reqs[0].Body, reqs[0].Header))
	}

	zero := time.Duration(0)
	_, _, err := h.store.ConsumerAddSecret(t.Context(), pgstore.ConsumerAddSecretParams{
		ApplicationID: app.ID, Secret: third, RetirePreviousAfter: &zero,
	})
	require.NoError(t, err)
	next := h.event(t, app.ID)
	await(t, out, finished(next))
	reqs = rc.requests()
	require.Len(t, reqs, 2)
	verifyEach(t, reqs[1].Header, reqs[1].Body, third)
}

// TestRouterIsolation: application A's endpoint hangs with a backlog far
// larger than the per-application bound; application B's events are all
// delivered while A's backlog is still pending, and A never has more than
// PerApplicationConcurrency deliveries in flight. No timing is asserted.
func TestRouterIsolation(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	slow, arrived, open := newGatedReceiver(t)
	fast := newReceiver(t, func(int, http.ResponseWriter, *http.Request) {})
	appA, appB := h.app(t, slow.URL, newSecret(t)), h.app(t, fast.URL, newSecret(t))
	backlog := h.bulkEvents(t, appA.ID, 40) // older than every B event
	bEvents := map[uuid.UUID]bool{}
	for _, id := range h.bulkEvents(t, appB.ID, 20) {
		bEvents[id] = true
	}
	cfg := compressedConfig()
	cfg.Concurrency, cfg.PerApplicationConcurrency, cfg.BatchSize = 6, 2, 6
	cfg.Timeout, cfg.ClaimTTL = time.Minute, 2*time.Minute
	out := make(chan outcome, 128)

	h.start(t, cfg, out, nil)
	for range cfg.PerApplicationConcurrency {
		wait(t, arrived, "A's deliveries to hang")
	}
	await(t, out, func(o outcome) bool {
		require.NoError(t, o.Err)
		require.True(t, bEvents[o.P.ID] && o.P.Delivered, "unexpected outcome %+v", o.P)
		delete(bEvents, o.P.ID)
		return len(bEvents) == 0
	})

	require.Equal(t, 20, h.countStatus(t, appB.ID, pgstore.EventDelivered))
	require.Equal(t, len(backlog), h.countStatus(t, appA.ID, pgstore.EventPending), "A's backlog is still pending")
	require.Len(t, slow.requests(), cfg.PerApplicationConcurrency, "A never exceeds its bound")
	open()
}

// TestRouterKilledMidDelivery: a router that dies after the receiver got
// the event, or right after claiming it, records nothing; once its claim
// expires another router delivers the event again with the same id, and the
// event is recorded exactly once.
func TestRouterKilledMidDelivery(t *testing.T) {
	t.Parallel()
	const claimFor = time.Second
	tests := []struct {
		name string
		// die plays the router that dies; it returns once it is dead.
		die          func(t *testing.T, h *harness, rc *receiver, arrived <-chan struct{})
		wantRequests int
	}{
		{name: "died after delivering", wantRequests: 2, die: func(t *testing.T, h *harness, _ *receiver, arrived <-chan struct{}) {
			cfg := compressedConfig()
			cfg.Timeout, cfg.ClaimTTL = 500*time.Millisecond, claimFor
			out := make(chan outcome, 4)
			doomed := h.start(t, cfg, out, nil, WithWorkerID("doomed"),
				withVanish(func(pgstore.EventDelivery) bool { return true }))
			wait(t, arrived, "the doomed router's delivery")
			doomed.stop(t)
			require.Empty(t, out, "the doomed router recorded nothing")
		}},
		{name: "died after claiming", wantRequests: 1, die: func(t *testing.T, h *harness, _ *receiver, _ <-chan struct{}) {
			claimed, err := h.store.EventClaim(t.Context(), pgstore.EventClaimParams{
				Owner: "doomed", Limit: 10, ClaimFor: claimFor, PerApplication: 8,
			})
			require.NoError(t, err)
			require.Len(t, claimed, 1)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t)
			arrived := make(chan struct{}, 4)
			rc := newReceiver(t, func(int, http.ResponseWriter, *http.Request) { arrived <- struct{}{} })
			secret := newSecret(t)
			id := h.event(t, h.app(t, rc.URL, secret).ID)

			tt.die(t, h, rc, arrived)
			require.Equal(t, pgstore.EventPending, h.eventRow(t, id).Status)
			out := make(chan outcome, 4)
			survivor := h.start(t, compressedConfig(), out, nil, WithWorkerID("survivor"))
			await(t, out, finished(id))

			row := h.eventRow(t, id)
			require.Equal(t, pgstore.EventDelivered, row.Status)
			require.Equal(t, 1, row.Attempts)
			require.Len(t, h.attempts(t, id), 1, "recorded once")
			reqs := rc.requests()
			require.Len(t, reqs, tt.wantRequests)
			for _, req := range reqs {
				require.Equal(t, id.String(), req.Header.Get(HeaderWebhookID), "the same id on every delivery")
				verifySignature(t, secret, req.Header, req.Body)
			}
			require.Equal(t, Stats{Delivered: 1}, survivor.Stats())
		})
	}
}

// TestRouterConsumerChangeDuringDelivery: an attempt in flight when the
// consumer changes uses the configuration it claimed and is recorded once;
// the next event uses the new configuration.
func TestRouterConsumerChangeDuringDelivery(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	old, arrived, open := newGatedReceiver(t)
	fresh := newReceiver(t, func(int, http.ResponseWriter, *http.Request) {})
	app := h.app(t, old.URL, newSecret(t))
	before, err := h.store.ConsumerGet(t.Context(), app.ID)
	require.NoError(t, err)
	inFlight := h.event(t, app.ID)
	out := make(chan outcome, 16)

	h.start(t, compressedConfig(), out, nil)
	wait(t, arrived, "the delivery to the old webhook")
	after := h.consumer(t, app.ID, pgstore.ConsumerWebhook, fresh.URL, newSecret(t))
	later := h.event(t, app.ID)
	await(t, out, finished(later))
	open()
	await(t, out, finished(inFlight))

	for _, c := range []struct {
		id      uuid.UUID
		version int64
	}{{inFlight, before.Version}, {later, after.Version}} {
		require.Equal(t, pgstore.EventDelivered, h.eventRow(t, c.id).Status)
		atts := h.attempts(t, c.id)
		require.Len(t, atts, 1, "recorded once")
		require.Equal(t, "webhook", atts[0].ConsumerKind)
		require.Equal(t, c.version, *atts[0].ConsumerVersion)
	}
	require.Len(t, old.requests(), 1)
	require.Equal(t, inFlight.String(), old.requests()[0].Header.Get(HeaderWebhookID))
	require.Len(t, fresh.requests(), 1)
	require.Equal(t, later.String(), fresh.requests()[0].Header.Get(HeaderWebhookID))
}

// TestRouterReplay: dead events replayed (all of an application since a
// time) are delivered with their original ids, their schedule started over
// and their history kept; a DELIVERED event is replayed only when forced.
func TestRouterReplay(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	var failing atomic.Bool
	failing.Store(true)
	rc := newReceiver(t, func(_ int, w http.ResponseWriter, _ *http.Request) {
		if failing.Load() {
			w.WriteHeader(http.StatusInternalServerError)
		}
	})
	app := h.app(t, rc.URL, newSecret(t))
	since, err := h.store.Now(t.Context())
	require.NoError(t, err)
	ids := []uuid.UUID{h.event(t, app.ID), h.event(t, app.ID)}
	out := make(chan outcome, 64)

	h.start(t, compressedConfig(), out, nil)
	dead := map[uuid.UUID]bool{}
	await(t, out, func(o outcome) bool {
		require.NoError(t, o.Err)
		if o.P.Dead {
			dead[o.P.ID] = true
		}
		return len(dead) == len(ids)
	})

	failing.Store(false)
	n, err := h.store.EventReplayDead(t.Context(), app.ID, since)
	require.NoError(t, err)
	require.EqualValues(t, len(ids), n)
	delivered := map[uuid.UUID]bool{}
	await(t, out, func(o outcome) bool {
		require.NoError(t, o.Err)
		require.True(t, o.P.Delivered, "%+v", o.P)
		delivered[o.P.ID] = true
		return len(delivered) == len(ids)
	})
	for _, id := range ids {
		row := h.eventRow(t, id)
		require.Equal(t, pgstore.EventDelivered, row.Status)
		require.Equal(t, 7, row.Attempts, "history kept")
		require.Equal(t, 1, row.RoundAttempts, "schedule started over")
		require.Equal(t, 1, row.Replays)
		atts := h.attempts(t, id)
		require.Len(t, atts, 7)
		for i, a := range atts {
			require.Equal(t, i+1, a.Attempt)
			require.Equal(t, map[bool]int{true: 1, false: 0}[i == 6], a.Replay)
		}
	}
	got := map[string]int{}
	for _, req := range rc.requests() {
		got[req.Header.Get(HeaderWebhookID)]++
	}
	require.Equal(t, map[string]int{ids[0].String(): 7, ids[1].String(): 7}, got, "original ids on every delivery")

	_, err = h.store.EventReplay(t.Context(), ids[0], false)
	require.ErrorIs(t, err, execution.ErrConflict, "a DELIVERED event is not replayed unless forced")
	_, err = h.store.EventReplay(t.Context(), ids[0], true)
	require.NoError(t, err)
	await(t, out, finished(ids[0]))
	row := h.eventRow(t, ids[0])
	require.Equal(t, pgstore.EventDelivered, row.Status)
	require.Equal(t, 8, row.Attempts)
	require.Equal(t, 2, row.Replays)
}

// TestRouterJitter: the delay after a failure is spread by ±Jitter with
// the router's random source (here pinned to both ends of the spread).
func TestRouterJitter(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		u    float64
		want time.Duration
	}{{0, 500 * time.Millisecond}, {1, 1500 * time.Millisecond}} {
		t.Run(fmt.Sprint(tt.u), func(t *testing.T) {
			t.Parallel()
			h := newHarness(t)
			rc := newReceiver(t, func(_ int, w http.ResponseWriter, _ *http.Request) { w.WriteHeader(500) })
			id := h.event(t, h.app(t, rc.URL, newSecret(t)).ID)
			cfg := compressedConfig()
			cfg.Jitter = 0.5
			cfg.RetryDelays = []time.Duration{time.Second}
			out := make(chan outcome, 4)

			h.start(t, cfg, out, nil, withRand(func() float64 { return tt.u }))
			o := wait(t, out, "the first attempt")
			require.Equal(t, id, o.P.ID)
			require.Equal(t, tt.want, o.P.RetryAfter)
		})
	}
}
