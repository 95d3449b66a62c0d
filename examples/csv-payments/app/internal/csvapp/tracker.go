package csvapp

import (
	"strings"
	"sync"
	"time"

	"github.com/capstan-dev/capstan/examples/csv-payments/payment"
	"github.com/capstan-dev/capstan/pkg/client"
	eventv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/event/v1"
	executionv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/execution/v1"
)

// Row statuses written to the output besides the execution statuses
// (SUCCEEDED, FAILED, TIMED_OUT, CANCELLED).
const (
	// StatusRejected: the gateway refused the invoke (for example
	// INVALID_ARGUMENT); no execution exists.
	StatusRejected = "REJECTED"
	// StatusPending: the run ended (timeout) before the row had an outcome.
	StatusPending = "PENDING"
)

// maxPollGap bounds the back-off between two polls of the same row.
const maxPollGap = 30 * time.Second

// outcome is a row's result as written to the output.
type outcome struct {
	Status            string
	ProviderReference string
	Fee               string
	FailureClass      string
	FailureMessage    string
	Attempts          int32
}

// row is one input row and what is known about its execution.
type row struct {
	payment     payment.Payment
	key         string // idempotency key
	input       []byte // capability input (JSON)
	executionID string
	nextPoll    time.Time
	pollGap     time.Duration
	done        bool
	out         outcome
}

// tracker holds every row's state; it is safe for concurrent use.
type tracker struct {
	pendingAfter time.Duration
	maxOrphans   int

	mu         sync.Mutex
	rows       []*row
	byExec     map[string]int
	orphans    map[string]*eventv1.CompletionEvent // events that arrived before their invoke answer
	seenEvents map[string]string                   // event id → execution id
	pending    int
	done       chan struct{}

	invokedNew, invokedDuplicate int
	duplicateEvents              int
}

// newTracker returns a tracker for rows whose invoke answers become due
// for a safety-net poll pendingAfter after they arrive.
func newTracker(rows []*row, pendingAfter time.Duration) *tracker {
	t := &tracker{
		pendingAfter: pendingAfter,
		maxOrphans:   len(rows) + 1024,
		rows:         rows,
		byExec:       make(map[string]int, len(rows)),
		orphans:      make(map[string]*eventv1.CompletionEvent),
		seenEvents:   make(map[string]string, len(rows)),
		pending:      len(rows),
		done:         make(chan struct{}),
	}
	if t.pending == 0 {
		close(t.done)
	}
	return t
}

// Done is closed when every row has an outcome.
func (t *tracker) Done() <-chan struct{} { return t.done }

// settleLocked records o as row i's outcome unless it has one already.
func (t *tracker) settleLocked(i int, o outcome) {
	r := t.rows[i]
	if r.done {
		return
	}
	r.done = true
	r.out = o
	t.pending--
	if t.pending == 0 {
		close(t.done)
	}
}

// onInvoked records the gateway's answer for row i. It reports whether the
// row still needs its outcome read with Get: the answer's status is
// terminal (a re-run answered DUPLICATE) and no event has settled it.
func (t *tracker) onInvoked(i int, resp *executionv1.InvokeCapabilityResponse, now time.Time) (needGet bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.rows[i]
	if resp.GetAcceptance() == executionv1.InvokeAcceptance_INVOKE_ACCEPTANCE_DUPLICATE {
		t.invokedDuplicate++
	} else {
		t.invokedNew++
	}
	r.executionID = resp.GetExecutionId()
	r.pollGap = t.pendingAfter
	r.nextPoll = now.Add(t.pendingAfter)
	t.byExec[r.executionID] = i
	if ev, ok := t.orphans[r.executionID]; ok {
		delete(t.orphans, r.executionID)
		t.settleLocked(i, outcomeFromEvent(ev))
	}
	return !r.done && client.IsTerminal(resp.GetStatus())
}

// onRejected records that the gateway refused row i's invoke.
func (t *tracker) onRejected(i int, class, message string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.settleLocked(i, outcome{Status: StatusRejected, FailureClass: class, FailureMessage: message})
}

// onEvent records a verified completion event. duplicate reports an event
// id seen before; known reports whether it matched a row of this run.
func (t *tracker) onEvent(ev *eventv1.CompletionEvent) (duplicate, known bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, seen := t.seenEvents[ev.GetEventId()]; seen {
		t.duplicateEvents++
		return true, true
	}
	t.seenEvents[ev.GetEventId()] = ev.GetExecutionId()
	if !client.IsTerminal(ev.GetStatus()) {
		return false, false
	}
	i, ok := t.byExec[ev.GetExecutionId()]
	if !ok {
		// The event may have overtaken the invoke answer; keep it, bounded,
		// until the answer names its execution.
		if len(t.orphans) < t.maxOrphans {
			t.orphans[ev.GetExecutionId()] = ev
		}
		return false, false
	}
	t.settleLocked(i, outcomeFromEvent(ev))
	return false, true
}

// onExecution records an execution read with Get for row i; it settles the
// row when the execution is terminal.
func (t *tracker) onExecution(i int, ex *executionv1.Execution) {
	if !client.IsTerminal(ex.GetStatus()) {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.settleLocked(i, outcomeFromExecution(ex))
}

// duePolls returns the rows that have an execution, no outcome, and whose
// next poll time has come, and moves each one's next poll time on,
// doubling its gap up to maxPollGap.
func (t *tracker) duePolls(now time.Time) []pollItem {
	t.mu.Lock()
	defer t.mu.Unlock()
	var due []pollItem
	for i, r := range t.rows {
		if r.done || r.executionID == "" || now.Before(r.nextPoll) {
			continue
		}
		due = append(due, pollItem{row: i, executionID: r.executionID})
		r.pollGap = min(2*r.pollGap, maxPollGap)
		r.nextPoll = now.Add(r.pollGap)
	}
	return due
}

// pollItem names a row to poll.
type pollItem struct {
	row         int
	executionID string
}

// counts returns a snapshot of the run's counters.
func (t *tracker) counts() Summary {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := Summary{
		RowsIn:           len(t.rows),
		InvokedNew:       t.invokedNew,
		InvokedDuplicate: t.invokedDuplicate,
		EventsDelivered:  t.eventsOfThisRunLocked(),
		DuplicateEvents:  t.duplicateEvents,
		Pending:          t.pending,
	}
	for _, r := range t.rows {
		if !r.done {
			continue
		}
		switch r.out.Status {
		case "SUCCEEDED":
			s.Succeeded++
		case "FAILED":
			s.Failed++
		case StatusRejected:
			s.Rejected++
		default:
			s.OtherTerminal++
		}
	}
	return s
}

// snapshot returns each row's output fields, in input order; rows without an
// outcome get StatusPending.
func (t *tracker) snapshot() []outputRow {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]outputRow, len(t.rows))
	for i, r := range t.rows {
		o := r.out
		if !r.done {
			o = outcome{Status: StatusPending}
		}
		out[i] = outputRow{payment: r.payment, executionID: r.executionID, out: o}
	}
	return out
}

// statusName turns EXECUTION_STATUS_SUCCEEDED into SUCCEEDED.
func statusName(s executionv1.ExecutionStatus) string {
	return strings.TrimPrefix(s.String(), "EXECUTION_STATUS_")
}

// outcomeFromEvent builds a row outcome from a completion event.
func outcomeFromEvent(ev *eventv1.CompletionEvent) outcome {
	return buildOutcome(ev.GetStatus(), ev.GetAttempts(), ev.GetOutput(), ev.GetOutputContentType(), ev.GetFailure())
}

// outcomeFromExecution builds a row outcome from a terminal execution.
func outcomeFromExecution(ex *executionv1.Execution) outcome {
	return buildOutcome(ex.GetStatus(), ex.GetAttempts(), ex.GetOutput(), ex.GetOutputContentType(), ex.GetFailure())
}

// buildOutcome fills an outcome; a SUCCEEDED JSON output is parsed as a
// payment.Result for the reference and the fee.
func buildOutcome(st executionv1.ExecutionStatus, attempts int32, output []byte, contentType string, f *executionv1.Failure) outcome {
	o := outcome{Status: statusName(st), Attempts: attempts}
	if st == executionv1.ExecutionStatus_EXECUTION_STATUS_SUCCEEDED {
		if contentType == "" || strings.HasPrefix(contentType, "application/json") {
			if res, err := payment.ParseResult(output); err == nil {
				o.ProviderReference = res.ProviderReference
				o.Fee = res.Fee
			}
		}
		return o
	}
	o.FailureClass = f.GetClass()
	o.FailureMessage = f.GetMessage()
	if r := f.GetReason(); r != "" {
		// A settlement reason such as "retry_exhausted.attempt_limit" says
		// why Capstan gave up; keep it with the last attempt's message.
		if o.FailureMessage == "" {
			o.FailureMessage = r
		} else {
			o.FailureMessage = r + ": " + o.FailureMessage
		}
	}
	return o
}

// eventsOfThisRunLocked counts the unique events received for executions of
// this run's rows (events of other executions of the same application, for
// example from an earlier run, are not counted). t.mu must be held.
func (t *tracker) eventsOfThisRunLocked() int {
	n := 0
	for _, exec := range t.seenEvents {
		if _, ok := t.byExec[exec]; ok {
			n++
		}
	}
	return n
}
