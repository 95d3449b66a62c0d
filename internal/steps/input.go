package steps

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/objectstore"
)

// Input is the input of an execution of a release with steps, the JSON
// object {"source": "<key>", "output": "<key>"}: the object to read and the
// key to publish the output under (objectstore.ValidateKey rules), both
// under the calling application's prefix "<application name>/" (CheckOwner).
type Input struct {
	Source string `json:"source"`
	Output string `json:"output"`
}

// ParseInput decodes and checks an Input. Errors are
// *execution.InvalidArgumentError naming the field (input, input.source or
// input.output).
func ParseInput(b []byte) (Input, error) {
	var in Input
	const want = `want the JSON object {"source": "<object key>", "output": "<object key>"}`
	var raw map[string]json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&raw); err != nil {
		return in, &execution.InvalidArgumentError{Field: "input", Reason: fmt.Sprintf("%s: %v", want, err)}
	}
	if _, err := dec.Token(); err != io.EOF {
		return in, &execution.InvalidArgumentError{Field: "input", Reason: "data after the JSON object"}
	}
	for k, v := range raw {
		var dst *string
		switch k { // exact names: encoding/json alone would also take "Source"
		case "source":
			dst = &in.Source
		case "output":
			dst = &in.Output
		default:
			return in, &execution.InvalidArgumentError{Field: "input", Reason: fmt.Sprintf("unknown field %q; %s", k, want)}
		}
		if err := json.Unmarshal(v, dst); err != nil {
			return in, &execution.InvalidArgumentError{Field: "input." + k, Reason: "want a string (an object key)"}
		}
	}
	for _, f := range []struct{ name, key string }{{"input.source", in.Source}, {"input.output", in.Output}} {
		if f.key == "" {
			return in, &execution.InvalidArgumentError{Field: f.name, Reason: "required (an object key)"}
		}
		if err := objectstore.ValidateKey(f.key); err != nil {
			return in, &execution.InvalidArgumentError{Field: f.name, Reason: err.Error()}
		}
	}
	if in.Source == in.Output {
		return in, &execution.InvalidArgumentError{Field: "input.output", Reason: "must differ from input.source"}
	}
	return in, nil
}

// CheckOwner checks that both keys of in lie under the application's own
// prefix, "<application name>/": an application reads and publishes only
// its own objects (SYSTEM §9). Errors are *execution.InvalidArgumentError
// naming input.source or input.output.
func CheckOwner(in Input, application string) error {
	prefix := application + "/"
	for _, f := range []struct{ name, key string }{{"input.source", in.Source}, {"input.output", in.Output}} {
		if !strings.HasPrefix(f.key, prefix) {
			return &execution.InvalidArgumentError{Field: f.name,
				Reason: fmt.Sprintf("%q is not under %q, the calling application's prefix", f.key, prefix)}
		}
	}
	return nil
}

// IsInvalidInput reports whether err is an input error from ParseInput.
func IsInvalidInput(err error) bool {
	var inv *execution.InvalidArgumentError
	return errors.As(err, &inv)
}
