// Package payment is shared by the csv-payments example's provider, its
// application and their tests: the Payment row, its CSV reader, its JSON
// encoding as capability input, amount parsing in integer cents, and the mock
// provider's deterministic rules (Decide).
package payment

import (
	"bytes"
	"crypto/sha256"
	"encoding/csv"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Column names of the CSV header, in order.
const (
	ColumnID        = "ID"
	ColumnRecipient = "Recipient"
	ColumnAmount    = "Amount"
	ColumnCurrency  = "Currency"
)

// Header is the exact header row the CSV reader requires.
var Header = []string{ColumnID, ColumnRecipient, ColumnAmount, ColumnCurrency}

// Failure classes returned by Decide and by the provider.
const (
	// ClassDeclined: the amount is above DeclineAboveCents.
	ClassDeclined = "payment.declined"
	// ClassUnsupportedCurrency: the currency is KRW or INR.
	ClassUnsupportedCurrency = "payment.unsupported_currency"
	// ClassInputInvalid: the input is not a valid payment.
	ClassInputInvalid = "input.invalid"
	// ClassProviderUnavailable: the provider failed transiently (retryable).
	ClassProviderUnavailable = "provider.unavailable"
)

// DeclineAboveCents is the largest amount, in cents, that is not declined
// (9000.00).
const DeclineAboveCents = 900000

// FixedFeeCents is the fixed part of the fee, in cents (0.30).
const FixedFeeCents = 30

// maxAmountDigits bounds the integer part of an amount so that cents and fee
// arithmetic cannot overflow int64.
const maxAmountDigits = 15

var (
	// ErrHeader is wrapped when the CSV header is missing or not exactly
	// Header.
	ErrHeader = errors.New("payment: bad CSV header")
	// ErrAmount is wrapped when an amount is not a non-negative decimal with
	// at most two fraction digits and at most 15 integer digits.
	ErrAmount = errors.New("payment: invalid amount")
	// ErrField is wrapped when a required field is empty or malformed.
	ErrField = errors.New("payment: invalid field")
	// ErrDuplicateID is wrapped when two rows of one file share an ID.
	ErrDuplicateID = errors.New("payment: duplicate ID")
	// ErrJSON is wrapped when a JSON input is not a payment object.
	ErrJSON = errors.New("payment: invalid JSON input")
)

// Payment is one row of the input CSV. Fields hold the text of the file with
// surrounding spaces removed; Amount is a decimal such as "5047.29" or
// "6730.3" and Currency an ISO 4217 code such as "AUD".
type Payment struct {
	// ID is the row's id within its file.
	ID string `json:"id"`
	// Recipient is the payee's name; may be empty in a file.
	Recipient string `json:"recipient"`
	// Amount is the decimal amount text, at most two fraction digits.
	Amount string `json:"amount"`
	// Currency is the ISO 4217 code.
	Currency string `json:"currency"`
}

// FieldError names the CSV line (1-based, the header is line 1) and the
// column of a bad value. It wraps the cause (ErrHeader, ErrAmount, ErrField,
// ErrDuplicateID or an encoding/csv error).
type FieldError struct {
	// Line is the 1-based line of the record (0 if unknown).
	Line int
	// Field is the column name, "header" or "record".
	Field string
	// Err is the cause.
	Err error
}

// Error returns "line N: field F: cause".
func (e *FieldError) Error() string {
	return fmt.Sprintf("line %d: field %s: %v", e.Line, e.Field, e.Err)
}

// Unwrap returns the cause.
func (e *FieldError) Unwrap() error { return e.Err }

// ReadCSV reads every payment of r: a header row that is exactly Header
// (a UTF-8 byte order mark before it is ignored), then one row per payment.
// Rows must have four fields of valid UTF-8; ID must be non-empty and unique in the file,
// Amount must satisfy ParseAmount and Currency must be three ASCII letters.
// Recipient may be empty (the provider refuses such a payment itself).
//
// Errors are *FieldError naming the line and field (field "record" for a
// row that cannot be split into fields).
func ReadCSV(r io.Reader) ([]Payment, error) {
	cr := csv.NewReader(r)
	cr.FieldsPerRecord = len(Header)
	cr.ReuseRecord = true

	head, err := cr.Read()
	if err != nil {
		if errors.Is(err, io.EOF) {
			return nil, &FieldError{Line: 1, Field: "header", Err: fmt.Errorf("%w: empty input", ErrHeader)}
		}
		return nil, &FieldError{Line: 1, Field: "header", Err: fmt.Errorf("%w: %w", ErrHeader, err)}
	}
	for i, name := range head {
		if i == 0 {
			name = strings.TrimPrefix(name, "\ufeff")
		}
		if strings.TrimSpace(name) != Header[i] {
			return nil, &FieldError{Line: 1, Field: Header[i], Err: fmt.Errorf("%w: column %d is %q, want %q", ErrHeader, i+1, name, Header[i])}
		}
	}

	var out []Payment
	seen := make(map[string]int)
	for {
		rec, err := cr.Read()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			line := 0
			var pe *csv.ParseError
			if errors.As(err, &pe) {
				line = pe.Line
			}
			return nil, &FieldError{Line: line, Field: "record", Err: err}
		}
		line, _ := cr.FieldPos(0)
		for i, f := range rec {
			if !utf8.ValidString(f) {
				return nil, &FieldError{Line: line, Field: Header[i], Err: fmt.Errorf("%w: not valid UTF-8", ErrField)}
			}
		}
		p := Payment{
			ID:        strings.TrimSpace(rec[0]),
			Recipient: strings.TrimSpace(rec[1]),
			Amount:    strings.TrimSpace(rec[2]),
			Currency:  strings.TrimSpace(rec[3]),
		}
		if p.ID == "" {
			return nil, &FieldError{Line: line, Field: ColumnID, Err: fmt.Errorf("%w: empty", ErrField)}
		}
		if first, dup := seen[p.ID]; dup {
			return nil, &FieldError{Line: line, Field: ColumnID, Err: fmt.Errorf("%w: %q also on line %d", ErrDuplicateID, p.ID, first)}
		}
		seen[p.ID] = line
		if _, err := ParseAmount(p.Amount); err != nil {
			return nil, &FieldError{Line: line, Field: ColumnAmount, Err: err}
		}
		if !validCurrency(p.Currency) {
			return nil, &FieldError{Line: line, Field: ColumnCurrency, Err: fmt.Errorf("%w: want three letters", ErrField)}
		}
		out = append(out, p)
	}
}

// validCurrency reports whether c is three ASCII letters.
func validCurrency(c string) bool {
	if len(c) != 3 {
		return false
	}
	for i := range len(c) {
		if b := c[i] | 0x20; b < 'a' || b > 'z' {
			return false
		}
	}
	return true
}

// ParseAmount parses a non-negative decimal amount with at most two fraction
// digits ("5047.29", "6730.3", "12", "0.05") into integer cents. No sign,
// exponent, thousands separator or spaces are accepted, and the integer part
// has at most 15 digits.
//
// Errors wrap ErrAmount and name the Amount field.
func ParseAmount(s string) (int64, error) {
	intPart, frac, hasDot := strings.Cut(s, ".")
	switch {
	case s == "":
		return 0, fmt.Errorf("%w: field %s: empty", ErrAmount, ColumnAmount)
	case intPart == "":
		return 0, fmt.Errorf("%w: field %s: no digits before the decimal point", ErrAmount, ColumnAmount)
	case hasDot && (frac == "" || len(frac) > 2):
		return 0, fmt.Errorf("%w: field %s: want one or two digits after the decimal point", ErrAmount, ColumnAmount)
	case len(intPart) > maxAmountDigits:
		return 0, fmt.Errorf("%w: field %s: more than %d integer digits", ErrAmount, ColumnAmount, maxAmountDigits)
	case !allDigits(intPart) || !allDigits(frac):
		return 0, fmt.Errorf("%w: field %s: not a decimal number", ErrAmount, ColumnAmount)
	}
	whole, err := strconv.ParseInt(intPart, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%w: field %s: %w", ErrAmount, ColumnAmount, err)
	}
	var cents int64
	switch len(frac) {
	case 1:
		cents = int64(frac[0]-'0') * 10
	case 2:
		cents = int64(frac[0]-'0')*10 + int64(frac[1]-'0')
	}
	return whole*100 + cents, nil
}

// allDigits reports whether s consists of ASCII digits only (true for "").
func allDigits(s string) bool {
	for i := range len(s) {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// FormatCents formats cents as a decimal with exactly two fraction digits,
// for example 123456 as "1234.56" and -5 as "-0.05".
func FormatCents(cents int64) string {
	sign := ""
	u := uint64(cents)
	if cents < 0 {
		sign = "-"
		u = -u
	}
	return fmt.Sprintf("%s%d.%02d", sign, u/100, u%100)
}

// EncodeJSON returns the capability input for p, deterministic and compact:
// {"id":"1","recipient":"Natasha Thomas","amount":"5047.29","currency":"AUD"}.
// Fields are written as they are in p.
func EncodeJSON(p Payment) []byte {
	// Marshalling a struct of strings cannot fail.
	b, _ := json.Marshal(p)
	return b
}

// DecodeJSON parses a capability input written by EncodeJSON (unknown fields
// are ignored). It checks only that the input is one JSON object with string
// fields; Decide judges the values.
//
// Errors wrap ErrJSON.
func DecodeJSON(b []byte) (Payment, error) {
	var p Payment
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&p); err != nil {
		return Payment{}, fmt.Errorf("%w: %w", ErrJSON, err)
	}
	if bytes.TrimSpace(b)[0] != '{' {
		return Payment{}, fmt.Errorf("%w: not an object", ErrJSON)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return Payment{}, fmt.Errorf("%w: data after the object", ErrJSON)
	}
	return p, nil
}

// Result is the provider's output for a successful payment, encoded as JSON
// {"provider_reference":"PR-0123456789ab","fee":"25.54","currency":"AUD"}.
type Result struct {
	// ProviderReference is "PR-" and 12 lowercase hex digits.
	ProviderReference string `json:"provider_reference"`
	// Fee is the fee in the payment's currency, two fraction digits.
	Fee string `json:"fee"`
	// Currency is the payment's currency.
	Currency string `json:"currency"`
}

// JSON returns the result's JSON encoding (deterministic).
func (r Result) JSON() []byte {
	b, _ := json.Marshal(r)
	return b
}

// ParseResult decodes a provider output written by Result.JSON.
//
// Errors wrap ErrJSON.
func ParseResult(b []byte) (Result, error) {
	var r Result
	if err := json.Unmarshal(b, &r); err != nil {
		return Result{}, fmt.Errorf("%w: result: %w", ErrJSON, err)
	}
	return r, nil
}

// Outcome is what the provider answers for a payment: a Result when
// Succeeded, otherwise a failure class and message. Decide's failures are
// never retryable.
type Outcome struct {
	// Succeeded says whether the payment was sent; Result is set then.
	Succeeded bool
	// Result is the provider's output for a successful payment.
	Result Result
	// FailureClass is one of the Class constants when not Succeeded.
	FailureClass string
	// FailureMessage says why, naming the field for ClassInputInvalid.
	FailureMessage string
	// Retryable is always false for Decide's rules.
	Retryable bool
}

// Decide applies the mock provider's rules to p, in this order:
//
//  1. empty ID or Recipient, an Amount that ParseAmount refuses, or a
//     Currency that is not three letters: ClassInputInvalid (the message
//     names the field);
//  2. amount above 9000.00: ClassDeclined;
//  3. currency KRW or INR (any letter case): ClassUnsupportedCurrency;
//  4. otherwise success with fee = 0.5 % of the amount rounded half-up to
//     cents, plus 0.30, and provider reference "PR-" + the first 12 hex
//     digits of sha256("recipient|amount|currency|id"), where amount is
//     FormatCents of the parsed amount, so "6730.3" and "6730.30" agree.
//
// It is a pure function: the same payment always gets the same outcome.
func Decide(p Payment) Outcome {
	invalid := func(field, why string) Outcome {
		return Outcome{FailureClass: ClassInputInvalid, FailureMessage: "field " + field + ": " + why}
	}
	if strings.TrimSpace(p.ID) == "" {
		return invalid("id", "empty")
	}
	if strings.TrimSpace(p.Recipient) == "" {
		return invalid("recipient", "empty")
	}
	cents, err := ParseAmount(p.Amount)
	if err != nil {
		return invalid("amount", "not a decimal with at most two fraction digits")
	}
	if !validCurrency(p.Currency) {
		return invalid("currency", "want three letters")
	}
	if cents > DeclineAboveCents {
		return Outcome{FailureClass: ClassDeclined, FailureMessage: "amount " + FormatCents(cents) + " is above the limit of " + FormatCents(DeclineAboveCents)}
	}
	cur := strings.ToUpper(p.Currency)
	if cur == "KRW" || cur == "INR" {
		return Outcome{FailureClass: ClassUnsupportedCurrency, FailureMessage: "currency " + cur + " is not supported"}
	}
	fee := (cents*5+500)/1000 + FixedFeeCents
	sum := sha256.Sum256([]byte(p.Recipient + "|" + FormatCents(cents) + "|" + p.Currency + "|" + p.ID))
	return Outcome{
		Succeeded: true,
		Result: Result{
			ProviderReference: "PR-" + hex.EncodeToString(sum[:6]),
			Fee:               FormatCents(fee),
			Currency:          p.Currency,
		},
	}
}
