package itemsource

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"strings"
	"unicode/utf8"
)

// CSV is a Source of CSV rows. The first record is the header row naming the
// columns (a leading UTF-8 byte order mark is dropped); names must be
// non-empty and unique. Every later record is one item and must have as many
// fields as the header. Parsing follows RFC 4180 as implemented by
// encoding/csv, so a quoted field may span lines; Item.Line is the line where
// the row starts. Blank lines are skipped.
type CSV struct {
	base
	r       *csv.Reader
	header  []string
	maxItem int
}

var _ Source = (*CSV)(nil)

// NewCSV returns a CSV source reading r lazily. The header is read on the first
// call of Next or Skip; a missing header fails with an error wrapping
// ErrNoHeader.
func NewCSV(r io.Reader, opts Options) *CSV {
	cr := csv.NewReader(r)
	if opts.Comma != 0 {
		cr.Comma = opts.Comma
	}
	cr.ReuseRecord = true
	c := &CSV{r: cr, maxItem: opts.MaxLineBytes}
	if c.maxItem <= 0 {
		c.maxItem = DefaultMaxLineBytes
	}
	c.max = opts.MaxItems
	c.next = c.read
	return c
}

// Header returns the column names, or nil before the header has been read.
func (c *CSV) Header() []string { return c.header }

func (c *CSV) read() (Item, error) {
	if c.header == nil {
		if err := c.readHeader(); err != nil {
			return Item{}, err
		}
	}
	rec, err := c.r.Read()
	if err == io.EOF {
		return Item{}, io.EOF
	}
	if err != nil {
		return Item{}, c.wrap(err)
	}
	line, _ := c.r.FieldPos(0)
	fields := make([]Field, len(rec))
	size := 0
	for i, v := range rec {
		if !utf8.ValidString(v) {
			fl, col := c.r.FieldPos(i)
			return Item{}, fmt.Errorf("itemsource: csv line %d column %d: field %s is not valid UTF-8", fl, col, c.header[i])
		}
		size += len(v)
		fields[i] = Field{Name: c.header[i], Value: v}
	}
	if size > c.maxItem {
		return Item{}, fmt.Errorf("itemsource: csv line %d: row of %d bytes is longer than the maximum of %d", line, size, c.maxItem)
	}
	return Item{Line: line, Fields: fields}, nil
}

func (c *CSV) readHeader() error {
	rec, err := c.r.Read()
	if err == io.EOF {
		return ErrNoHeader
	}
	if err != nil {
		return fmt.Errorf("itemsource: csv header: %w", c.wrap(err))
	}
	line, _ := c.r.FieldPos(0)
	header := make([]string, len(rec))
	seen := make(map[string]int, len(rec))
	for i, name := range rec {
		if i == 0 {
			name = strings.TrimPrefix(name, "\ufeff")
		}
		_, col := c.r.FieldPos(i)
		switch prev, dup := seen[name]; {
		case name == "":
			return fmt.Errorf("itemsource: csv header line %d column %d: empty column name", line, col)
		case dup:
			return fmt.Errorf("itemsource: csv header line %d column %d: duplicate column name %q (also field %d)", line, col, name, prev+1)
		}
		seen[name] = i
		header[i] = name
	}
	c.header = header
	return nil
}

// wrap names line, column and, where known, the field of a parse error.
func (c *CSV) wrap(err error) error {
	var pe *csv.ParseError
	if !errors.As(err, &pe) {
		return fmt.Errorf("itemsource: csv: %w", err)
	}
	if errors.Is(pe.Err, csv.ErrFieldCount) {
		return fmt.Errorf("itemsource: csv line %d: row has a different number of fields than the header (%d): %w",
			pe.StartLine, len(c.header), err)
	}
	return fmt.Errorf("itemsource: csv line %d column %d: %w", pe.Line, pe.Column, err)
}
