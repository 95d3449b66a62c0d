package gateway

import (
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/capstan-dev/capstan/internal/execution"
)

// Field bounds for InvokeCapability.
const (
	maxCapabilityBytes  = 128
	maxContentTypeBytes = 128
	maxIdempotencyBytes = 256
)

// checkText refuses empty (when required), over-long, non-UTF-8 and
// NUL-containing strings, naming the field.
func checkText(field, v string, required bool, max int) error {
	switch {
	case v == "" && required:
		return &execution.InvalidArgumentError{Field: field, Reason: "required"}
	case len(v) > max:
		return &execution.InvalidArgumentError{Field: field, Reason: fmt.Sprintf("%d bytes, at most %d allowed", len(v), max)}
	case !utf8.ValidString(v):
		return &execution.InvalidArgumentError{Field: field, Reason: "not valid UTF-8"}
	case strings.IndexByte(v, 0) >= 0:
		return &execution.InvalidArgumentError{Field: field, Reason: "contains a NUL byte"}
	}
	return nil
}
