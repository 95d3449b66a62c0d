package csvapp

import (
	"context"
	"crypto/sha256"
	"encoding/csv"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/capstan-dev/capstan/examples/csv-payments/payment"
	"github.com/capstan-dev/capstan/internal/objectstore"
	"github.com/capstan-dev/capstan/internal/steps"
	"github.com/capstan-dev/capstan/pkg/client"
	executionv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/execution/v1"
)

// maxObjectName bounds the file-name part of the object keys and of the
// idempotency key.
const maxObjectName = 64

// fileJob is the file shape's one execution: the uploaded source, the
// output object and the idempotency key.
type fileJob struct {
	name      string // "<input base name>-<first 16 hex of sha256(file)>"
	sourceKey string
	outputKey string
	key       string // idempotency key
	input     []byte // capability input (JSON)
}

// FileObjectName returns the name the file shape gives a file's objects:
// the input's base name without .csv, with every byte outside
// [A-Za-z0-9._-] replaced by "_" and no leading dot (at most 64 bytes),
// then "-" and the first 16 hex digits of sha256(file).
func FileObjectName(input string, fileSum [sha256.Size]byte) string {
	base := filepath.Base(input)
	if ext := filepath.Ext(base); strings.EqualFold(ext, ".csv") {
		base = strings.TrimSuffix(base, ext)
	}
	b := []byte(base)
	for i, c := range b {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '.', c == '_', c == '-':
		default:
			b[i] = '_'
		}
	}
	name := strings.TrimLeft(string(b), ".")
	if len(name) > maxObjectName {
		name = name[:maxObjectName]
	}
	if name == "" || name == "." {
		name = "input"
	}
	return name + "-" + hex.EncodeToString(fileSum[:8])
}

// newFileJob names the objects and the idempotency key of input: the
// source is <prefix>/uploads/<name>.csv, the output
// <prefix>/outputs/<name>.out.csv and the idempotency key
// "csv-payments-file:<name>", where <name> is FileObjectName, so running
// the same file again finds the same execution.
func newFileJob(prefix, input string, fileSum [sha256.Size]byte) (fileJob, error) {
	name := FileObjectName(input, fileSum)
	j := fileJob{name: name, sourceKey: prefix + "/uploads/" + name + ".csv", outputKey: prefix + "/outputs/" + name + ".out.csv",
		key: "csv-payments-file:" + name}
	for _, k := range []string{j.sourceKey, j.outputKey} {
		if err := objectstore.ValidateKey(k); err != nil {
			return fileJob{}, fmt.Errorf("csvapp: %w", err)
		}
	}
	in, err := json.Marshal(steps.Input{Source: j.sourceKey, Output: j.outputKey})
	if err != nil {
		return fileJob{}, fmt.Errorf("csvapp: encode input: %w", err)
	}
	j.input = in
	return j, nil
}

// openObjects opens the local object store at dir, creating dir if needed.
func openObjects(dir string) (*objectstore.Local, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("csvapp: --objects-dir: %w", err)
	}
	st, err := objectstore.NewLocal(dir)
	if err != nil {
		return nil, fmt.Errorf("csvapp: --objects-dir: %w", err)
	}
	return st, nil
}

// upload publishes the checked payments under j.sourceKey, atomically
// (nothing is visible under the key before the commit): the header, then
// one row per payment with its fields as the row shape reads them (spaces
// around fields and a byte order mark dropped). For a well-formed file
// that is the file itself, and the release's output then repeats the
// fields exactly as the row shape writes them.
func upload(ctx context.Context, st objectstore.Store, j fileJob, payments []payment.Payment) (err error) {
	w, err := st.Create(ctx, j.sourceKey)
	if err != nil {
		return fmt.Errorf("csvapp: upload: %w", err)
	}
	defer func() {
		if err != nil {
			_ = w.Abort(context.WithoutCancel(ctx))
		}
	}()
	cw := csv.NewWriter(w)
	if err := cw.Write(payment.Header); err != nil {
		return fmt.Errorf("csvapp: upload: %w", err)
	}
	for _, p := range payments {
		if err := cw.Write([]string{p.ID, p.Recipient, p.Amount, p.Currency}); err != nil {
			return fmt.Errorf("csvapp: upload: %w", err)
		}
	}
	cw.Flush()
	if err := cw.Error(); err != nil {
		return fmt.Errorf("csvapp: upload: %w", err)
	}
	if err := w.Commit(ctx); err != nil {
		return fmt.Errorf("csvapp: upload: %w", err)
	}
	return nil
}

// ExecutionFailedError is returned by Run in the file shape when the
// file's execution ended without succeeding; no output is written.
type ExecutionFailedError struct {
	ExecutionID string
	// Status is FAILED, TIMED_OUT or CANCELLED.
	Status string
	// Class and Message are the execution's failure.
	Class, Message string
}

// Error returns "execution ID of payments.process-file STATUS: class: message".
func (e *ExecutionFailedError) Error() string {
	return fmt.Sprintf("csvapp: execution %s of %s %s: %s: %s", e.ExecutionID, FileCapability, e.Status, e.Class, e.Message)
}

// finishFile reads the file's terminal execution, checks its output object
// against the input (one row per payment, in order, the output header) and
// the execution's output (bytes and SHA-256), copies it to cfg.OutputPath()
// atomically, and fills the file-shape figures of sum.
func finishFile(ctx context.Context, cfg Config, cl *client.Client, st objectstore.Store, j fileJob, executionID string,
	payments []payment.Payment, sum *Summary) error {
	ex, err := retry(ctx, cfg.RPCTimeout, func(cctx context.Context) (*executionv1.Execution, error) {
		return cl.Get(cctx, executionID)
	})
	if err != nil {
		return fmt.Errorf("csvapp: get execution %s: %w", executionID, err)
	}
	sum.ExecutionID = executionID
	if ex.GetStatus() != executionv1.ExecutionStatus_EXECUTION_STATUS_SUCCEEDED {
		f := ex.GetFailure()
		msg := f.GetMessage()
		if r := f.GetReason(); r != "" {
			msg = r + ": " + msg
		}
		return &ExecutionFailedError{ExecutionID: executionID, Status: statusName(ex.GetStatus()), Class: f.GetClass(), Message: msg}
	}
	var out steps.Summary
	if err := json.Unmarshal(ex.GetOutput(), &out); err != nil {
		return fmt.Errorf("csvapp: execution %s: output is not the summary of %s: %w", executionID, FileCapability, err)
	}
	sum.Window, sum.MaxInFlight, sum.Object = out.Window, out.MaxInFlight, j.outputKey
	if out.Object != "" && out.Object != j.outputKey {
		return fmt.Errorf("csvapp: execution %s published %q, want %q", executionID, out.Object, j.outputKey)
	}
	counts, err := copyOutput(ctx, st, j.outputKey, cfg.OutputPath(), payments, out)
	if err != nil {
		return err
	}
	sum.Succeeded, sum.Failed, sum.OtherTerminal = counts.succeeded, counts.failed, counts.other
	return nil
}

// statusCounts counts the output rows by status.
type statusCounts struct{ succeeded, failed, other int }

// copyOutput copies the object key to path atomically (a temporary file in
// path's directory, renamed), checking on the way that it is the CSV the
// row shape writes for payments: the output header, then one row per
// payment with its ID, in input order; and that its size and SHA-256 are
// those the execution reported. It counts the rows by status.
func copyOutput(ctx context.Context, st objectstore.Store, key, path string, payments []payment.Payment, out steps.Summary) (c statusCounts, err error) {
	rc, err := st.Open(ctx, key)
	if errors.Is(err, objectstore.ErrNotFound) {
		return c, fmt.Errorf("csvapp: the output object %q is not in --objects-dir (did the execution run against another object store?): %w", key, err)
	}
	if err != nil {
		return c, fmt.Errorf("csvapp: open output object: %w", err)
	}
	defer rc.Close()
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return c, fmt.Errorf("csvapp: create output directory: %w", err)
	}
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return c, fmt.Errorf("csvapp: create output: %w", err)
	}
	defer func() {
		if err != nil {
			_ = f.Close()
			_ = os.Remove(f.Name())
		}
	}()
	h := sha256.New()
	n := &countingReader{r: rc}
	r := csv.NewReader(io.TeeReader(n, io.MultiWriter(f, h)))
	r.FieldsPerRecord = len(OutputHeader)
	r.ReuseRecord = true
	head, err := r.Read()
	if err != nil {
		return c, fmt.Errorf("csvapp: output object %q: header: %w", key, err)
	}
	if strings.Join(head, ",") != strings.Join(OutputHeader, ",") {
		return c, fmt.Errorf("csvapp: output object %q: header %q, want %q", key, head, OutputHeader)
	}
	for i := 0; ; i++ {
		rec, err := r.Read()
		if errors.Is(err, io.EOF) {
			if i != len(payments) {
				return c, fmt.Errorf("csvapp: output object %q has %d rows, the input %d", key, i, len(payments))
			}
			break
		}
		if err != nil {
			return c, fmt.Errorf("csvapp: output object %q: %w", key, err)
		}
		if i >= len(payments) {
			return c, fmt.Errorf("csvapp: output object %q has more rows than the input (%d)", key, len(payments))
		}
		if rec[0] != payments[i].ID {
			return c, fmt.Errorf("csvapp: output object %q: row %d has ID %q, want %q (input order)", key, i+1, rec[0], payments[i].ID)
		}
		switch rec[4] {
		case "SUCCEEDED":
			c.succeeded++
		case "FAILED":
			c.failed++
		default:
			c.other++
		}
	}
	// Drain what the CSV reader left unread (nothing for a well-formed
	// object) so the size and hash cover the whole object.
	if _, err := io.Copy(io.MultiWriter(f, h), n); err != nil {
		return c, fmt.Errorf("csvapp: read output object: %w", err)
	}
	if sum := hex.EncodeToString(h.Sum(nil)); (out.SHA256 != "" && sum != out.SHA256) || (out.Bytes > 0 && n.n != out.Bytes) {
		return c, fmt.Errorf("csvapp: output object %q is %d bytes with sha256 %s; the execution published %d bytes with sha256 %s",
			key, n.n, sum, out.Bytes, out.SHA256)
	}
	if err := f.Chmod(0o644); err != nil {
		return c, fmt.Errorf("csvapp: write output: %w", err)
	}
	if err := f.Close(); err != nil {
		return c, fmt.Errorf("csvapp: close output: %w", err)
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return c, fmt.Errorf("csvapp: rename output: %w", err)
	}
	return c, nil
}

// countingReader counts the bytes read through it.
type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}
