package steps

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"syscall"
	"time"

	"github.com/google/uuid"

	"github.com/capstan-dev/capstan/internal/adapterclient"
	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/itemsource"
	"github.com/capstan-dev/capstan/internal/objectstore"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
	adapterv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/adapter/v1"
)

// MaxItemBytes bounds one source item (a CSV row's fields, a JSON Lines
// line): sent base64-encoded inside an InteractionRequest, it must stay
// well below a Kafka record's usual limit of 1 MB.
const MaxItemBytes = 256 << 10

// maxOpenBatch bounds the items opened (and sent) in one round trip.
const maxOpenBatch = 256

// session is one attempt's live session over its step unit.
type session struct {
	r    *Runner
	e    execution.Execution
	cp   config.Capability
	a    *config.AwaitStep
	in   Input
	unit pgstore.StepUnit
	log  *slog.Logger

	src    itemsource.Source
	header []string
	closer io.Closer
	reader *readErrs
	claim  uuid.UUID
	sum    Summary

	wake      <-chan struct{}
	mapped    chan mapDone
	mapping   int           // map calls started and not yet applied
	mapSlots  chan struct{} // bounds the map calls running at once
	mapCancel context.CancelFunc
}

// maxMapCalls bounds the map calls of one session running at once.
const maxMapCalls = 16

// slot is an item open in the window.
type slot struct {
	item  itemsource.Item
	state pgstore.ItemState
	ready bool // terminal and, with a map step, mapped: may be consumed
}

type mapDone struct {
	seq     int
	outcome execution.Outcome
	err     error
}

func (s *session) run(ctx context.Context) (Summary, error) {
	s.sum = Summary{Object: s.in.Output, Format: s.cp.Steps.Publish.Format, Cardinality: s.a.Cardinality, Window: s.a.Window}
	s.claim = uuid.New()
	wake, unsubscribe := s.r.hub.Subscribe(s.unit.ID)
	defer unsubscribe()
	s.wake = wake
	if s.a.Cardinality == config.OneToOne {
		// Read the whole source once before sending anything: a malformed
		// row in the middle must fail the file before any row is paid,
		// not after. The lazy second read is the one that streams.
		if err := s.validateSource(ctx); err != nil {
			return s.sum, err
		}
	}
	if err := s.openSource(ctx); err != nil {
		return s.sum, err
	}
	defer s.closer.Close()
	w, err := s.r.objects.Create(ctx, s.in.Output)
	if err != nil {
		return s.sum, publishErr(err)
	}
	committed := false
	defer func() {
		if !committed {
			_ = w.Abort(context.WithoutCancel(ctx))
		}
	}()
	cw := newCountingWriter(w)
	bw := bufio.NewWriterSize(cw, 64<<10)
	cols := s.cp.Steps.Publish.Columns
	if len(cols) == 0 {
		cols = DefaultColumns(s.cp.Steps.Source.Format, s.header)
	}
	rd := NewRenderer(bw, s.cp.Steps.Publish.Format, cols)
	if err := rd.Begin(); err != nil {
		return s.sum, publishErr(err)
	}
	if s.a.Cardinality == config.OneToOne {
		err = s.streamItems(ctx, rd)
	} else {
		err = s.collected(ctx, rd)
	}
	if err != nil {
		return s.sum, err
	}
	if err := rd.Flush(); err != nil {
		return s.sum, publishErr(err)
	}
	if err := bw.Flush(); err != nil {
		return s.sum, publishErr(err)
	}
	if ctx.Err() != nil {
		return s.sum, ctx.Err()
	}
	// Object Publish: the output becomes visible under its key only now,
	// and only then may the execution succeed. A session that lost its
	// lease (another attempt may be publishing) does not commit.
	if _, err := s.r.store.LeaseRenew(ctx, s.e.ID, s.e.Attempt, s.e.LeaseToken, s.cp.Policy().LeaseDuration); err != nil {
		return s.sum, err
	}
	if err := w.Commit(ctx); err != nil {
		return s.sum, publishErr(err)
	}
	committed = true
	s.sum.Bytes, s.sum.SHA256 = cw.n, cw.sum()
	return s.sum, nil
}

func publishErr(err error) error {
	switch {
	case errors.Is(err, objectstore.ErrInvalidKey):
		return fail(ClassInputInvalid, false, "input.output: %v", err)
	case errors.Is(err, syscall.EEXIST), errors.Is(err, syscall.ENOTDIR), errors.Is(err, syscall.EISDIR),
		errors.Is(err, syscall.ENAMETOOLONG):
		// The key can never be published as it stands (a directory or a
		// file in the way, a name too long): retrying would not help.
		return fail(ClassInputInvalid, false, "input.output: cannot be published: %v", err)
	}
	if errors.Is(err, context.Canceled) {
		return err
	}
	return fail(ClassPublishFailed, true, "%v", err)
}

// validateSource reads every item of the source (holding one at a time)
// and returns the first problem, as the streaming read would meet it.
func (s *session) validateSource(ctx context.Context) error {
	if err := s.openSource(ctx); err != nil {
		return err
	}
	defer s.closer.Close()
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		if _, err := s.src.Next(); err == io.EOF {
			return nil
		} else if err != nil {
			return s.sourceErr(err)
		}
	}
}

// openSource opens the source object and reads the CSV header.
func (s *session) openSource(ctx context.Context) error {
	rc, err := s.r.objects.Open(ctx, s.in.Source)
	switch {
	case errors.Is(err, objectstore.ErrNotFound):
		return fail(ClassInputInvalid, false, "input.source: no object %q", s.in.Source)
	case errors.Is(err, objectstore.ErrInvalidKey):
		return fail(ClassInputInvalid, false, "input.source: %v", err)
	case err != nil:
		return fail(ClassSourceUnavailable, true, "open %q: %v", s.in.Source, err)
	}
	s.closer = rc
	s.reader = &readErrs{r: rc}
	opts := itemsource.Options{MaxLineBytes: MaxItemBytes}
	if s.a.Cardinality != config.OneToOne {
		opts.MaxItems = s.a.MaxItems
	}
	if s.cp.Steps.Source.Format == "csv" {
		c := itemsource.NewCSV(bufio.NewReaderSize(s.reader, 64<<10), opts)
		s.src = &peekSource{Source: c}
		// The header is known after the first read; peek it.
		if err := s.src.(*peekSource).peek(); err != nil && err != io.EOF {
			rc.Close()
			return s.sourceErr(err)
		}
		s.header = c.Header()
	} else {
		s.src = &peekSource{Source: itemsource.NewJSONLines(bufio.NewReaderSize(s.reader, 64<<10), opts)}
	}
	return nil
}

func (s *session) sourceErr(err error) error {
	var lim *itemsource.LimitError
	if errors.As(err, &lim) {
		return fail(ClassTooManyItems, false, "the source holds more than await.max_items (%d) items", lim.Limit)
	}
	if errors.Is(err, context.Canceled) {
		return err
	}
	if s.reader != nil && s.reader.err != nil {
		// The object could not be read (not a malformed item): retry.
		return fail(ClassSourceUnavailable, true, "read %q: %v", s.in.Source, s.reader.err)
	}
	return fail(ClassSourceInvalid, false, "input.source %q: %v", s.in.Source, err)
}

// readErrs remembers the first error of the source object's reader other
// than io.EOF, to tell a failed read from a malformed item.
type readErrs struct {
	r   io.Reader
	err error
}

func (r *readErrs) Read(p []byte) (int, error) {
	n, err := r.r.Read(p)
	if err != nil && err != io.EOF && r.err == nil {
		r.err = err
	}
	return n, err
}

// request is an item's interaction request (a JSON object).
func request(it itemsource.Item) []byte {
	if it.Fields != nil {
		return FieldsJSON(it.Fields)
	}
	return it.JSON
}

// streamItems is ONE_TO_ONE over the source: one interaction per item, at
// most Window open and not yet consumed, consumed in input order.
func (s *session) streamItems(ctx context.Context, rd *Renderer) error {
	window := s.a.Window
	slots := make([]*slot, window)
	head, next := 0, 0
	defer func() { s.r.m.inFlight.Add(context.WithoutCancel(ctx), -int64(next-head)) }()
	eof := false
	s.mapped = make(chan mapDone, window)
	s.mapSlots = make(chan struct{}, min(window, maxMapCalls))
	// Map calls run under mctx, cancelled when the session ends so that
	// draining them does not wait out their timeouts.
	mctx, mapCancel := context.WithCancel(ctx)
	s.mapCancel = mapCancel
	defer s.drainMaps()
	for {
		if !eof && next-head < window {
			n := min(window-(next-head), maxOpenBatch)
			batch := make([]itemsource.Item, 0, n)
			for len(batch) < n {
				it, err := s.src.Next()
				if err == io.EOF {
					eof = true
					break
				}
				if err != nil {
					return s.sourceErr(err)
				}
				batch = append(batch, it)
			}
			if len(batch) > 0 {
				states, err := s.open(ctx, next, batch)
				if err != nil {
					return err
				}
				for k, st := range states {
					sl := &slot{item: batch[k], state: st}
					slots[st.Seq%window] = sl
					if st.Outcome != nil {
						s.sum.Replayed++
						s.r.count(ctx, "replayed", 1)
						s.terminal(mctx, sl)
					}
				}
				next += len(batch)
				s.r.m.inFlight.Add(ctx, int64(len(batch)))
				s.sum.MaxInFlight = max(s.sum.MaxInFlight, next-head)
			}
		}
		for head < next && slots[head%window].ready {
			sl := slots[head%window]
			if err := s.consume(rd, sl); err != nil {
				return err
			}
			slots[head%window] = nil
			head++
			s.r.m.inFlight.Add(ctx, -1)
			s.r.count(ctx, "consumed", 1)
		}
		s.sum.Items = next
		if eof && head == next {
			return nil
		}
		if !eof && next-head < window {
			continue // room in the window: read on
		}
		if err := s.waitAndRefresh(ctx, mctx, slots, head, next); err != nil {
			return err
		}
	}
}

// open opens a batch of items and sends those this session claimed.
func (s *session) open(ctx context.Context, first int, batch []itemsource.Item) ([]pgstore.ItemState, error) {
	reqs := make([]pgstore.ItemRequest, len(batch))
	for k, it := range batch {
		reqs[k] = pgstore.ItemRequest{Seq: first + k, Request: request(it), ContentType: "application/json"}
	}
	var states []pgstore.ItemState
	err := pgstore.Retry(ctx, s.log, func() error {
		var err error
		states, err = s.r.store.ItemsOpen(ctx, pgstore.ItemsOpenParams{Unit: s.unit, ExecutionID: s.e.ID,
			ApplicationID: s.e.ApplicationID, Attempt: s.e.Attempt, LeaseToken: s.e.LeaseToken,
			Capability: s.e.Capability, Transport: s.a.Transport, Items: reqs,
			Timeout: s.cp.AwaitDeadline(), ClaimToken: s.claim, ClaimFor: s.r.ClaimFor})
		return err
	})
	if err != nil {
		return nil, err
	}
	var send []pgstore.InteractionDispatch
	for k, st := range states {
		if !st.Send {
			continue
		}
		send = append(send, pgstore.InteractionDispatch{Interaction: pgstore.Interaction{
			ID: st.InteractionID, CorrelationID: st.CorrelationID, ExecutionID: s.e.ID, ApplicationID: s.e.ApplicationID,
			Capability: s.e.Capability, Status: st.Status, Transport: s.a.Transport, Request: reqs[k].Request,
			ContentType: reqs[k].ContentType, Deadline: st.Deadline}, Attempt: s.unit.Attempt, Dispatches: st.Sends - 1})
	}
	if len(send) == 0 {
		return states, nil
	}
	if s.r.sender == nil {
		return nil, fail(execution.ClassConfigMissing, false, "this consumer has no sender for the %s transport (callback_secret)", s.a.Transport)
	}
	// A send must end well inside the claim: past it, the background
	// sender may take the same items. One that runs out is a failed send,
	// retried with the same interaction.
	sctx, cancel := context.WithTimeout(ctx, s.r.ClaimFor/2)
	errs := s.r.sender.SendBatch(sctx, s.a, send)
	cancel()
	var ok, failed []uuid.UUID
	for k, err := range errs {
		if err != nil {
			failed = append(failed, send[k].ID)
			s.log.Warn("item send failed; the sender retries it", "interaction_id", send[k].ID, "error", err)
		} else {
			ok = append(ok, send[k].ID)
		}
	}
	s.sum.Sent += len(ok)
	s.r.count(ctx, "sent", len(ok))
	// Recording the sends may fail at shutdown: the claim then expires and
	// the items are sent again with the same interaction id.
	if len(ok) > 0 {
		if err := pgstore.Retry(ctx, s.log, func() error { return s.r.store.ItemsSent(ctx, ok, s.claim) }); err != nil {
			return nil, err
		}
	}
	if len(failed) > 0 {
		if err := pgstore.Retry(ctx, s.log, func() error {
			return s.r.store.ItemsSendFailed(ctx, failed, s.claim, s.r.SendRetry)
		}); err != nil {
			return nil, err
		}
	}
	return states, nil
}

// terminal handles an item that became terminal: ready at once, or after
// its map call.
func (s *session) terminal(mctx context.Context, sl *slot) {
	m := s.cp.Steps.Map
	if m == nil || !sl.state.Outcome.Succeeded {
		sl.ready = true
		return
	}
	s.mapping++
	seq, in := sl.state.Seq, sl.state.Outcome.Output
	go func() {
		select {
		case s.mapSlots <- struct{}{}:
		case <-mctx.Done():
			s.mapped <- mapDone{seq: seq, err: mctx.Err()}
			return
		}
		out, err := s.mapItem(mctx, m, seq, in)
		<-s.mapSlots
		s.mapped <- mapDone{seq: seq, outcome: out, err: err}
	}()
}

// mapItem calls the map adapter with an item's result, retrying transient
// failures three times.
func (s *session) mapItem(ctx context.Context, m *config.MapStep, seq int, in []byte) (execution.Outcome, error) {
	wait := 100 * time.Millisecond
	for try := 1; ; try++ {
		cctx, cancel := context.WithTimeout(ctx, m.Timeout)
		resp, err := s.r.mapper.Execute(cctx, m.Adapter, &adapterv1.ExecuteRequest{
			ExecutionId: s.e.ID.String(), Attempt: int32(s.e.Attempt), Capability: s.e.Capability + "#map",
			Release: s.e.Release, Input: in, ContentType: "application/json", ApplicationId: s.e.ApplicationID.String()})
		cancel()
		out := adapterclient.Classify(resp, err)
		switch {
		case out.Succeeded || (!out.Accepted && !out.Failure.Retryable):
			return out, nil
		case out.Accepted:
			return out, fail(ClassInvalidResult, false, "item %d: the map adapter answered accepted; a map must answer at once", seq+1)
		case try == 3 || ctx.Err() != nil:
			return out, fail(ClassMapUnavailable, true, "item %d: %s: %s", seq+1, out.Failure.Class, out.Failure.Message)
		}
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
		wait *= 2
	}
}

// drainMaps cancels the map calls still running and waits for them.
func (s *session) drainMaps() {
	if s.mapCancel != nil {
		s.mapCancel()
	}
	for ; s.mapping > 0; s.mapping-- {
		<-s.mapped
	}
}

// applyMap records a finished map call.
func (s *session) applyMap(slots []*slot, d mapDone) error {
	s.mapping--
	if d.err != nil {
		return d.err
	}
	sl := slots[d.seq%len(slots)]
	if sl == nil || sl.state.Seq != d.seq {
		return nil
	}
	o := d.outcome
	sl.state.Outcome = &o
	sl.ready = true
	return nil
}

// waitAndRefresh waits for a notification, a finished map or the poll
// interval, then reads the outcomes of the open items that are not
// terminal yet.
func (s *session) waitAndRefresh(ctx, mctx context.Context, slots []*slot, head, next int) error {
	t := time.NewTimer(s.r.Poll)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case d := <-s.mapped:
		return s.applyMap(slots, d)
	case <-s.wake:
	case <-t.C:
	}
	var open []int32
	for seq := head; seq < next; seq++ {
		if sl := slots[seq%len(slots)]; sl.state.Outcome == nil {
			open = append(open, int32(seq))
		}
	}
	if len(open) == 0 {
		return nil
	}
	var states []pgstore.ItemState
	err := pgstore.Retry(ctx, s.log, func() error {
		var err error
		states, err = s.r.store.ItemsTerminal(ctx, s.unit.ID, open)
		return err
	})
	if err != nil {
		return err
	}
	for _, st := range states {
		sl := slots[st.Seq%len(slots)]
		sl.state = st
		s.terminal(mctx, sl)
	}
	return nil
}

// consume renders a ready item into the output.
func (s *session) consume(rd *Renderer, sl *slot) error {
	o := sl.state.Outcome
	row := &Row{Index: sl.state.Seq + 1, Fields: sl.item.Fields, JSON: sl.item.JSON,
		Status: rowStatus(sl.state.Status, o), InteractionID: sl.state.InteractionID.String(),
		ExecutionID: s.e.ID.String(), Sends: sl.state.Sends}
	if o.Succeeded {
		row.Result = o.Output
		s.sum.Succeeded++
	} else {
		f := o.Failure
		row.Failure = &f
		s.sum.Failed++
	}
	if err := rd.Write(row); err != nil {
		return publishErr(err)
	}
	s.sum.Rows++
	return nil
}

// collected runs the collecting cardinalities: MANY_TO_ONE and
// MANY_TO_MANY send the items as one JSON array, ONE_TO_MANY sends its one
// item; *_TO_MANY completions are JSON arrays, one output row each. An
// empty input sends nothing and publishes an empty output, except for
// MANY_TO_ONE, whose one request is then an empty array.
func (s *session) collected(ctx context.Context, rd *Renderer) error {
	var items [][]byte
	for {
		it, err := s.src.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return s.sourceErr(err)
		}
		items = append(items, request(it))
	}
	s.sum.Items = len(items)
	if len(items) == 0 && s.a.Cardinality != config.ManyToOne {
		return nil
	}
	var req []byte
	if s.a.Cardinality == config.OneToMany {
		if len(items) > 1 {
			return fail(ClassInputInvalid, false, "input.source: ONE_TO_MANY takes one item; the source holds %d", len(items))
		}
		req = items[0]
	} else {
		var err error
		raw := make([]json.RawMessage, len(items))
		for k, b := range items {
			raw[k] = b
		}
		if req, err = json.Marshal(raw); err != nil {
			return fail(ClassSourceInvalid, false, "encode the collected items: %v", err)
		}
	}
	items = nil
	states, err := s.open(ctx, 0, []itemsource.Item{{JSON: req}})
	if err != nil {
		return err
	}
	st := states[0]
	if st.Outcome != nil {
		s.sum.Replayed++
	}
	s.sum.MaxInFlight = 1
	for st.Outcome == nil {
		slots := []*slot{{state: st}}
		if err := s.waitAndRefresh(ctx, ctx, slots, 0, 1); err != nil {
			return err
		}
		st = slots[0].state
	}
	o := st.Outcome
	if !o.Succeeded {
		f := o.Failure
		f.Retryable = false // the unit spans attempts: a retry would read the same answer
		return &stepFailure{f}
	}
	rows := [][]byte{o.Output}
	if s.a.Cardinality != config.ManyToOne {
		var list []json.RawMessage
		if err := json.Unmarshal(o.Output, &list); err != nil {
			return fail(ClassInvalidResult, false, "the %s completion must be a JSON array: %v", s.a.Cardinality, err)
		}
		if len(list) > s.a.MaxItems {
			return fail(ClassTooManyItems, false, "the completion lists %d items, more than await.max_items (%d)", len(list), s.a.MaxItems)
		}
		rows = make([][]byte, len(list))
		for k, r := range list {
			rows[k] = r
		}
	}
	for k, r := range rows {
		row := &Row{Index: k + 1, Status: RowSucceeded, Result: r, InteractionID: st.InteractionID.String(),
			ExecutionID: s.e.ID.String(), Sends: st.Sends}
		if err := rd.Write(row); err != nil {
			return publishErr(err)
		}
		s.sum.Rows++
		s.sum.Succeeded++
	}
	return nil
}

// peekSource lets the session read the first item early (to learn the CSV
// header) without losing it.
type peekSource struct {
	itemsource.Source
	head   *itemsource.Item
	headEr error
	peeked bool
}

func (p *peekSource) peek() error {
	it, err := p.Source.Next()
	p.peeked = true
	if err != nil {
		p.headEr = err
		return err
	}
	p.head = &it
	return nil
}

func (p *peekSource) Next() (itemsource.Item, error) {
	if p.peeked {
		p.peeked = false
		if p.headEr != nil {
			return itemsource.Item{}, p.headEr
		}
		return *p.head, nil
	}
	return p.Source.Next()
}
