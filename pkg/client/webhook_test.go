package client_test

import (
	"encoding/base64"
	"errors"
	"net/http"
	"strconv"
	"testing"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/capstan-dev/capstan/pkg/client"
	eventv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/event/v1"
	executionv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/execution/v1"
)

var testSecret = "whsec_" + base64.StdEncoding.EncodeToString([]byte("0123456789abcdef0123456789abcdef"))

func testEvent() *eventv1.CompletionEvent {
	return &eventv1.CompletionEvent{
		EventId:           "7d6f2a0e-1111-4c1e-9a55-2d4b5d1e0001",
		Type:              "execution.succeeded",
		ExecutionId:       "7d6f2a0e-2222-4c1e-9a55-2d4b5d1e0002",
		Capability:        "payments.send",
		Status:            executionv1.ExecutionStatus_EXECUTION_STATUS_SUCCEEDED,
		Attempts:          2,
		Output:            []byte(`{"fee":"1.00"}`),
		OutputContentType: "application/json",
		IdempotencyKey:    "csv-payments:abc:1",
	}
}

// sign returns headers signing body as event id at ts with secret.
func sign(t testing.TB, secret, id string, ts time.Time, body []byte) http.Header {
	t.Helper()
	wh, err := standardwebhooks.NewWebhook(secret)
	if err != nil {
		t.Fatal(err)
	}
	sig, err := wh.Sign(id, ts, body)
	if err != nil {
		t.Fatal(err)
	}
	h := http.Header{}
	h.Set(client.HeaderWebhookID, id)
	h.Set(client.HeaderWebhookTimestamp, strconv.FormatInt(ts.Unix(), 10))
	h.Set(client.HeaderWebhookSignature, sig)
	return h
}

func TestVerifyAccepts(t *testing.T) {
	t.Parallel()
	v, err := client.NewEventVerifier(testSecret)
	if err != nil {
		t.Fatal(err)
	}
	ev := testEvent()
	body, err := protojson.Marshal(ev)
	if err != nil {
		t.Fatal(err)
	}
	got, err := v.Verify(sign(t, testSecret, ev.GetEventId(), time.Now(), body), body)
	if err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(got, ev) {
		t.Errorf("got %v, want %v", got, ev)
	}

	// Unknown fields from a newer sender are ignored.
	newer := []byte(`{"eventId":"` + ev.GetEventId() + `","executionId":"x","futureField":{"a":1}}`)
	got, err = v.Verify(sign(t, testSecret, ev.GetEventId(), time.Now(), newer), newer)
	if err != nil {
		t.Fatal(err)
	}
	if got.GetExecutionId() != "x" {
		t.Errorf("execution id = %q", got.GetExecutionId())
	}
}

func TestVerifyRefuses(t *testing.T) {
	t.Parallel()
	ev := testEvent()
	body, err := protojson.Marshal(ev)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	otherSecret := "whsec_" + base64.StdEncoding.EncodeToString([]byte("another secret of 32 bytes......"))
	tampered := append([]byte(nil), body...)
	tampered[len(tampered)-2] ^= 0x01

	cases := []struct {
		name    string
		headers http.Header
		body    []byte
		want    error
	}{
		{"tampered body", sign(t, testSecret, ev.GetEventId(), now, body), tampered, client.ErrSignature},
		{"wrong secret", sign(t, otherSecret, ev.GetEventId(), now, body), body, client.ErrSignature},
		{"old timestamp", sign(t, testSecret, ev.GetEventId(), now.Add(-10*time.Minute), body), body, client.ErrTimestamp},
		{"future timestamp", sign(t, testSecret, ev.GetEventId(), now.Add(10*time.Minute), body), body, client.ErrTimestamp},
		{"no headers", http.Header{}, body, client.ErrSignature},
		{"other id", func() http.Header {
			h := sign(t, testSecret, ev.GetEventId(), now, body)
			h.Set(client.HeaderWebhookID, "another-id")
			return h
		}(), body, client.ErrSignature},
		{"id mismatch though signed", sign(t, testSecret, "another-id", now, body), body, client.ErrEventBody},
		{"not json", sign(t, testSecret, "e1", now, []byte("not json")), []byte("not json"), client.ErrEventBody},
		{"no event id", sign(t, testSecret, "e1", now, []byte(`{}`)), []byte(`{}`), client.ErrEventBody},
		{"bad timestamp header", func() http.Header {
			h := sign(t, testSecret, ev.GetEventId(), now, body)
			h.Set(client.HeaderWebhookTimestamp, "soon")
			return h
		}(), body, client.ErrSignature},
	}
	v, err := client.NewEventVerifier(testSecret)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := v.Verify(tc.headers, tc.body)
			if !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
			if got != nil {
				t.Errorf("event returned with error: %v", got)
			}
		})
	}
}

func TestVerifyTolerance(t *testing.T) {
	t.Parallel()
	ev := testEvent()
	body, _ := protojson.Marshal(ev)
	signedAt := time.Unix(1_700_000_000, 0)
	h := sign(t, testSecret, ev.GetEventId(), signedAt, body)

	v, err := client.NewEventVerifier(testSecret,
		client.WithTolerance(time.Minute),
		client.WithClock(func() time.Time { return signedAt.Add(59 * time.Second) }))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := v.Verify(h, body); err != nil {
		t.Errorf("within tolerance: %v", err)
	}
	v, _ = client.NewEventVerifier(testSecret,
		client.WithTolerance(time.Minute),
		client.WithClock(func() time.Time { return signedAt.Add(61 * time.Second) }))
	if _, err := v.Verify(h, body); !errors.Is(err, client.ErrTimestamp) {
		t.Errorf("outside tolerance: %v", err)
	}
}

func TestNewEventVerifierSecret(t *testing.T) {
	t.Parallel()
	for _, s := range []string{"", "whsec_", "whsec_%%%not base64"} {
		if _, err := client.NewEventVerifier(s); !errors.Is(err, client.ErrInvalidSecret) {
			t.Errorf("NewEventVerifier(%q) err = %v", s, err)
		}
	}
	// The prefix is optional.
	raw := testSecret[len("whsec_"):]
	if _, err := client.NewEventVerifier(raw); err != nil {
		t.Errorf("unprefixed secret: %v", err)
	}
}

func FuzzVerify(f *testing.F) {
	ev := testEvent()
	body, _ := protojson.Marshal(ev)
	now := time.Now()
	h := sign(f, testSecret, ev.GetEventId(), now, body)
	f.Add(h.Get(client.HeaderWebhookID), h.Get(client.HeaderWebhookTimestamp), h.Get(client.HeaderWebhookSignature), body)
	f.Add("", "", "", []byte{})
	f.Add("id", "-9223372036854775808", "v1,AAAA v2,x ,", []byte(`{"eventId":"id"}`))
	f.Add("id", "9223372036854775807", "v1", []byte(`{"eventId":`))
	hb := sign(f, testSecret, "e", now, []byte(`{"eventId":"e","status":"bogus"}`))
	f.Add("e", hb.Get(client.HeaderWebhookTimestamp), hb.Get(client.HeaderWebhookSignature), []byte(`{"eventId":"e","status":"bogus"}`))

	v, err := client.NewEventVerifier(testSecret)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, id, ts, sig string, body []byte) {
		h := http.Header{}
		h.Set(client.HeaderWebhookID, id)
		h.Set(client.HeaderWebhookTimestamp, ts)
		h.Set(client.HeaderWebhookSignature, sig)
		got, err := v.Verify(h, body)
		if (got == nil) == (err == nil) {
			t.Fatalf("exactly one of event and error must be set: %v, %v", got, err)
		}
		if err == nil && got.GetEventId() != id {
			t.Fatalf("accepted event id %q for header %q", got.GetEventId(), id)
		}
	})
}
