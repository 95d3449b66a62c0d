// Package router is the event router daemon (SYSTEM §4 hop 6): it delivers
// each completion event to the webhook its application registered, retrying
// failed deliveries with queued backoff until the event is DELIVERED or DEAD.
//
// # Overview
//
// [Router.Run] claims due PENDING events in batches (pgstore.EventClaim,
// FOR UPDATE SKIP LOCKED, so any number of replicas share the work) and
// delivers each one in its own goroutine, at most config.Router.Concurrency
// at a time per process. A delivery is an HTTP POST of the stored payload
// (protobuf JSON of capstan.event.v1.CompletionEvent) signed per Standard
// Webhooks: headers webhook-id (the event id, stable across retries),
// webhook-timestamp (Unix seconds) and webhook-signature
// ("v1,<base64 HMAC-SHA256 over id.timestamp.body>"). Each attempt, successful
// or not, is recorded with pgstore.EventRecordResult, guarded by the claim
// token.
//
// # Invariants
//
//   - Delivery is at least once: an event whose router dies mid-delivery is
//     claimed again after config.Router.ClaimTTL; receivers deduplicate by
//     webhook-id.
//   - A 2xx response is the only success. Redirects are never followed.
//   - The k-th failed attempt (k ≤ len(RetryDelays)) schedules the next one
//     after RetryDelays[k-1] ± Jitter ([RetryAfter]); failure number
//     len(RetryDelays)+1 makes the event DEAD (kept, replayable).
//   - With config.Router.AllowPrivateAddresses false, connections to
//     loopback, private, link-local and other non-public addresses are
//     refused at dial time, after DNS resolution, so DNS rebinding cannot
//     bypass the check.
//
// # Failure modes
//
//   - Database errors while claiming are logged and ridden out with
//     exponential backoff; Run does not return because of them.
//   - Recording an attempt is retried with backoff while the claim lasts. A
//     record that loses its claim (execution.ErrConflict: another router
//     took the event after the claim expired) is logged at info, counted in
//     [Stats.Conflicts] and not retried.
//   - Payloads, webhook URLs and secrets are never logged. The recorded
//     error holds at most 256 bytes of the receiver's response body.
package router
