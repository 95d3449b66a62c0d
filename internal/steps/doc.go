// Package steps runs releases declared as steps (SYSTEM §6): a source
// object parsed lazily (CSV or JSON Lines), an await step with a cardinality
// and a window over the webhook, kafka or interaction-api transport, an
// optional per-item map through an adapter, and Object Publish of the
// terminal items.
//
// # Live session
//
// An attempt opens (or, after a retry, adopts) the step's await unit and
// parks the execution on it in WAITING_EXTERNAL, holding a lease it renews.
// It then reads the source one item at a time and opens one interaction per
// item (ONE_TO_ONE), sending it at once, while at most Window items are
// open and not yet consumed; the next item is read only when the oldest is
// consumed, so memory is bounded by the window, not by the file.
// Completions are admitted by whichever process receives them, recorded
// durably and announced with a PostgreSQL notification (pgstore.ItemsChannel);
// the Hub wakes the session, which reads the outcomes, and the items are
// consumed in input order: mapped, rendered and streamed into the output
// object's write session. The execution settles SUCCEEDED only after the
// object is committed (atomically, under its final key).
//
// # Durable fallback
//
// The interactions are keyed by (unit, item index) and belong to the
// execution, not to the attempt. If the session dies, its lease expires, the
// reaper schedules the next attempt, and that attempt replays the source:
// items already completed are fed from their stored completions, items
// already sent are awaited, not re-sent; only items never sent (or left
// half-sent by the dead session, after their claim expires) are sent, with
// the same interaction id. No item ever gets a second interaction and the
// output holds each item once, in input order.
package steps
