package consumer_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/gateway"
	"github.com/capstan-dev/capstan/internal/kafka"
	"github.com/capstan-dev/capstan/pkg/adapter"
	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
)

const partnerSecret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"

func noAdapter(*adapterv1.ExecuteRequest) (*adapterv1.ExecuteResponse, error) {
	panic("an await step must not call the adapter")
}

// TestWebhookTransport: requests are POSTed to the partner signed with the
// shared secret; the partner completes through the gateway's endpoint; a
// forged or repeated completion changes nothing.
func TestWebhookTransport(t *testing.T) {
	t.Parallel()
	requests := make(chan adapter.InteractionRequest, 100)
	partner := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if err := adapter.VerifyWebhook(r.Header, partnerSecret, body, time.Now(), time.Minute); err != nil {
			http.Error(w, err.Error(), http.StatusUnauthorized)
			return
		}
		var req adapter.InteractionRequest
		if err := json.Unmarshal(body, &req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		requests <- req
		w.WriteHeader(http.StatusAccepted)
	}))
	defer partner.Close()
	var handler atomic.Pointer[gateway.CompletionHandler]
	gw := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { handler.Load().ServeHTTP(w, r) }))
	defer gw.Close()

	p := startPipeline(t, noAdapter, withCallbacks, func(c *config.Config) {
		c.Gateway.PublicURL = gw.URL
		c.Capabilities[0].Await = &config.AwaitStep{Transport: "webhook", URL: partner.URL, Secret: partnerSecret, Timeout: time.Minute}
	})
	handler.Store(gateway.NewCompletionHandler(p.store, p.cfg, slog.New(slog.DiscardHandler)))
	ids := p.invoke(t, 3)

	post := func(c adapter.InteractionCompletion, secret string) int {
		body, _ := json.Marshal(c)
		req, _ := http.NewRequest(http.MethodPost, gw.URL+adapter.CompletionPath, bytes.NewReader(body))
		require.NoError(t, adapter.SignWebhook(req.Header, secret, uuid.NewString(), time.Now(), body))
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		return resp.StatusCode
	}
	for range ids {
		var req adapter.InteractionRequest
		select {
		case req = <-requests:
		case <-time.After(30 * time.Second):
			t.Fatal("no interaction request reached the partner")
		}
		require.True(t, len(req.CompletionURL) > 0 && req.CompletionURL == gw.URL+adapter.CompletionPath)
		done := adapter.InteractionCompletion{ResumeToken: req.ResumeToken, Result: &adapter.CompletionResult{Output: []byte(`{"paid":true}`)}}
		forged := "whsec_" + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo0NTY3"
		require.Equal(t, http.StatusUnauthorized, post(done, forged), "a forged signature is refused")
		tampered := done
		tampered.ResumeToken = req.ResumeToken[:len(req.ResumeToken)-2] + "xx"
		require.Equal(t, http.StatusUnauthorized, post(tampered, partnerSecret), "a bad resume token is refused")
		require.Equal(t, http.StatusOK, post(done, partnerSecret))
		require.Equal(t, http.StatusOK, post(done, partnerSecret), "an identical repeat is a duplicate")
		other := adapter.InteractionCompletion{ResumeToken: req.ResumeToken, Failure: &adapter.CompletionFailure{Class: "payment.declined"}}
		require.Equal(t, http.StatusConflict, post(other, partnerSecret), "a different completion after the first is refused")
	}
	settled := p.waitSettled(t, ids)
	for _, id := range ids {
		require.Equal(t, execution.StatusSucceeded, settled[id].Status)
		require.Equal(t, `{"paid":true}`, string(settled[id].Output))
	}
	require.Equal(t, 3, p.count(t, `SELECT count(*) FROM completion_events`))
	require.Equal(t, 3, p.count(t, `SELECT count(*) FROM interactions WHERE status = 'COMPLETED' AND transport = 'webhook'`))
	require.Positive(t, p.count(t, `SELECT count(*) FROM completion_refusals`), "refusals are counted")
}

// TestKafkaTransport: requests go to the request topic keyed by correlation
// id; completions on the response topic are admitted once, even when
// redelivered, and garbage on the topic is dropped without blocking it.
func TestKafkaTransport(t *testing.T) {
	t.Parallel()
	p := startPipeline(t, noAdapter, withCallbacks, func(c *config.Config) {
		c.Capabilities[0].Await = &config.AwaitStep{Transport: "kafka", RequestTopic: "pay.requests", ResponseTopic: "pay.responses", Timeout: time.Minute}
	})
	logger := slog.New(slog.DiscardHandler)
	partner, err := kafka.NewClient(p.brokers, logger, kgo.ConsumeTopics("pay.requests"), kgo.ConsumerGroup("partner"),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.AllowAutoTopicCreation(), kgo.FetchMaxWait(100*time.Millisecond))
	require.NoError(t, err)
	defer partner.Close()
	ids := p.invoke(t, 4)

	var mu sync.Mutex
	seen := map[string]bool{}
	var completions []*kgo.Record
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for len(seen) < len(ids) {
		fetches := partner.PollFetches(ctx)
		require.NoError(t, ctx.Err(), "requests arrive on the request topic")
		fetches.EachRecord(func(r *kgo.Record) {
			var req adapter.InteractionRequest
			require.NoError(t, json.Unmarshal(r.Value, &req))
			require.Equal(t, req.CorrelationID, string(r.Key), "keyed by correlation id")
			mu.Lock()
			seen[req.InteractionID] = true
			mu.Unlock()
			body, _ := json.Marshal(adapter.InteractionCompletion{ResumeToken: req.ResumeToken, CorrelationID: req.CorrelationID,
				Result: &adapter.CompletionResult{Output: []byte(`{"via":"kafka"}`)}})
			completions = append(completions, &kgo.Record{Topic: "pay.responses", Key: r.Key, Value: body})
		})
	}
	// Garbage first, then every completion twice (a redelivery).
	out := []*kgo.Record{{Topic: "pay.responses", Value: []byte("not json")}}
	out = append(out, completions...)
	out = append(out, completions...)
	require.NoError(t, partner.ProduceSync(ctx, out...).FirstErr())

	settled := p.waitSettled(t, ids)
	for _, id := range ids {
		require.Equal(t, execution.StatusSucceeded, settled[id].Status)
		require.Equal(t, `{"via":"kafka"}`, string(settled[id].Output))
	}
	require.Equal(t, 4, p.count(t, `SELECT count(*) FROM completion_events`))
	require.Equal(t, 4, p.count(t, `SELECT count(*) FROM interactions WHERE status = 'COMPLETED'`))
}

// TestCompletionAfterConsumerDied: the consumer parks and sends the
// interaction, then dies; the partner's completion still reaches the
// gateway, and the execution settles exactly once without it.
func TestCompletionAfterConsumerDied(t *testing.T) {
	t.Parallel()
	requests := make(chan adapter.InteractionRequest, 10)
	partner := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var req adapter.InteractionRequest
		_ = json.Unmarshal(body, &req)
		requests <- req
		w.WriteHeader(http.StatusAccepted)
	}))
	defer partner.Close()
	var handler atomic.Pointer[gateway.CompletionHandler]
	gw := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { handler.Load().ServeHTTP(w, r) }))
	defer gw.Close()
	p := startPipeline(t, noAdapter, withCallbacks, func(c *config.Config) {
		c.Gateway.PublicURL = gw.URL
		c.Capabilities[0].Await = &config.AwaitStep{Transport: "webhook", URL: partner.URL, Secret: partnerSecret, Timeout: time.Minute}
	})
	handler.Store(gateway.NewCompletionHandler(p.store, p.cfg, slog.New(slog.DiscardHandler)))
	ids := p.invoke(t, 1)
	var req adapter.InteractionRequest
	select {
	case req = <-requests:
	case <-time.After(30 * time.Second):
		t.Fatal("no interaction request reached the partner")
	}
	require.Eventually(t, func() bool {
		return p.count(t, `SELECT count(*) FROM interactions WHERE status = 'DISPATCHED'`) == 1
	}, 10*time.Second, 10*time.Millisecond)
	p.stopDaemons() // the consumer dies after dispatching

	body, _ := json.Marshal(adapter.InteractionCompletion{ResumeToken: req.ResumeToken, Result: &adapter.CompletionResult{Output: []byte(`{"late":true}`)}})
	for range 2 { // the partner retries once more: a duplicate
		hr, _ := http.NewRequest(http.MethodPost, req.CompletionURL, bytes.NewReader(body))
		require.NoError(t, adapter.SignWebhook(hr.Header, partnerSecret, uuid.NewString(), time.Now(), body))
		resp, err := http.DefaultClient.Do(hr)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}
	e, err := p.store.ExecutionGet(context.Background(), uuid.Nil, ids[0])
	require.NoError(t, err)
	require.Equal(t, execution.StatusSucceeded, e.Status)
	require.Equal(t, `{"late":true}`, string(e.Output))
	require.Equal(t, 1, p.count(t, `SELECT count(*) FROM completion_events`))
	require.Equal(t, 1, p.count(t, `SELECT count(*) FROM interactions`), "the interaction was never sent twice into two rows")
}
