package itemsource

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"unicode/utf8"
)

// JSONLines is a Source of JSON Lines: every non-blank line holds exactly one
// JSON object, which is one item. Lines end with "\n" or "\r\n"; blank lines
// (only whitespace) are skipped; a leading UTF-8 byte order mark is dropped.
type JSONLines struct {
	base
	sc      *bufio.Scanner
	line    int
	maxLine int
}

var _ Source = (*JSONLines)(nil)

// NewJSONLines returns a JSON Lines source reading r lazily. A line longer than
// opts.MaxLineBytes (default DefaultMaxLineBytes) fails with an error wrapping
// bufio.ErrTooLong. opts.Comma is ignored.
func NewJSONLines(r io.Reader, opts Options) *JSONLines {
	maxLine := opts.MaxLineBytes
	if maxLine <= 0 {
		maxLine = DefaultMaxLineBytes
	}
	sc := bufio.NewScanner(r)
	// The scanner needs room for the line plus its terminator.
	sc.Buffer(make([]byte, 0, min(maxLine+2, 64<<10)), maxLine+2)
	j := &JSONLines{sc: sc, maxLine: maxLine}
	j.base.max = opts.MaxItems
	j.next = j.read
	return j
}

func (j *JSONLines) read() (Item, error) {
	for j.sc.Scan() {
		j.line++
		b := j.sc.Bytes()
		if j.line == 1 {
			b = bytes.TrimPrefix(b, []byte("\ufeff"))
		}
		if len(b) > j.maxLine {
			return Item{}, fmt.Errorf("itemsource: jsonl line %d: longer than %d bytes: %w", j.line, j.maxLine, bufio.ErrTooLong)
		}
		if !utf8.Valid(b) {
			return Item{}, fmt.Errorf("itemsource: jsonl line %d: not valid UTF-8", j.line)
		}
		lead := len(b) - len(bytes.TrimLeft(b, " \t\r\n"))
		b = bytes.TrimSpace(b)
		if len(b) == 0 {
			continue
		}
		var raw json.RawMessage
		if err := json.Unmarshal(b, &raw); err != nil {
			var se *json.SyntaxError
			if errors.As(err, &se) {
				return Item{}, fmt.Errorf("itemsource: jsonl line %d column %d: %w", j.line, lead+int(se.Offset), err)
			}
			return Item{}, fmt.Errorf("itemsource: jsonl line %d: %w", j.line, err)
		}
		if b[0] != '{' {
			return Item{}, fmt.Errorf("itemsource: jsonl line %d column %d: item is not a JSON object", j.line, lead+1)
		}
		return Item{Line: j.line, JSON: bytes.Clone(b)}, nil
	}
	if err := j.sc.Err(); err != nil {
		return Item{}, fmt.Errorf("itemsource: jsonl line %d: %w", j.line+1, err)
	}
	return Item{}, io.EOF
}
