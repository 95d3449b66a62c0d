package payment_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/capstan-dev/capstan/examples/csv-payments/payment"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestParseAmount(t *testing.T) {
	t.Parallel()
	good := map[string]int64{
		"5047.29": 504729, "6730.3": 673030, "12": 1200, "0.05": 5, "0": 0,
		"007.10": 710, "999999999999999.99": 99999999999999999,
	}
	for in, want := range good {
		got, err := payment.ParseAmount(in)
		if err != nil || got != want {
			t.Errorf("ParseAmount(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", ".5", "5.", "5.123", "-5", "+5", "1e3", "1,000.00", " 5", "5 ", "abc", "1.2.3", "1000000000000000", "٣.٤"} {
		_, err := payment.ParseAmount(in)
		if !errors.Is(err, payment.ErrAmount) {
			t.Errorf("ParseAmount(%q) err = %v, want ErrAmount", in, err)
		} else if !strings.Contains(err.Error(), "field Amount") {
			t.Errorf("ParseAmount(%q) err %q does not name the field", in, err)
		}
	}
}

func TestFormatCents(t *testing.T) {
	t.Parallel()
	for c, want := range map[int64]string{0: "0.00", 5: "0.05", 130: "1.30", 504729: "5047.29", -5: "-0.05", -12345: "-123.45"} {
		if got := payment.FormatCents(c); got != want {
			t.Errorf("FormatCents(%d) = %q, want %q", c, got, want)
		}
	}
}

func TestReadCSV(t *testing.T) {
	t.Parallel()
	in := "\ufeffID,Recipient,Amount,Currency\n1,Natasha Thomas,5047.29,AUD\n2,\"Joyce, Marc\",6730.3,ZAR\n3,,1,EUR\n"
	got, err := payment.ReadCSV(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	want := []payment.Payment{
		{ID: "1", Recipient: "Natasha Thomas", Amount: "5047.29", Currency: "AUD"},
		{ID: "2", Recipient: "Joyce, Marc", Amount: "6730.3", Currency: "ZAR"},
		{ID: "3", Recipient: "", Amount: "1", Currency: "EUR"},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d rows, want %d", len(got), len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("row %d = %+v, want %+v", i, got[i], want[i])
		}
	}

	// Header only: no rows, no error.
	rows, err := payment.ReadCSV(strings.NewReader("ID,Recipient,Amount,Currency\n"))
	if err != nil || len(rows) != 0 {
		t.Errorf("header only: %v, %v", rows, err)
	}
}

func TestReadCSVErrors(t *testing.T) {
	t.Parallel()
	const h = "ID,Recipient,Amount,Currency\n"
	cases := []struct {
		name  string
		in    string
		line  int
		field string
		want  error
	}{
		{"empty", "", 1, "header", payment.ErrHeader},
		{"wrong column name", "ID,Name,Amount,Currency\n", 1, "Recipient", payment.ErrHeader},
		{"lower case", "id,Recipient,Amount,Currency\n", 1, "ID", payment.ErrHeader},
		{"bad amount", h + "1,A,5047.29,AUD\n2,B,12.345,AUD\n", 3, "Amount", payment.ErrAmount},
		{"empty id", h + "1,A,1,AUD\n,B,1,AUD\n", 3, "ID", payment.ErrField},
		{"duplicate id", h + "1,A,1,AUD\n1,B,1,AUD\n", 3, "ID", payment.ErrDuplicateID},
		{"bad currency", h + "1,A,1,EURO\n", 2, "Currency", payment.ErrField},
		{"too few fields", h + "1,A,1\n", 2, "record", nil},
		{"bad quote", h + "1,\"A,1,AUD\n", 2, "record", nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := payment.ReadCSV(strings.NewReader(tc.in))
			var fe *payment.FieldError
			if !errors.As(err, &fe) {
				t.Fatalf("err = %v, want *FieldError", err)
			}
			if fe.Line != tc.line || fe.Field != tc.field {
				t.Errorf("line %d field %q, want line %d field %q (%v)", fe.Line, fe.Field, tc.line, tc.field, err)
			}
			if tc.want != nil && !errors.Is(err, tc.want) {
				t.Errorf("err = %v, want %v", err, tc.want)
			}
		})
	}
}

func TestJSON(t *testing.T) {
	t.Parallel()
	p := payment.Payment{ID: "1", Recipient: "Natasha Thomas", Amount: "5047.29", Currency: "AUD"}
	got := string(payment.EncodeJSON(p))
	if want := `{"id":"1","recipient":"Natasha Thomas","amount":"5047.29","currency":"AUD"}`; got != want {
		t.Errorf("EncodeJSON = %s, want %s", got, want)
	}
	back, err := payment.DecodeJSON([]byte(got))
	if err != nil || back != p {
		t.Errorf("DecodeJSON = %+v, %v", back, err)
	}
	for _, bad := range []string{"", "null", "[]", `{"id":1}`, `{"id":"1"} x`, "not json", `"s"`} {
		if _, err := payment.DecodeJSON([]byte(bad)); !errors.Is(err, payment.ErrJSON) {
			t.Errorf("DecodeJSON(%q) err = %v", bad, err)
		}
	}
	r := payment.Result{ProviderReference: "PR-0123456789ab", Fee: "25.54", Currency: "AUD"}
	if got, want := string(r.JSON()), `{"provider_reference":"PR-0123456789ab","fee":"25.54","currency":"AUD"}`; got != want {
		t.Errorf("Result.JSON = %s, want %s", got, want)
	}
	if back, err := payment.ParseResult(r.JSON()); err != nil || back != r {
		t.Errorf("ParseResult = %+v, %v", back, err)
	}
}

func ref(s string) string {
	sum := sha256.Sum256([]byte(s))
	return "PR-" + hex.EncodeToString(sum[:])[:12]
}

func TestDecide(t *testing.T) {
	t.Parallel()
	cases := []struct {
		p     payment.Payment
		class string
		fee   string
		ref   string
	}{
		{payment.Payment{"1", "Natasha Thomas", "5047.29", "AUD"}, "", "25.54", ref("Natasha Thomas|5047.29|AUD|1")},
		{payment.Payment{"6", "Janet Carpenter", "6730.3", "NOK"}, "", "33.95", ref("Janet Carpenter|6730.30|NOK|6")},
		{payment.Payment{"x", "R", "1.00", "EUR"}, "", "0.31", ref("R|1.00|EUR|x")},     // 0.005 rounds half up
		{payment.Payment{"x", "R", "0.99", "EUR"}, "", "0.30", ref("R|0.99|EUR|x")},     // 0.00495 rounds down
		{payment.Payment{"x", "R", "9000", "EUR"}, "", "45.30", ref("R|9000.00|EUR|x")}, // at the limit: not declined
		{payment.Payment{"3", "Anthony Franco", "9669.46", "CAD"}, payment.ClassDeclined, "", ""},
		{payment.Payment{"x", "R", "9000.01", "KRW"}, payment.ClassDeclined, "", ""},
		{payment.Payment{"11", "James Bates", "565.44", "KRW"}, payment.ClassUnsupportedCurrency, "", ""},
		{payment.Payment{"12", "Stacy Young", "3148.79", "INR"}, payment.ClassUnsupportedCurrency, "", ""},
		{payment.Payment{"x", "R", "1", "inr"}, payment.ClassUnsupportedCurrency, "", ""},
		{payment.Payment{"x", " ", "1", "EUR"}, payment.ClassInputInvalid, "", ""},
		{payment.Payment{"", "R", "1", "EUR"}, payment.ClassInputInvalid, "", ""},
		{payment.Payment{"x", "R", "1.234", "EUR"}, payment.ClassInputInvalid, "", ""},
		{payment.Payment{"x", "R", "1", "EU"}, payment.ClassInputInvalid, "", ""},
	}
	for _, tc := range cases {
		o := payment.Decide(tc.p)
		if tc.class == "" {
			if !o.Succeeded || o.Result.Fee != tc.fee || o.Result.ProviderReference != tc.ref || o.Result.Currency != tc.p.Currency {
				t.Errorf("Decide(%+v) = %+v, want fee %s ref %s", tc.p, o, tc.fee, tc.ref)
			}
			continue
		}
		if o.Succeeded || o.FailureClass != tc.class || o.Retryable || o.FailureMessage == "" {
			t.Errorf("Decide(%+v) = %+v, want class %s", tc.p, o, tc.class)
		}
	}
	if o := payment.Decide(payment.Payment{"x", "", "1", "EUR"}); !strings.Contains(o.FailureMessage, "recipient") {
		t.Errorf("empty recipient message %q does not name the field", o.FailureMessage)
	}
}

func TestSampleFiles(t *testing.T) {
	t.Parallel()
	counts := map[string]map[string]int{
		"payments_12.csv": {"": 9, payment.ClassDeclined: 1, payment.ClassUnsupportedCurrency: 2},
		"payments_1k.csv": {"": 802, payment.ClassDeclined: 95, payment.ClassUnsupportedCurrency: 103},
	}
	for name, want := range counts {
		b, err := os.ReadFile(filepath.Join("..", "testdata", name))
		if err != nil {
			t.Fatal(err)
		}
		rows, err := payment.ReadCSV(bytes.NewReader(b))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		got := map[string]int{}
		for _, p := range rows {
			got[payment.Decide(p).FailureClass]++
		}
		for k, v := range want {
			if got[k] != v {
				t.Errorf("%s: class %q: %d rows, want %d (all: %v)", name, k, got[k], v, got)
			}
		}
	}
}

// TestSharedData reads the larger shared sample when it is present.
func TestSharedData(t *testing.T) {
	t.Parallel()
	path := filepath.Join("..", "..", "..", "..", "shared", "data", "csv-payments", "payments_10k.csv")
	f, err := os.Open(path)
	if err != nil {
		t.Skipf("shared data not present (%v)", err)
	}
	defer f.Close()
	rows, err := payment.ReadCSV(f)
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 10000 {
		t.Errorf("%d rows, want 10000", len(rows))
	}
}

func FuzzParseAmount(f *testing.F) {
	for _, s := range []string{"5047.29", "6730.3", "0", "", ".", "1.", "-1", "999999999999999.99", "1e5"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		c, err := payment.ParseAmount(s)
		if err != nil {
			return
		}
		if c < 0 {
			t.Fatalf("ParseAmount(%q) = %d < 0", s, c)
		}
		back, err := payment.ParseAmount(payment.FormatCents(c))
		if err != nil || back != c {
			t.Fatalf("round trip of %q: %d -> %q -> %d, %v", s, c, payment.FormatCents(c), back, err)
		}
		_ = payment.Decide(payment.Payment{ID: "1", Recipient: "R", Amount: s, Currency: "EUR"})
	})
}

func FuzzReadCSV(f *testing.F) {
	f.Add([]byte("ID,Recipient,Amount,Currency\n1,Natasha Thomas,5047.29,AUD\n"))
	f.Add([]byte("ID,Recipient,Amount,Currency\n1,\"a\"\"b\",1,AUD\n2,,0.5,KRW\r\n"))
	f.Add([]byte("\ufeffID,Recipient,Amount,Currency"))
	f.Add([]byte("ID,Recipient\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		rows, err := payment.ReadCSV(bytes.NewReader(in))
		if err != nil {
			var fe *payment.FieldError
			if !errors.As(err, &fe) || fe.Field == "" {
				t.Fatalf("error %v is not a *FieldError naming a field", err)
			}
			return
		}
		ids := map[string]bool{}
		for _, p := range rows {
			if p.ID == "" || ids[p.ID] {
				t.Fatalf("empty or duplicate ID accepted: %+v", p)
			}
			ids[p.ID] = true
			if _, err := payment.ParseAmount(p.Amount); err != nil {
				t.Fatalf("accepted bad amount %q", p.Amount)
			}
			back, err := payment.DecodeJSON(payment.EncodeJSON(p))
			if err != nil || back != p {
				t.Fatalf("JSON round trip of %+v: %+v, %v", p, back, err)
			}
			o := payment.Decide(p)
			if o.Succeeded == (o.FailureClass != "") {
				t.Fatalf("Decide(%+v) = %+v", p, o)
			}
		}
	})
}
