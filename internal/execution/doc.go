// Package execution is Capstan's domain core: the execution state machine
// (SYSTEM §3), failure classes, and the release policy that decides retries,
// attempt ceilings and budgets (SYSTEM §4). It does no I/O and imports no
// driver: storage, Kafka and gRPC adapt to it at the edges.
//
// # State machine
//
//	from                         to                 by                           guard (all in the UPDATE's WHERE)
//	—                            QUEUED             gateway accept (async)       insert with dispatch record for attempt 1
//	QUEUED / RETRY_SCHEDULED     RUNNING            consumer starts attempt N    status as read AND attempt = N-1
//	RUNNING                      WAITING_EXTERNAL   consumer parks on await unit attempt = N AND lease token
//	RUNNING / WAITING_EXTERNAL   RETRY_SCHEDULED    retryable failure, reaper    attempt = N AND lease token; dispatch record N+1 in the same tx
//	any non-terminal             terminal           settlement                   version as read (or attempt + lease token); completion event in the same tx
//
// Terminal statuses (SUCCEEDED, FAILED, TIMED_OUT, CANCELLED) are never left.
// Every update increments version. A writer that matches zero rows has lost
// the race: it changes nothing, writes no event, logs and counts it, and
// never retries or reports an error to the end user.
//
// # Invariants
//
//   - An execution has at most one completion event (also enforced by a
//     unique index on completion_events.execution_id).
//   - Attempt numbers start at 1 and grow by one; an attempt starts only
//     from the attempt before it, so a duplicate or obsolete dispatch
//     cannot start an attempt twice.
//   - A worker whose lease token no longer matches cannot renew, settle or
//     schedule: every write is fenced by (attempt, lease token).
package execution
