package csvapp

import (
	"encoding/csv"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/capstan-dev/capstan/examples/csv-payments/payment"
)

// OutputHeader is the header row of the output CSV.
var OutputHeader = []string{
	"ID", "Recipient", "Amount", "Currency", "Status", "ProviderReference",
	"Fee", "FailureClass", "FailureMessage", "Attempts", "ExecutionID",
}

// outputRow is one output line.
type outputRow struct {
	payment     payment.Payment
	executionID string
	out         outcome
}

// writeOutput writes rows as CSV to path, atomically: it writes a temporary
// file in the same directory (created if missing) and renames it.
func writeOutput(path string, rows []outputRow) (err error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("csvapp: create output directory: %w", err)
	}
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("csvapp: create output: %w", err)
	}
	defer func() {
		if err != nil {
			_ = f.Close()
			_ = os.Remove(f.Name())
		}
	}()
	w := csv.NewWriter(f)
	if err := w.Write(OutputHeader); err != nil {
		return fmt.Errorf("csvapp: write output: %w", err)
	}
	for _, r := range rows {
		rec := []string{
			r.payment.ID, r.payment.Recipient, r.payment.Amount, r.payment.Currency,
			r.out.Status, r.out.ProviderReference, r.out.Fee, r.out.FailureClass,
			r.out.FailureMessage, strconv.Itoa(int(r.out.Attempts)), r.executionID,
		}
		if err := w.Write(rec); err != nil {
			return fmt.Errorf("csvapp: write output: %w", err)
		}
	}
	w.Flush()
	if err := w.Error(); err != nil {
		return fmt.Errorf("csvapp: write output: %w", err)
	}
	if err := f.Chmod(0o644); err != nil {
		return fmt.Errorf("csvapp: write output: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("csvapp: close output: %w", err)
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return fmt.Errorf("csvapp: rename output: %w", err)
	}
	return nil
}
