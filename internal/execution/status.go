package execution

import "fmt"

// Status is the status of an execution. The zero value is not a valid
// status.
type Status string

// The statuses of SYSTEM §3.
const (
	StatusQueued          Status = "QUEUED"
	StatusRunning         Status = "RUNNING"
	StatusWaitingExternal Status = "WAITING_EXTERNAL"
	StatusRetryScheduled  Status = "RETRY_SCHEDULED"
	StatusSucceeded       Status = "SUCCEEDED"
	StatusFailed          Status = "FAILED"
	StatusTimedOut        Status = "TIMED_OUT"
	StatusCancelled       Status = "CANCELLED"
)

// Statuses lists every status, non-terminal first.
var Statuses = []Status{
	StatusQueued, StatusRunning, StatusWaitingExternal, StatusRetryScheduled,
	StatusSucceeded, StatusFailed, StatusTimedOut, StatusCancelled,
}

// Terminal reports whether s is a terminal status, which is never left.
func (s Status) Terminal() bool {
	switch s {
	case StatusSucceeded, StatusFailed, StatusTimedOut, StatusCancelled:
		return true
	}
	return false
}

// Valid reports whether s is one of the statuses of SYSTEM §3.
func (s Status) Valid() bool {
	for _, v := range Statuses {
		if s == v {
			return true
		}
	}
	return false
}

// ParseStatus parses the text form of a status. It returns an error that
// names the bad value for anything that is not a status.
func ParseStatus(s string) (Status, error) {
	if st := Status(s); st.Valid() {
		return st, nil
	}
	return "", fmt.Errorf("execution: unknown status %q", s)
}

// EventType is the completion event type for a terminal status, for example
// "execution.succeeded". It returns "" for a non-terminal status.
func (s Status) EventType() string {
	switch s {
	case StatusSucceeded:
		return "execution.succeeded"
	case StatusFailed:
		return "execution.failed"
	case StatusTimedOut:
		return "execution.timed_out"
	case StatusCancelled:
		return "execution.cancelled"
	}
	return ""
}

// CanTransition reports whether the state machine allows from → to.
func CanTransition(from, to Status) bool {
	if from.Terminal() {
		return false
	}
	switch to {
	case StatusRunning:
		return from == StatusQueued || from == StatusRetryScheduled
	case StatusWaitingExternal:
		return from == StatusRunning
	case StatusRetryScheduled:
		return from == StatusRunning || from == StatusWaitingExternal
	case StatusSucceeded, StatusFailed, StatusTimedOut, StatusCancelled:
		return true
	}
	return false
}
