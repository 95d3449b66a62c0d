// Package itemsource reads the items of an itemized execution lazily from a
// byte stream: one item per CSV row (after a required header row) or per JSON
// Lines line. Only the current item is held in memory; Skip resumes after a
// known number of items (replay after a crash) without retaining them.
package itemsource

import (
	"errors"
	"fmt"
	"io"
)

// DefaultMaxLineBytes is the default maximum length of one JSON Lines line,
// in bytes (1 MiB).
const DefaultMaxLineBytes = 1 << 20

// ErrNoHeader reports a CSV source without a header row.
var ErrNoHeader = errors.New("itemsource: missing CSV header row")

// Source is a lazy, forward-only sequence of items. It is not safe for
// concurrent use.
type Source interface {
	// Next returns the next item. At the end of the source it returns
	// io.EOF (unwrapped). A malformed item returns an error naming its line
	// and column or field; a source with more than Options.MaxItems items
	// returns a *LimitError when item MaxItems+1 is reached. Errors other
	// than io.EOF are sticky: every later call returns the same error.
	Next() (Item, error)
	// Skip reads and discards the next n items (n >= 0) as Next would,
	// keeping none of them in memory. Skipped items count towards the
	// index and MaxItems. If the source ends first, Skip returns an error
	// wrapping io.ErrUnexpectedEOF; an error of Next is returned as is.
	Skip(n int) error
}

// Options configure a Source. The zero value is valid.
type Options struct {
	// MaxItems is the maximum number of items the source may hold; 0 means
	// unlimited. Reaching item MaxItems+1 fails with *LimitError.
	MaxItems int
	// Comma is the CSV field delimiter; 0 means ','. Ignored for JSON Lines.
	Comma rune
	// MaxLineBytes is the maximum size of one item in bytes: a JSON Lines
	// line, or the sum of a CSV row's fields; 0 means DefaultMaxLineBytes.
	MaxLineBytes int
}

// Item is one item of a source.
type Item struct {
	// Index is the item's 1-based position in the source.
	Index int
	// Line is the 1-based line number where the item starts.
	Line int
	// Fields holds a CSV row's fields in header order; nil for JSON Lines.
	Fields []Field
	// JSON holds a JSON Lines item (a JSON object, as it appeared on its
	// line without surrounding whitespace); nil for CSV.
	JSON []byte
}

// Field is one named CSV field.
type Field struct {
	// Name is the column name from the header row.
	Name string
	// Value is the field's value.
	Value string
}

// Map returns a CSV item's fields keyed by column name (nil for JSON Lines).
func (it Item) Map() map[string]string {
	if it.Fields == nil {
		return nil
	}
	m := make(map[string]string, len(it.Fields))
	for _, f := range it.Fields {
		m[f.Name] = f.Value
	}
	return m
}

// LimitError reports a source holding more than Limit items.
type LimitError struct {
	// Limit is the configured Options.MaxItems.
	Limit int
}

func (e *LimitError) Error() string {
	return fmt.Sprintf("itemsource: source holds more than the maximum of %d items", e.Limit)
}

// base carries what both parsers share: counting, the limit and sticky
// errors.
type base struct {
	max   int
	count int
	err   error
	next  func() (Item, error)
}

func (b *base) Next() (Item, error) {
	if b.err != nil {
		return Item{}, b.err
	}
	if b.max > 0 && b.count >= b.max {
		// Only an existing extra item exceeds the limit.
		if _, err := b.next(); err != nil {
			if err != io.EOF {
				b.err = err
			}
			return Item{}, err
		}
		b.err = &LimitError{Limit: b.max}
		return Item{}, b.err
	}
	it, err := b.next()
	if err != nil {
		if err != io.EOF {
			b.err = err
		}
		return Item{}, err
	}
	b.count++
	it.Index = b.count
	return it, nil
}

func (b *base) Skip(n int) error {
	if n < 0 {
		return fmt.Errorf("itemsource: skip %d: negative count", n)
	}
	for i := range n {
		if _, err := b.Next(); err != nil {
			if err == io.EOF {
				return fmt.Errorf("itemsource: skip %d: source ended after %d: %w", n, i, io.ErrUnexpectedEOF)
			}
			return err
		}
	}
	return nil
}
