package steps

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"io"
	"strconv"
	"strings"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/itemsource"
)

// Row statuses in the output.
const (
	RowSucceeded = "SUCCEEDED"
	RowFailed    = "FAILED"
	RowTimedOut  = "TIMED_OUT"
	RowCancelled = "CANCELLED"
)

// Row is one terminal item (or one element of a list result) as it is
// published.
type Row struct {
	// Index is the row's 1-based position in the output.
	Index int
	// Fields are the source item's CSV fields; JSON the JSON Lines item.
	// Both are nil for rows of a collected result.
	Fields []itemsource.Field
	JSON   []byte
	// Status is one of the Row statuses.
	Status string
	// Result is the item's (mapped) result when Status is RowSucceeded.
	Result []byte
	// Failure is set otherwise.
	Failure       *execution.Failure
	InteractionID string
	ExecutionID   string
	// Sends is how many times the item's request was sent.
	Sends int

	result map[string]json.RawMessage // Result parsed, lazily
	item   map[string]json.RawMessage // JSON parsed, lazily
}

// Renderer writes rows as CSV or JSON Lines with the configured columns.
// It is not safe for concurrent use.
type Renderer struct {
	format  string
	columns []config.Column
	csv     *csv.Writer
	w       io.Writer
	buf     bytes.Buffer
}

// DefaultColumns are the columns used when publish.columns is empty: the
// source header's fields (CSV), or the whole item (JSON Lines), then the
// status, the result and the failure.
func DefaultColumns(sourceFormat string, header []string) []config.Column {
	var cols []config.Column
	if sourceFormat == "csv" {
		for _, h := range header {
			cols = append(cols, config.Column{Name: h, Value: "item." + h})
		}
	} else {
		cols = append(cols, config.Column{Name: "item", Value: "item"})
	}
	return append(cols,
		config.Column{Name: "status", Value: "status"},
		config.Column{Name: "result", Value: "result"},
		config.Column{Name: "failure_class", Value: "failure.class"},
		config.Column{Name: "failure_message", Value: "failure.message"})
}

// NewRenderer returns a renderer writing to w in format ("csv" or "jsonl").
// A CSV output starts with the header row, written by Begin.
func NewRenderer(w io.Writer, format string, columns []config.Column) *Renderer {
	r := &Renderer{format: format, columns: columns, w: w}
	if format == "csv" {
		r.csv = csv.NewWriter(w)
	}
	return r
}

// Begin writes the header row of a CSV output (nothing for JSON Lines).
func (r *Renderer) Begin() error {
	if r.csv == nil {
		return nil
	}
	names := make([]string, len(r.columns))
	for i, c := range r.columns {
		names[i] = c.Name
	}
	return r.csv.Write(names)
}

// Write renders one row.
func (r *Renderer) Write(row *Row) error {
	if r.csv != nil {
		rec := make([]string, len(r.columns))
		for i, c := range r.columns {
			rec[i] = row.text(c.Value)
		}
		return r.csv.Write(rec)
	}
	r.buf.Reset()
	r.buf.WriteByte('{')
	for i, c := range r.columns {
		if i > 0 {
			r.buf.WriteByte(',')
		}
		k, _ := json.Marshal(c.Name)
		r.buf.Write(k)
		r.buf.WriteByte(':')
		r.buf.Write(row.json(c.Value))
	}
	r.buf.WriteString("}\n")
	_, err := r.w.Write(r.buf.Bytes())
	return err
}

// Flush writes buffered CSV data to the underlying writer.
func (r *Renderer) Flush() error {
	if r.csv == nil {
		return nil
	}
	r.csv.Flush()
	return r.csv.Error()
}

// text is the value of expression v for a CSV cell: strings unquoted, other
// JSON values as their JSON text, missing values empty.
func (row *Row) text(v string) string {
	switch v {
	case "status":
		return row.Status
	case "index":
		return strconv.Itoa(row.Index)
	case "sends":
		return strconv.Itoa(row.Sends)
	case "interaction_id":
		return row.InteractionID
	case "execution_id":
		return row.ExecutionID
	case "failure.class":
		if row.Failure != nil {
			return row.Failure.Class
		}
		return ""
	case "failure.message":
		if row.Failure != nil {
			return row.Failure.Message
		}
		return ""
	case "result":
		return string(row.Result)
	case "item":
		if row.JSON != nil {
			return string(row.JSON)
		}
		return string(row.itemJSON())
	}
	if f, ok := strings.CutPrefix(v, "item."); ok {
		for _, fl := range row.Fields {
			if fl.Name == f {
				return fl.Value
			}
		}
		if row.JSON != nil {
			if row.item == nil {
				row.item = parseObject(row.JSON)
			}
			return rawText(row.item[f])
		}
		return ""
	}
	if f, ok := strings.CutPrefix(v, "result."); ok {
		if row.result == nil {
			row.result = parseObject(row.Result)
		}
		return rawText(row.result[f])
	}
	return ""
}

// json is the value of expression v for a JSON Lines field: the item and
// the result as JSON when they are JSON, everything else as a string.
func (row *Row) json(v string) []byte {
	switch v {
	case "item":
		if row.JSON != nil {
			return row.JSON
		}
		if row.Fields != nil {
			return row.itemJSON()
		}
		return []byte("null")
	case "result":
		if len(row.Result) > 0 && json.Valid(row.Result) {
			return row.Result
		}
		if len(row.Result) == 0 {
			return []byte("null")
		}
	}
	if f, ok := strings.CutPrefix(v, "result."); ok {
		if row.result == nil {
			row.result = parseObject(row.Result)
		}
		if raw, ok := row.result[f]; ok {
			return raw
		}
		return []byte("null")
	}
	b, _ := json.Marshal(row.text(v))
	return b
}

// itemJSON encodes CSV fields as a JSON object, in header order.
func (row *Row) itemJSON() []byte {
	return FieldsJSON(row.Fields)
}

// FieldsJSON encodes CSV fields as a JSON object whose keys are the column
// names, in header order, and whose values are the fields' text.
func FieldsJSON(fields []itemsource.Field) []byte {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, f := range fields {
		if i > 0 {
			b.WriteByte(',')
		}
		k, _ := json.Marshal(f.Name)
		v, _ := json.Marshal(f.Value)
		b.Write(k)
		b.WriteByte(':')
		b.Write(v)
	}
	b.WriteByte('}')
	return b.Bytes()
}

// parseObject parses a JSON object; anything else gives an empty map.
func parseObject(b []byte) map[string]json.RawMessage {
	m := map[string]json.RawMessage{}
	if len(b) > 0 {
		_ = json.Unmarshal(b, &m)
	}
	return m
}

// rawText is a JSON value as cell text: a string's content, null or absent
// as "", anything else as its JSON text.
func rawText(raw json.RawMessage) string {
	if len(raw) == 0 || string(raw) == "null" {
		return ""
	}
	if raw[0] == '"' {
		var s string
		if err := json.Unmarshal(raw, &s); err == nil {
			return s
		}
	}
	return string(raw)
}

// rowStatus maps a terminal item's interaction status to its row status.
func rowStatus(interactionStatus string, o *execution.Outcome) string {
	switch {
	case o != nil && o.Succeeded:
		return RowSucceeded
	case interactionStatus == "TIMED_OUT":
		return RowTimedOut
	case interactionStatus == "CANCELLED":
		return RowCancelled
	}
	return RowFailed
}
