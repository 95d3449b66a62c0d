package itemsource

import (
	"bufio"
	"errors"
	"io"
	"reflect"
	"strings"
	"testing"
	"testing/iotest"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// drain reads src to the end and returns its items and the final error
// (nil at io.EOF). It fails the test if the source does not end within
// bound calls.
func drain(t testing.TB, src Source, bound int) ([]Item, error) {
	t.Helper()
	var items []Item
	for range bound {
		it, err := src.Next()
		if err == io.EOF {
			return items, nil
		}
		if err != nil {
			return items, err
		}
		items = append(items, it)
	}
	t.Fatalf("source did not end within %d calls", bound)
	return nil, nil
}

func fields(kv ...string) []Field {
	var fs []Field
	for i := 0; i < len(kv); i += 2 {
		fs = append(fs, Field{Name: kv[i], Value: kv[i+1]})
	}
	return fs
}

func TestCSV(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		in      string
		opts    Options
		want    []Item
		wantErr []string // substrings of the error; nil means io.EOF
		is      error
	}{
		{
			name: "basic",
			in:   "id,name\n1,ann\n2,bob\n",
			want: []Item{
				{Index: 1, Line: 2, Fields: fields("id", "1", "name", "ann")},
				{Index: 2, Line: 3, Fields: fields("id", "2", "name", "bob")},
			},
		},
		{
			name: "header only",
			in:   "id,name\n",
		},
		{
			name: "crlf no trailing newline bom",
			in:   "\ufeffid,name\r\n1,ann\r\n2,bob",
			want: []Item{
				{Index: 1, Line: 2, Fields: fields("id", "1", "name", "ann")},
				{Index: 2, Line: 3, Fields: fields("id", "2", "name", "bob")},
			},
		},
		{
			name: "quoted multiline and blank lines",
			in:   "id,text\n\n1,\"a\nb\"\n\n2,\"x,\"\"y\"\"\"\n",
			want: []Item{
				{Index: 1, Line: 3, Fields: fields("id", "1", "text", "a\nb")},
				{Index: 2, Line: 6, Fields: fields("id", "2", "text", `x,"y"`)},
			},
		},
		{
			name: "semicolon",
			in:   "a;b\n1;2\n",
			opts: Options{Comma: ';'},
			want: []Item{{Index: 1, Line: 2, Fields: fields("a", "1", "b", "2")}},
		},
		{name: "empty input", in: "", is: ErrNoHeader, wantErr: []string{"header"}},
		{name: "empty column name", in: "a,,c\n", wantErr: []string{"line 1 column 3", "empty column name"}},
		{name: "duplicate column", in: "a,b,a\n", wantErr: []string{"line 1 column 5", `duplicate column name "a"`}},
		{
			name:    "too few fields",
			in:      "a,b\n1,2\n3\n",
			want:    []Item{{Index: 1, Line: 2, Fields: fields("a", "1", "b", "2")}},
			wantErr: []string{"line 3", "number of fields"},
		},
		{
			name:    "bare quote",
			in:      "a,b\n1,x\"y\n",
			wantErr: []string{"line 2 column 4", `bare "`},
		},
		{
			name:    "unterminated quote",
			in:      "a,b\n1,\"x\n",
			wantErr: []string{"line 2 column 6", "extraneous or missing"},
		},
		{
			name: "limit exact",
			in:   "a\n1\n2\n",
			opts: Options{MaxItems: 2},
			want: []Item{{Index: 1, Line: 2, Fields: fields("a", "1")}, {Index: 2, Line: 3, Fields: fields("a", "2")}},
		},
		{
			name:    "limit exceeded",
			in:      "a\n1\n2\n3\n",
			opts:    Options{MaxItems: 2},
			want:    []Item{{Index: 1, Line: 2, Fields: fields("a", "1")}, {Index: 2, Line: 3, Fields: fields("a", "2")}},
			wantErr: []string{"maximum of 2 items"},
			is:      &LimitError{Limit: 2},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			src := NewCSV(strings.NewReader(tc.in), tc.opts)
			got, err := drain(t, src, 100)
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("items:\n got %+v\nwant %+v", got, tc.want)
			}
			checkErr(t, err, tc.wantErr, tc.is)
			if err != nil {
				// Errors are sticky.
				if _, err2 := src.Next(); err2 == nil || err2.Error() != err.Error() {
					t.Errorf("second Next = %v, want sticky %v", err2, err)
				}
			}
		})
	}
}

func checkErr(t *testing.T, err error, want []string, is error) {
	t.Helper()
	if want == nil {
		if err != nil {
			t.Fatalf("unexpected error: %v", err)
		}
		return
	}
	if err == nil {
		t.Fatalf("no error, want %q", want)
	}
	for _, s := range want {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("error %q does not contain %q", err, s)
		}
	}
	if le, ok := is.(*LimitError); ok {
		var got *LimitError
		if !errors.As(err, &got) || got.Limit != le.Limit {
			t.Errorf("error %v is not *LimitError{%d}", err, le.Limit)
		}
	} else if is != nil && !errors.Is(err, is) {
		t.Errorf("error %v is not %v", err, is)
	}
}

func TestJSONLines(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		in      string
		opts    Options
		want    []Item
		wantErr []string
		is      error
	}{
		{
			name: "basic",
			in:   "{\"a\":1}\n{\"a\":2}\n",
			want: []Item{{Index: 1, Line: 1, JSON: []byte(`{"a":1}`)}, {Index: 2, Line: 2, JSON: []byte(`{"a":2}`)}},
		},
		{name: "empty", in: ""},
		{
			name: "blank lines crlf bom no trailing newline",
			in:   "\ufeff{\"a\":1}\r\n\r\n  \n\t{\"b\":[1,2]} \r\n{}",
			want: []Item{
				{Index: 1, Line: 1, JSON: []byte(`{"a":1}`)},
				{Index: 2, Line: 4, JSON: []byte(`{"b":[1,2]}`)},
				{Index: 3, Line: 5, JSON: []byte(`{}`)},
			},
		},
		{
			name:    "syntax error",
			in:      "{\"a\":1}\n  {\"a\":x}\n",
			want:    []Item{{Index: 1, Line: 1, JSON: []byte(`{"a":1}`)}},
			wantErr: []string{"line 2 column 8", "invalid character 'x'"},
		},
		{name: "two values", in: "{} {}\n", wantErr: []string{"line 1 column 4", "after top-level value"}},
		{name: "not an object", in: "[1]\n", wantErr: []string{"line 1 column 1", "not a JSON object"}},
		{name: "truncated", in: "{\"a\":", wantErr: []string{"line 1", "unexpected end"}},
		{
			name:    "line too long",
			in:      "{\"a\":\"0123456789\"}\n",
			opts:    Options{MaxLineBytes: 10},
			wantErr: []string{"line 1", "too long"},
			is:      bufio.ErrTooLong,
		},
		{
			name: "line at limit",
			in:   "{\"a\":\"01\"}\r\n",
			opts: Options{MaxLineBytes: 10},
			want: []Item{{Index: 1, Line: 1, JSON: []byte(`{"a":"01"}`)}},
		},
		{
			name:    "line just over limit",
			in:      "{\"a\":\"012\"}\n",
			opts:    Options{MaxLineBytes: 10},
			wantErr: []string{"line 1", "longer than 10 bytes"},
			is:      bufio.ErrTooLong,
		},
		{
			name:    "limit exceeded",
			in:      "{}\n{}\n",
			opts:    Options{MaxItems: 1},
			want:    []Item{{Index: 1, Line: 1, JSON: []byte(`{}`)}},
			wantErr: []string{"maximum of 1 items"},
			is:      &LimitError{Limit: 1},
		},
		{
			name:    "error after limit reported as the error",
			in:      "{}\nnope\n",
			opts:    Options{MaxItems: 1},
			want:    []Item{{Index: 1, Line: 1, JSON: []byte(`{}`)}},
			wantErr: []string{"line 2"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			src := NewJSONLines(strings.NewReader(tc.in), tc.opts)
			got, err := drain(t, src, 100)
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("items:\n got %+v\nwant %+v", got, tc.want)
			}
			checkErr(t, err, tc.wantErr, tc.is)
		})
	}
}

func TestReaderError(t *testing.T) {
	t.Parallel()
	boom := errors.New("boom")
	for name, src := range map[string]Source{
		"csv":   NewCSV(io.MultiReader(strings.NewReader("a\n1\n"), iotest.ErrReader(boom)), Options{}),
		"jsonl": NewJSONLines(io.MultiReader(strings.NewReader("{}\n"), iotest.ErrReader(boom)), Options{}),
	} {
		_, err := drain(t, src, 10)
		if !errors.Is(err, boom) {
			t.Errorf("%s: error %v does not wrap the reader's error", name, err)
		}
	}
}

func TestSkip(t *testing.T) {
	t.Parallel()
	const csvIn = "n\n1\n2\n3\n4\n"
	const jsonIn = "{\"n\":1}\n{\"n\":2}\n{\"n\":3}\n{\"n\":4}\n"
	mk := map[string]func(Options) Source{
		"csv":   func(o Options) Source { return NewCSV(strings.NewReader(csvIn), o) },
		"jsonl": func(o Options) Source { return NewJSONLines(strings.NewReader(jsonIn), o) },
	}
	for name, newSrc := range mk {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			// Resume after 2: the next item is the third, index and line
			// are those of the full source.
			src := newSrc(Options{})
			if err := src.Skip(2); err != nil {
				t.Fatal(err)
			}
			it, err := src.Next()
			if err != nil {
				t.Fatal(err)
			}
			if it.Index != 3 {
				t.Errorf("index after skip = %d, want 3", it.Index)
			}
			if (name == "csv" && it.Line != 4) || (name == "jsonl" && it.Line != 3) {
				t.Errorf("line after skip = %d", it.Line)
			}
			if err := newSrc(Options{}).Skip(0); err != nil {
				t.Errorf("Skip(0): %v", err)
			}
			if err := newSrc(Options{}).Skip(-1); err == nil {
				t.Error("Skip(-1) succeeded")
			}
			src = newSrc(Options{})
			if err := src.Skip(4); err != nil {
				t.Errorf("Skip(all): %v", err)
			}
			if _, err := src.Next(); err != io.EOF {
				t.Errorf("Next after Skip(all) = %v, want io.EOF", err)
			}
			if err := newSrc(Options{}).Skip(5); !errors.Is(err, io.ErrUnexpectedEOF) {
				t.Errorf("Skip past end = %v, want io.ErrUnexpectedEOF", err)
			}
			var le *LimitError
			if err := newSrc(Options{MaxItems: 3}).Skip(4); !errors.As(err, &le) || le.Limit != 3 {
				t.Errorf("Skip past limit = %v, want *LimitError", err)
			}
		})
	}
}

func TestMap(t *testing.T) {
	t.Parallel()
	it := Item{Fields: fields("a", "1", "b", "2")}
	if got := it.Map(); !reflect.DeepEqual(got, map[string]string{"a": "1", "b": "2"}) {
		t.Errorf("Map = %v", got)
	}
	if (Item{JSON: []byte(`{}`)}).Map() != nil {
		t.Error("Map of JSON item is not nil")
	}
}

// TestLazy checks that a source reads its input on demand: the first item
// is available before the input has ended.
func TestLazy(t *testing.T) {
	t.Parallel()
	for name, mk := range map[string]func(io.Reader) Source{
		"csv":   func(r io.Reader) Source { return NewCSV(r, Options{}) },
		"jsonl": func(r io.Reader) Source { return NewJSONLines(r, Options{}) },
	} {
		pr, pw := io.Pipe()
		done := make(chan struct{})
		go func() {
			defer close(done)
			if name == "csv" {
				_, _ = io.WriteString(pw, "a\n1\n")
			} else {
				_, _ = io.WriteString(pw, "{}\n")
			}
			_, _ = io.WriteString(pw, "\n") // may block until Close: the source must not need it
		}()
		src := mk(pr)
		if _, err := src.Next(); err != nil {
			t.Errorf("%s: %v", name, err)
		}
		_ = pw.Close()
		<-done
	}
}

const fuzzBound = 1 << 16

func FuzzCSV(f *testing.F) {
	for _, s := range []string{"a,b\n1,2\n", "a\n\"x\ny\"\n", "a,a\n", "", "\ufeffa\r\n1", "a,b\n1,\"2\n", "a\n1\n2\n3\n"} {
		f.Add(s, 0, uint8(0))
	}
	f.Add("a\n1\n2\n", 1, uint8(1))
	f.Fuzz(func(t *testing.T, in string, maxItems int, skip uint8) {
		if maxItems < 0 {
			maxItems = 0
		}
		src := NewCSV(strings.NewReader(in), Options{MaxItems: maxItems})
		if err := src.Skip(int(skip % 8)); err != nil {
			return
		}
		items, err := drain(t, src, len(in)+2)
		prev := 0
		for _, it := range items {
			if it.Index <= prev || it.Line < 2 || len(it.Fields) != len(src.Header()) {
				t.Fatalf("bad item %+v after index %d", it, prev)
			}
			prev = it.Index
		}
		if maxItems > 0 && prev > maxItems {
			t.Fatalf("index %d beyond limit %d", prev, maxItems)
		}
		_ = err
	})
}

func FuzzJSONLines(f *testing.F) {
	for _, s := range []string{"{}\n", "{\"a\":1}\r\n\n{\"b\":2}", "[1]\n", "{} {}", "{\"a\":", "\ufeff{}\n", "nope"} {
		f.Add(s, 0, 0, uint8(0))
	}
	f.Add("{}\n{}\n{}\n", 2, 4, uint8(1))
	f.Fuzz(func(t *testing.T, in string, maxItems, maxLine int, skip uint8) {
		maxItems = max(maxItems, 0)
		maxLine = max(min(maxLine, 1<<20), 0)
		src := NewJSONLines(strings.NewReader(in), Options{MaxItems: maxItems, MaxLineBytes: maxLine})
		if err := src.Skip(int(skip % 8)); err != nil {
			return
		}
		items, _ := drain(t, src, len(in)+2)
		prev, prevLine := 0, 0
		for _, it := range items {
			if it.Index <= prev || it.Line <= prevLine || len(it.JSON) == 0 || it.JSON[0] != '{' {
				t.Fatalf("bad item %+v", it)
			}
			if maxLine > 0 && len(it.JSON) > maxLine {
				t.Fatalf("item longer than %d bytes", maxLine)
			}
			prev, prevLine = it.Index, it.Line
		}
		if maxItems > 0 && prev > maxItems {
			t.Fatalf("index %d beyond limit %d", prev, maxItems)
		}
	})
}

// TestInvalidUTF8AndOversizeItems: a byte sequence that is not UTF-8, or an
// item above MaxLineBytes, is an error naming the line (and the field),
// never an item whose text is silently replaced.
func TestInvalidUTF8AndOversizeItems(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, format, in, want string
		opts                   Options
	}{
		{"csv latin-1", "csv", "ID,Name\n1,ok\n2,Caf\xe9\n", "csv line 3 column 3: field Name is not valid UTF-8", Options{}},
		{"jsonl latin-1", "jsonl", "{\"a\":1}\n{\"a\":\"Caf\xe9\"}\n", "jsonl line 2: not valid UTF-8", Options{}},
		{"csv oversize row", "csv", "ID,Name\n1,ok\n2," + strings.Repeat("x", 40) + "\n", "csv line 3: row of 41 bytes is longer than the maximum of 32", Options{MaxLineBytes: 32}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var src Source
			if tc.format == "csv" {
				src = NewCSV(strings.NewReader(tc.in), tc.opts)
			} else {
				src = NewJSONLines(strings.NewReader(tc.in), tc.opts)
			}
			_, err := src.Next()
			if err != nil {
				t.Fatalf("first item: %v", err)
			}
			_, err = src.Next()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("second item: %v, want an error containing %q", err, tc.want)
			}
		})
	}
}
