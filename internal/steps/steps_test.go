package steps

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/itemsource"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestParseInput(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in, field string
	}{
		{`{"source":"in/a.csv","output":"out/a.csv"}`, ""},
		{``, "input"},
		{`[]`, "input"},
		{`{"source":"a.csv"}`, "input.output"},
		{`{"output":"a.csv"}`, "input.source"},
		{`{"source":"/etc/passwd","output":"a.csv"}`, "input.source"},
		{`{"source":"a.csv","output":"a.csv"}`, "input.output"},
		{`{"source":"a.csv","output":"b.csv","extra":1}`, "input"},
		{`{"source":"a.csv","output":"b.csv"} {}`, "input"},
		{`{"source":"a.csv","output":"b.csv"}]`, "input"},
		{`{"source":"a.csv","output":"b.csv"}}`, "input"},
		{`{"Source":"a.csv","OUTPUT":"b.csv"}`, "input"},
		{`{"source":1,"output":"b.csv"}`, "input.source"},
		{`null`, "input.source"},
	}
	for _, tc := range tests {
		_, err := ParseInput([]byte(tc.in))
		if tc.field == "" {
			require.NoError(t, err, tc.in)
			continue
		}
		var inv *execution.InvalidArgumentError
		require.ErrorAs(t, err, &inv, tc.in)
		require.Equal(t, tc.field, inv.Field, tc.in)
	}
}

func FuzzParseInput(f *testing.F) {
	f.Add([]byte(`{"source":"in/a.csv","output":"out/a.csv"}`))
	f.Add([]byte(`{"source":"../a","output":"b"}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		in, err := ParseInput(b)
		if err != nil {
			require.True(t, IsInvalidInput(err))
			return
		}
		require.NotEmpty(t, in.Source)
		require.NotEqual(t, in.Source, in.Output)
	})
}

func TestRenderCSVAndJSONLines(t *testing.T) {
	t.Parallel()
	fields := []itemsource.Field{{Name: "ID", Value: "1"}, {Name: "Name", Value: `Ann "A", Jr`}}
	rows := []*Row{
		{Index: 1, Fields: fields, Status: RowSucceeded, Result: []byte(`{"fee":"0.35","n":3,"tags":["a"]}`), Sends: 1, InteractionID: "i1", ExecutionID: "e"},
		{Index: 2, Fields: fields, Status: RowFailed, Failure: &execution.Failure{Class: "payment.declined", Message: "too much"}, Sends: 2},
	}
	cols := []config.Column{{Name: "id", Value: "item.ID"}, {Name: "name", Value: "item.Name"}, {Name: "fee", Value: "result.fee"},
		{Name: "n", Value: "result.n"}, {Name: "tags", Value: "result.tags"}, {Name: "missing", Value: "result.nope"},
		{Name: "status", Value: "status"}, {Name: "class", Value: "failure.class"}, {Name: "index", Value: "index"}, {Name: "sends", Value: "sends"}}

	var csvOut bytes.Buffer
	r := NewRenderer(&csvOut, "csv", cols)
	require.NoError(t, r.Begin())
	for _, row := range rows {
		require.NoError(t, r.Write(row))
	}
	require.NoError(t, r.Flush())
	require.Equal(t, "id,name,fee,n,tags,missing,status,class,index,sends\n"+
		`1,"Ann ""A"", Jr",0.35,3,"[""a""]",,SUCCEEDED,,1,1`+"\n"+
		`1,"Ann ""A"", Jr",,,,,FAILED,payment.declined,2,2`+"\n", csvOut.String())

	var jl bytes.Buffer
	r = NewRenderer(&jl, "jsonl", append(cols, config.Column{Name: "item", Value: "item"}, config.Column{Name: "result", Value: "result"}))
	require.NoError(t, r.Begin())
	for _, row := range rows {
		require.NoError(t, r.Write(row))
	}
	lines := strings.Split(strings.TrimSuffix(jl.String(), "\n"), "\n")
	require.Len(t, lines, 2)
	var first map[string]any
	require.NoError(t, json.Unmarshal([]byte(lines[0]), &first))
	require.Equal(t, "0.35", first["fee"])
	require.Equal(t, float64(3), first["n"], "JSON values keep their type in JSON Lines")
	require.Equal(t, map[string]any{"ID": "1", "Name": `Ann "A", Jr`}, first["item"])
	require.Nil(t, first["missing"])
	var second map[string]any
	require.NoError(t, json.Unmarshal([]byte(lines[1]), &second))
	require.Nil(t, second["result"])
	require.Equal(t, "payment.declined", second["class"])
}

func TestDefaultColumns(t *testing.T) {
	t.Parallel()
	cols := DefaultColumns("csv", []string{"ID", "Amount"})
	names := make([]string, len(cols))
	for i, c := range cols {
		names[i] = c.Name
		require.NoError(t, config.ValidColumnValue(c.Value))
	}
	require.Equal(t, []string{"ID", "Amount", "status", "result", "failure_class", "failure_message"}, names)
	require.Equal(t, "item", DefaultColumns("jsonl", nil)[0].Value)
}

func FuzzRenderCSV(f *testing.F) {
	f.Add("1", `{"a":"x"}`, "a")
	f.Add("\"q\",\n", `[1,2]`, "b")
	f.Fuzz(func(t *testing.T, field, result, key string) {
		var out bytes.Buffer
		r := NewRenderer(&out, "csv", []config.Column{{Name: "f", Value: "item.F"}, {Name: "r", Value: "result." + key}, {Name: "raw", Value: "result"}})
		require.NoError(t, r.Begin())
		require.NoError(t, r.Write(&Row{Fields: []itemsource.Field{{Name: "F", Value: field}}, Result: []byte(result), Status: RowSucceeded}))
		require.NoError(t, r.Flush())
		require.True(t, strings.HasPrefix(out.String(), "f,r,raw\n"))
	})
}
