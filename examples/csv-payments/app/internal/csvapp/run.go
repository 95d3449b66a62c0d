package csvapp

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"
	"unicode"

	"github.com/cenkalti/backoff/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/capstan-dev/capstan/examples/csv-payments/payment"
	"github.com/capstan-dev/capstan/internal/objectstore"
	"github.com/capstan-dev/capstan/pkg/client"
	executionv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/execution/v1"
)

// receiverShutdownGrace is how long the webhook receiver lets deliveries in
// progress finish once the run is over.
const receiverShutdownGrace = time.Second

// ErrUnauthenticated is returned by Run when the gateway refuses the api key;
// the run stops at once and writes no output.
var ErrUnauthenticated = errors.New("csvapp: gateway refused the api key")

// PendingError is returned by Run when it ended (timeout or cancellation)
// with rows still without an outcome. The output was written with Status
// PENDING for those rows.
type PendingError struct {
	// Pending is the number of rows without an outcome.
	Pending int
	// Cause is why the run ended (context.DeadlineExceeded for the timeout).
	Cause error
}

// Error returns "N rows still pending: cause".
func (e *PendingError) Error() string {
	return fmt.Sprintf("csvapp: %d rows still pending: %v", e.Pending, e.Cause)
}

// Unwrap returns the cause.
func (e *PendingError) Unwrap() error { return e.Cause }

// Summary counts what a run did. Succeeded + Failed + OtherTerminal +
// Rejected + Pending = RowsIn.
type Summary struct {
	RowsIn           int
	InvokedNew       int // invokes that created an execution
	InvokedDuplicate int // invokes answered DUPLICATE (a re-run)
	Succeeded        int
	Failed           int
	OtherTerminal    int // TIMED_OUT or CANCELLED
	Rejected         int // invokes the gateway refused
	Pending          int // rows without an outcome when the run ended
	EventsDelivered  int // unique verified events received
	DuplicateEvents  int // verified events whose event id was seen before
	Elapsed          time.Duration
	Output           string // output CSV path

	// The file shape's figures (Shape is ShapeFile): the file's execution,
	// the window of its await step, the most rows it had in flight at once,
	// and the output object's key. InvokedNew and InvokedDuplicate then
	// count that one execution, and EventsDelivered its event.
	Shape       string
	ExecutionID string
	Window      int
	MaxInFlight int
	Object      string
}

// RowsPerSecond is RowsIn divided by Elapsed (0 when Elapsed is 0).
func (s Summary) RowsPerSecond() float64 {
	if s.Elapsed <= 0 {
		return 0
	}
	return float64(s.RowsIn) / s.Elapsed.Seconds()
}

// WriteTo writes the summary as "key: value" lines, in this order: rows in,
// invoked new, invoked duplicate, succeeded, failed, other terminal,
// rejected, pending, events delivered, duplicate events, elapsed (a Go
// duration rounded to milliseconds), rows per second (one decimal), output;
// in the file shape then shape, execution, window, max in flight and
// object.
func (s Summary) WriteTo(w io.Writer) (int64, error) {
	var b bytes.Buffer
	line := func(k string, v any) { fmt.Fprintf(&b, "%s: %v\n", k, v) }
	line("rows in", s.RowsIn)
	line("invoked new", s.InvokedNew)
	line("invoked duplicate", s.InvokedDuplicate)
	line("succeeded", s.Succeeded)
	line("failed", s.Failed)
	line("other terminal", s.OtherTerminal)
	line("rejected", s.Rejected)
	line("pending", s.Pending)
	line("events delivered", s.EventsDelivered)
	line("duplicate events", s.DuplicateEvents)
	line("elapsed", s.Elapsed.Round(time.Millisecond))
	line("rows per second", fmt.Sprintf("%.1f", s.RowsPerSecond()))
	line("output", s.Output)
	if s.Shape == ShapeFile {
		line("shape", s.Shape)
		line("execution", s.ExecutionID)
		line("window", s.Window)
		line("max in flight", s.MaxInFlight)
		line("object", s.Object)
	}
	n, err := w.Write(b.Bytes())
	if err != nil {
		return int64(n), fmt.Errorf("csvapp: write summary: %w", err)
	}
	return int64(n), nil
}

// IdempotencyKey returns the key of the row with id in the file whose bytes
// hash to fileSum: "csv-payments:<first 16 hex of sha256(file)>:<id>".
func IdempotencyKey(fileSum [sha256.Size]byte, id string) string {
	return "csv-payments:" + hex.EncodeToString(fileSum[:8]) + ":" + id
}

// Run processes cfg.Input end to end (see the package documentation),
// writes the output CSV and prints the summary to stdout. logger may be nil.
//
// Errors: ErrConfig; the wrapped error of reading or parsing the input
// (*payment.FieldError names the line and field), of the webhook listener,
// or of writing the output; ErrUnauthenticated; *PendingError when the
// timeout (or ctx) ended the run with rows still pending, after the output
// and summary were written. In the file shape also the errors of the
// upload and of the output object, and *ExecutionFailedError; a timeout
// (or ctx) before the file's execution ended returns a *PendingError
// counting every row, and nothing is written.
func Run(ctx context.Context, cfg Config, stdout io.Writer, logger *slog.Logger) (Summary, error) {
	start := time.Now()
	serving := false
	defer func() {
		// A listener handed in is closed even when Run fails before serving.
		if !serving && cfg.WebhookListener != nil {
			_ = cfg.WebhookListener.Close()
		}
	}()
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return Summary{}, err
	}
	data, err := os.ReadFile(cfg.Input)
	if err != nil {
		return Summary{}, fmt.Errorf("csvapp: read input: %w", err)
	}
	payments, err := payment.ReadCSV(bytes.NewReader(data))
	if err != nil {
		return Summary{}, fmt.Errorf("csvapp: %s: %w", cfg.Input, err)
	}
	fileSum := sha256.Sum256(data)
	verifier, err := client.NewEventVerifier(cfg.WebhookSecret)
	if err != nil {
		return Summary{}, fmt.Errorf("%w: --webhook-secret: %w", ErrConfig, err)
	}
	capability := Capability
	var (
		rows    []*row
		job     fileJob
		objects *objectstore.Local
	)
	if cfg.Shape == ShapeFile {
		// One "row" stands for the file's one execution.
		if job, err = newFileJob(cfg.ObjectsPrefix, cfg.Input, fileSum); err != nil {
			return Summary{}, err
		}
		if objects, err = openObjects(cfg.ObjectsDir); err != nil {
			return Summary{}, err
		}
		defer objects.Close()
		if err := upload(ctx, objects, job, payments); err != nil {
			return Summary{}, err
		}
		logger.Info("uploaded the input", slog.String("object", job.sourceKey), slog.Int("rows", len(payments)))
		capability = FileCapability
		rows = []*row{{key: job.key, input: job.input}}
	} else {
		rows = make([]*row, len(payments))
		for i, p := range payments {
			rows[i] = &row{payment: p, key: IdempotencyKey(fileSum, p.ID), input: payment.EncodeJSON(p)}
		}
	}

	runCtx, cancelTimeout := context.WithTimeout(ctx, cfg.Timeout)
	defer cancelTimeout()
	runCtx, abort := context.WithCancelCause(runCtx)
	defer abort(nil)

	tr := newTracker(rows, cfg.PendingAfter)

	// The receiver starts first: events may arrive before invokes answer.
	lis := cfg.WebhookListener
	if lis == nil {
		var lc net.ListenConfig
		lis, err = lc.Listen(runCtx, "tcp", cfg.WebhookListen)
		if err != nil {
			return Summary{}, fmt.Errorf("csvapp: webhook listen %s: %w", cfg.WebhookListen, err)
		}
	}
	rc := &receiver{verifier: verifier, tracker: tr, logger: logger}
	srv := &http.Server{
		Handler:           rc.handler(),
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       30 * time.Second,
		ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
	}
	serving = true
	var bg sync.WaitGroup
	bg.Go(func() {
		if err := srv.Serve(lis); !errors.Is(err, http.ErrServerClosed) {
			logger.Error("webhook receiver stopped", slog.Any("error", err))
			abort(fmt.Errorf("csvapp: webhook receiver: %w", err))
		}
	})
	defer func() {
		// Let deliveries in progress finish briefly, then close whatever
		// is left (a connection that never sent a request would otherwise
		// hold Shutdown for 5s); the sender retries what was cut off.
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), receiverShutdownGrace)
		defer cancel()
		if err := srv.Shutdown(sctx); err != nil {
			_ = srv.Close()
		}
		bg.Wait()
	}()
	logger.Info("webhook receiver listening", slog.String("addr", lis.Addr().String()), slog.Int("rows", len(rows)))

	cl, err := client.Dial(runCtx, cfg.Gateway, cfg.APIKey, cfg.DialOptions...)
	if err != nil {
		return Summary{}, fmt.Errorf("csvapp: %w", err)
	}
	defer func() { _ = cl.Close() }()

	w := &worker{cfg: cfg, capability: capability, client: cl, tracker: tr, logger: logger, abort: abort}
	workCtx, stopWork := context.WithCancel(runCtx)
	var work sync.WaitGroup
	work.Go(func() { w.invokeAll(workCtx) })
	work.Go(func() { w.poll(workCtx) })

	select {
	case <-tr.Done():
	case <-runCtx.Done():
	}
	stopWork()
	work.Wait()

	if cause := context.Cause(runCtx); errors.Is(cause, ErrUnauthenticated) {
		return tr.counts(), cause
	} else if tr.counts().Pending > 0 && cause != nil && !errors.Is(cause, context.DeadlineExceeded) && !errors.Is(cause, context.Canceled) {
		return tr.counts(), cause // the receiver failed
	}

	if cfg.Shape == ShapeFile {
		return finishFileRun(ctx, runCtx, cfg, cl, objects, job, tr, payments, start, stdout)
	}
	sum := tr.counts()
	sum.Output = cfg.OutputPath()
	if err := writeOutput(sum.Output, tr.snapshot()); err != nil {
		return sum, err
	}
	sum.Elapsed = time.Since(start)
	if _, err := sum.WriteTo(stdout); err != nil {
		return sum, err
	}
	if sum.Pending > 0 {
		cause := context.Cause(runCtx)
		if cause == nil {
			cause = context.Canceled
		}
		return sum, &PendingError{Pending: sum.Pending, Cause: cause}
	}
	return sum, nil
}

// finishFileRun ends a file-shape run once its one execution is terminal
// (or the run ended): it reads the execution, copies the output object and
// prints the summary, whose row counts come from the output.
func finishFileRun(ctx, runCtx context.Context, cfg Config, cl *client.Client, objects *objectstore.Local, job fileJob,
	tr *tracker, payments []payment.Payment, start time.Time, stdout io.Writer) (Summary, error) {
	counts := tr.counts()
	sum := Summary{RowsIn: len(payments), InvokedNew: counts.InvokedNew, InvokedDuplicate: counts.InvokedDuplicate,
		EventsDelivered: counts.EventsDelivered, DuplicateEvents: counts.DuplicateEvents, Shape: ShapeFile, Object: job.outputKey}
	execID := tr.snapshot()[0].executionID
	if counts.Rejected > 0 {
		o := tr.snapshot()[0].out
		return sum, fmt.Errorf("csvapp: the gateway refused the invoke of %s: %s: %s", FileCapability, o.FailureClass, o.FailureMessage)
	}
	if counts.Pending > 0 {
		sum.Pending = len(payments)
		sum.ExecutionID = execID
		cause := context.Cause(runCtx)
		if cause == nil {
			cause = context.Canceled
		}
		return sum, &PendingError{Pending: len(payments), Cause: cause}
	}
	// The execution is terminal: its output is read with a fresh deadline
	// even when the run's context is about to end.
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*cfg.RPCTimeout)
	defer cancel()
	if err := finishFile(fctx, cfg, cl, objects, job, execID, payments, &sum); err != nil {
		return sum, err
	}
	sum.Output = cfg.OutputPath()
	sum.Elapsed = time.Since(start)
	if _, err := sum.WriteTo(stdout); err != nil {
		return sum, err
	}
	return sum, nil
}

// worker invokes rows and polls pending ones.
type worker struct {
	cfg        Config
	capability string // Capability, or FileCapability in the file shape
	client     *client.Client
	tracker    *tracker
	logger     *slog.Logger
	abort      context.CancelCauseFunc
}

// transient reports whether an invoke or get failing with code may succeed
// when repeated with the same idempotency key.
func transient(err error) bool {
	st := status.Convert(err)
	switch st.Code() {
	case codes.Unavailable, codes.DeadlineExceeded:
		return true
	case codes.ResourceExhausted:
		// A rate limit passes; a message over gRPC's size limit never does.
		return !strings.Contains(st.Message(), "larger than max")
	}
	return false
}

// newBackOff returns the retry schedule of transient failures: 100ms
// doubling (with jitter) up to 5s, until the run's context ends.
func newBackOff() backoff.BackOff {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval = 100 * time.Millisecond
	b.MaxInterval = 5 * time.Second
	b.Multiplier = 2
	return b
}

// retry calls op until it succeeds, fails with a code that is not
// transient, or ctx ends; each call gets cfg.RPCTimeout.
func retry[T any](ctx context.Context, rpcTimeout time.Duration, op func(context.Context) (T, error)) (T, error) {
	return backoff.Retry(ctx, func() (T, error) {
		cctx, cancel := context.WithTimeout(ctx, rpcTimeout)
		defer cancel()
		v, err := op(cctx)
		if err != nil && (!transient(err) || ctx.Err() != nil) {
			return v, backoff.Permanent(err)
		}
		return v, err
	}, backoff.WithBackOff(newBackOff()), backoff.WithMaxElapsedTime(0))
}

// invokeAll invokes every row, cfg.Concurrency at a time, in input order.
func (w *worker) invokeAll(ctx context.Context) {
	idx := make(chan int)
	var wg sync.WaitGroup
	for range min(w.cfg.Concurrency, max(len(w.tracker.rows), 1)) {
		wg.Go(func() {
			for i := range idx {
				w.invokeRow(ctx, i)
			}
		})
	}
feed:
	for i := range w.tracker.rows {
		select {
		case idx <- i:
		case <-ctx.Done():
			break feed
		}
	}
	close(idx)
	wg.Wait()
}

// invokeRow invokes row i, retrying transient failures with the same
// idempotency key, and reads the outcome with Get when the answer is
// already terminal.
func (w *worker) invokeRow(ctx context.Context, i int) {
	if ctx.Err() != nil {
		return
	}
	r := w.tracker.rows[i]
	resp, err := retry(ctx, w.cfg.RPCTimeout, func(cctx context.Context) (*executionv1.InvokeCapabilityResponse, error) {
		return w.client.Invoke(cctx, w.capability, r.input, "application/json", r.key)
	})
	if err != nil {
		if ctx.Err() != nil {
			return // the run ended; the row stays pending
		}
		st := grpcStatus(err)
		if st.Code() == codes.Unauthenticated {
			w.abort(fmt.Errorf("%w: %s", ErrUnauthenticated, st.Message()))
			return
		}
		w.logger.Warn("invoke rejected", slog.String("row_id", r.payment.ID), slog.String("code", st.Code().String()), slog.String("message", st.Message()))
		w.tracker.onRejected(i, "invoke."+snakeCode(st.Code()), st.Message())
		return
	}
	if !w.tracker.onInvoked(i, resp, time.Now()) {
		return
	}
	ex, err := retry(ctx, w.cfg.RPCTimeout, func(cctx context.Context) (*executionv1.Execution, error) {
		return w.client.Get(cctx, resp.GetExecutionId())
	})
	if err != nil {
		if ctx.Err() == nil {
			w.logger.Warn("get after duplicate invoke failed; the poll will retry", slog.String("execution_id", resp.GetExecutionId()), slog.Any("error", err))
		}
		return
	}
	w.tracker.onExecution(i, ex)
}

// poll checks, every cfg.PollInterval, the rows whose webhook is overdue
// (see Config.PendingAfter) with Get, cfg.Concurrency at a time.
func (w *worker) poll(ctx context.Context) {
	t := time.NewTicker(w.cfg.PollInterval)
	defer t.Stop()
	sem := make(chan struct{}, w.cfg.Concurrency)
	for {
		select {
		case <-ctx.Done():
			return
		case <-w.tracker.Done():
			return
		case now := <-t.C:
			due := w.tracker.duePolls(now)
			if len(due) == 0 {
				continue
			}
			w.logger.Debug("polling overdue rows", slog.Int("rows", len(due)))
			var wg sync.WaitGroup
			for _, it := range due {
				select {
				case sem <- struct{}{}:
				case <-ctx.Done():
				}
				if ctx.Err() != nil {
					break
				}
				wg.Go(func() {
					defer func() { <-sem }()
					cctx, cancel := context.WithTimeout(ctx, w.cfg.RPCTimeout)
					defer cancel()
					ex, err := w.client.Get(cctx, it.executionID)
					if err != nil {
						if ctx.Err() == nil {
							w.logger.Debug("poll failed", slog.String("execution_id", it.executionID), slog.Any("error", err))
						}
						return
					}
					w.tracker.onExecution(it.row, ex)
				})
			}
			wg.Wait()
		}
	}
}

// grpcStatus returns the gRPC status inside err's chain (unlike
// status.Convert, it keeps the status's own message), or UNKNOWN.
func grpcStatus(err error) *status.Status {
	var gs interface{ GRPCStatus() *status.Status }
	if errors.As(err, &gs) {
		return gs.GRPCStatus()
	}
	return status.New(codes.Unknown, err.Error())
}

// snakeCode turns codes.InvalidArgument into "invalid_argument".
func snakeCode(c codes.Code) string {
	var b strings.Builder
	for i, r := range c.String() {
		if unicode.IsUpper(r) {
			if i > 0 {
				b.WriteByte('_')
			}
			r = unicode.ToLower(r)
		}
		b.WriteRune(r)
	}
	return b.String()
}
