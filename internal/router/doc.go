// Package router is the event router daemon (SYSTEM §4 hop 6): it delivers
// each completion event to the consumer its application registered, retrying
// failed deliveries with queued backoff until the event is DELIVERED or DEAD.
//
// # Overview
//
// [Router.Run] claims due PENDING events in batches (pgstore.EventClaim,
// FOR UPDATE SKIP LOCKED, so any number of replicas share the work) and
// delivers each one in its own goroutine, at most config.Router.Concurrency
// at a time per process and at most config.Router.PerApplicationConcurrency
// in flight per application (counted through unexpired claims, so across
// replicas). The claim fills a batch least-loaded application first, so one
// application's backlog or dead endpoint never delays another's.
//
// The consumer is read with the claim, so a change made through the admin
// API applies to every attempt claimed after it commits; an attempt in
// flight finishes with the configuration it claimed and is recorded once.
// Consumers are of three kinds:
//
//   - webhook: an HTTP POST of the stored payload (protobuf JSON of
//     capstan.event.v1.CompletionEvent) signed per Standard Webhooks:
//     webhook-id (the event id, stable across retries and replays),
//     webhook-timestamp (Unix seconds of this attempt) and webhook-signature,
//     one "v1,<base64 HMAC-SHA256 over id.timestamp.body>" per active
//     signing secret, space-separated, so secrets rotate without downtime.
//   - kafka: a record on the application's topic, key = execution id, value
//     = the payload, headers webhook-id, webhook-timestamp,
//     webhook-signature (with secrets), content-type, capstan-event-type.
//   - grpc: a call of capstan.event.v1.EventConsumerService/Deliver with the
//     same metadata, the signature covering DeliverRequest.payload.
//
// Each attempt, successful or not, is recorded with
// pgstore.EventRecordResult, guarded by the claim token, with its status
// code, error, and the consumer kind and version it used.
//
// # Invariants
//
//   - Delivery is at least once: an event whose router dies mid-delivery is
//     claimed again after config.Router.ClaimTTL and delivered with the same
//     id; receivers deduplicate by webhook-id.
//   - A 2xx answer (gRPC OK, Kafka acknowledgement) within
//     config.Router.Timeout is the only success. Redirects are never
//     followed.
//   - The k-th failed attempt of a delivery round (k ≤ len(RetryDelays))
//     schedules the next after RetryDelays[k-1] ± Jitter ([RetryAfter]);
//     failure number len(RetryDelays)+1 makes the event DEAD (kept,
//     replayable). A 429 or 503 with Retry-After (seconds or HTTP date) moves
//     the next attempt to the hint clamped to [delay, 2 × delay].
//   - A 410 Gone makes the event DEAD at once and disables the consumer
//     (only if it is still the version the attempt used); the application's
//     other events wait as PENDING until the consumer is enabled again.
//   - A replay (pgstore.EventReplay, EventReplayDead) starts a new delivery
//     round with the same event id: the schedule restarts, the attempt
//     history and numbering continue.
//   - With config.Router.AllowPrivateAddresses false, connections to
//     loopback, private, link-local and other non-public addresses are
//     refused at dial time, after DNS resolution, so DNS rebinding cannot
//     bypass the check (webhooks and gRPC consumers).
//   - Signing secrets are stored encrypted (AES-256-GCM under
//     config.Router.SecretKey, bound to the application); the router seals
//     plaintext ones it finds (registered without the key) every minute.
//     With no key configured (development) secrets stay in plaintext and the
//     router logs a warning at start.
//
// # Failure modes
//
//   - Database errors while claiming are logged and ridden out with
//     exponential backoff; Run does not return because of them.
//   - Recording an attempt is retried with backoff while the claim lasts. A
//     record that loses its claim (execution.ErrConflict: another router
//     took the event after the claim expired) is logged at info, counted in
//     [Stats.Conflicts] and not retried.
//   - A secret that cannot be decrypted (no key, wrong key) is a failed
//     attempt naming the cause; nothing unsigned is sent.
//   - Payloads, URLs and secrets are never logged. The recorded error holds
//     at most 256 bytes of the receiver's response body.
//
// # Metrics
//
// OpenTelemetry instruments (MetricDeliveries, MetricDeliveryLatency,
// MetricDead, MetricPendingOldestAge, MetricPendingEvents) go to the
// provider given with [WithMeterProvider]; Main uses the global provider, a
// no-op unless the process installs one. [Router.Stats] is a snapshot of the
// same counts for tests and logs.
package router
