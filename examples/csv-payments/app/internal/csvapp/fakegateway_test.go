package csvapp

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/csv"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/capstan-dev/capstan/examples/csv-payments/payment"
	"github.com/capstan-dev/capstan/internal/objectstore"
	"github.com/capstan-dev/capstan/internal/steps"
	eventv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/event/v1"
	executionv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/execution/v1"
)

const (
	testAPIKey = "app-key-1"
	testAppID  = "app-1"
)

var testSecret = "whsec_" + base64.StdEncoding.EncodeToString([]byte("csv-payments test webhook secret"))

// fakeGateway implements ExecutionService in memory: it settles each new
// execution by itself with payment.Decide, shortly after accepting it, and
// POSTs a signed completion webhook to the application.
type fakeGateway struct {
	executionv1.UnimplementedExecutionServiceServer

	wh        *standardwebhooks.Webhook
	http      *http.Client
	transport *http.Transport
	addr      string

	// Knobs, set before the run.
	settle          bool                 // settle executions at all
	sendWebhooks    atomic.Bool          // deliver webhooks
	duplicateEvery  int                  // deliver every Nth webhook twice (0: never)
	beforeAnswer    int                  // every Nth execution settles and is delivered before the invoke answers
	unavailableOnce map[string]bool      // row IDs whose first invoke fails UNAVAILABLE (nothing committed)
	rejectIDs       map[string]bool      // row IDs refused with INVALID_ARGUMENT
	failClass       map[string][]string  // row IDs settled FAILED with [class, reason] instead
	objectsDir      string               // the object store of FileCapability (empty: not served)
	fileFailure     *executionv1.Failure // settle FileCapability executions FAILED with this
	fileSwapRows    bool                 // publish the first two output rows swapped

	mu             sync.Mutex
	webhookURL     string
	byKey          map[string]*executionv1.Execution
	byID           map[string]*executionv1.Execution
	failedOnce     map[string]bool
	seq            int
	stopping       bool
	lastWebhookErr string

	invokes, accepted, gets, webhooksSent, webhooksOK, webhookErrors atomic.Int64
	deliveries                                                       sync.WaitGroup
}

// startFakeGateway serves a fake gateway on loopback until the test ends.
func startFakeGateway(t *testing.T) *fakeGateway {
	t.Helper()
	wh, err := standardwebhooks.NewWebhook(testSecret)
	if err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	g := &fakeGateway{
		wh:         wh,
		transport:  tr,
		http:       &http.Client{Transport: tr, Timeout: 5 * time.Second},
		settle:     true,
		byKey:      map[string]*executionv1.Execution{},
		byID:       map[string]*executionv1.Execution{},
		failedOnce: map[string]bool{},
	}
	g.sendWebhooks.Store(true)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g.addr = lis.Addr().String()
	srv := grpc.NewServer()
	executionv1.RegisterExecutionServiceServer(srv, g)
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	t.Cleanup(func() {
		srv.Stop()
		<-done
		g.mu.Lock()
		g.stopping = true
		g.mu.Unlock()
		g.deliveries.Wait()
		tr.CloseIdleConnections()
	})
	return g
}

// setWebhookURL points deliveries at the application's receiver.
func (g *fakeGateway) setWebhookURL(u string) {
	g.mu.Lock()
	g.webhookURL = u
	g.mu.Unlock()
}

func (g *fakeGateway) auth(ctx context.Context) error {
	md, _ := metadata.FromIncomingContext(ctx)
	if v := md.Get("authorization"); len(v) != 1 || v[0] != "Bearer "+testAPIKey {
		return status.Error(codes.Unauthenticated, "unknown api key")
	}
	return nil
}

func (g *fakeGateway) InvokeCapability(ctx context.Context, req *executionv1.InvokeCapabilityRequest) (*executionv1.InvokeCapabilityResponse, error) {
	g.invokes.Add(1)
	if err := g.auth(ctx); err != nil {
		return nil, err
	}
	if req.GetCapability() == FileCapability && g.objectsDir != "" {
		return g.invokeFile(req)
	}
	if req.GetCapability() != Capability {
		return nil, status.Errorf(codes.NotFound, "unknown capability %q", req.GetCapability())
	}
	p, err := payment.DecodeJSON(req.GetInput())
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, "input: not JSON")
	}
	if g.rejectIDs[p.ID] {
		return nil, status.Error(codes.InvalidArgument, "input: rejected by the fake gateway")
	}

	g.mu.Lock()
	if g.unavailableOnce[p.ID] && !g.failedOnce[p.ID] {
		g.failedOnce[p.ID] = true
		g.mu.Unlock()
		return nil, status.Error(codes.Unavailable, "database could not commit")
	}
	if ex, ok := g.byKey[req.GetIdempotencyKey()]; ok && req.GetIdempotencyKey() != "" {
		resp := &executionv1.InvokeCapabilityResponse{
			ExecutionId: ex.GetExecutionId(),
			Acceptance:  executionv1.InvokeAcceptance_INVOKE_ACCEPTANCE_DUPLICATE,
			Status:      ex.GetStatus(),
		}
		g.mu.Unlock()
		return resp, nil
	}
	g.seq++
	seq := g.seq
	ex := &executionv1.Execution{
		ExecutionId:    uuid.NewString(),
		Capability:     req.GetCapability(),
		Release:        "v1",
		Status:         executionv1.ExecutionStatus_EXECUTION_STATUS_QUEUED,
		IdempotencyKey: req.GetIdempotencyKey(),
		CreatedAt:      timestamppb.Now(),
	}
	g.byKey[req.GetIdempotencyKey()] = ex
	g.byID[ex.GetExecutionId()] = ex
	g.mu.Unlock()
	g.accepted.Add(1)

	resp := &executionv1.InvokeCapabilityResponse{
		ExecutionId: ex.GetExecutionId(),
		Acceptance:  executionv1.InvokeAcceptance_INVOKE_ACCEPTANCE_ACCEPTED,
		Status:      executionv1.ExecutionStatus_EXECUTION_STATUS_QUEUED,
	}
	if !g.settle {
		return resp, nil
	}
	if g.beforeAnswer > 0 && seq%g.beforeAnswer == 0 {
		g.settleAndDeliver(ex.GetExecutionId(), p, seq)
		return resp, nil
	}
	g.mu.Lock()
	if !g.stopping {
		g.deliveries.Add(1)
		go func() {
			defer g.deliveries.Done()
			time.Sleep(time.Duration(seq%5) * time.Millisecond)
			g.settleAndDeliver(ex.GetExecutionId(), p, seq)
		}()
	}
	g.mu.Unlock()
	return resp, nil
}

func (g *fakeGateway) GetExecution(ctx context.Context, req *executionv1.GetExecutionRequest) (*executionv1.GetExecutionResponse, error) {
	g.gets.Add(1)
	if err := g.auth(ctx); err != nil {
		return nil, err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	ex, ok := g.byID[req.GetExecutionId()]
	if !ok {
		return nil, status.Error(codes.NotFound, "no such execution")
	}
	return &executionv1.GetExecutionResponse{Execution: proto.Clone(ex).(*executionv1.Execution)}, nil
}

// settleAndDeliver settles the execution per payment.Decide (or failClass)
// and delivers its completion event.
func (g *fakeGateway) settleAndDeliver(id string, p payment.Payment, seq int) {
	o := payment.Decide(p)
	g.mu.Lock()
	ex := g.byID[id]
	ex.Attempts = 1
	ex.SettledAt = timestamppb.Now()
	ex.UpdatedAt = ex.GetSettledAt()
	switch fc, forced := g.failClass[p.ID]; {
	case forced:
		ex.Status = executionv1.ExecutionStatus_EXECUTION_STATUS_FAILED
		ex.Attempts = 3
		ex.Failure = &executionv1.Failure{Class: fc[0], Reason: fc[1], Message: "gave up"}
	case o.Succeeded:
		ex.Status = executionv1.ExecutionStatus_EXECUTION_STATUS_SUCCEEDED
		ex.Output = o.Result.JSON()
		ex.OutputContentType = "application/json"
	default:
		ex.Status = executionv1.ExecutionStatus_EXECUTION_STATUS_FAILED
		ex.Failure = &executionv1.Failure{Class: o.FailureClass, Message: o.FailureMessage}
	}
	g.deliverLocked(ex, seq)
}

// deliverLocked builds ex's completion event and delivers it; g.mu is held
// on entry and released.
func (g *fakeGateway) deliverLocked(ex *executionv1.Execution, seq int) {
	ev := &eventv1.CompletionEvent{
		EventId:           uuid.NewString(),
		Type:              "execution." + map[bool]string{true: "succeeded", false: "failed"}[ex.GetStatus() == executionv1.ExecutionStatus_EXECUTION_STATUS_SUCCEEDED],
		ExecutionId:       ex.GetExecutionId(),
		Capability:        ex.GetCapability(),
		Status:            ex.GetStatus(),
		Attempts:          ex.GetAttempts(),
		Output:            ex.GetOutput(),
		OutputContentType: ex.GetOutputContentType(),
		Failure:           ex.GetFailure(),
		SettledAt:         ex.GetSettledAt(),
		IdempotencyKey:    ex.GetIdempotencyKey(),
		ApplicationId:     testAppID,
	}
	url := g.webhookURL
	g.mu.Unlock()

	if !g.sendWebhooks.Load() {
		return
	}
	times := 1
	if g.duplicateEvery > 0 && seq%g.duplicateEvery == 0 {
		times = 2
	}
	body, err := protojson.Marshal(ev)
	if err != nil {
		panic(err)
	}
	for range times {
		g.post(url, ev.GetEventId(), body)
	}
}

// post delivers one signed webhook, retrying a few times on errors.
func (g *fakeGateway) post(url, id string, body []byte) {
	for try := 0; try < 5; try++ {
		ts := time.Now()
		sig, err := g.wh.Sign(id, ts, body)
		if err != nil {
			panic(err)
		}
		req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
		if err != nil {
			panic(err)
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("webhook-id", id)
		req.Header.Set("webhook-timestamp", strconv.FormatInt(ts.Unix(), 10))
		req.Header.Set("webhook-signature", sig)
		g.webhooksSent.Add(1)
		resp, err := g.http.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode/100 == 2 {
				g.webhooksOK.Add(1)
				return
			}
			g.webhookErrors.Add(1)
			g.mu.Lock()
			g.lastWebhookErr = fmt.Sprintf("webhook answered %d", resp.StatusCode)
			g.mu.Unlock()
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// invokeFile accepts an execution of FileCapability (input {"source",
// "output"}) and settles it shortly after, as the release with steps does:
// it reads the source object, decides every row with payment.Decide,
// publishes the output CSV and delivers the completion event.
func (g *fakeGateway) invokeFile(req *executionv1.InvokeCapabilityRequest) (*executionv1.InvokeCapabilityResponse, error) {
	var in steps.Input
	dec := json.NewDecoder(bytes.NewReader(req.GetInput()))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&in); err != nil || in.Source == "" || in.Output == "" {
		return nil, status.Error(codes.InvalidArgument, "input: want {source, output}")
	}
	g.mu.Lock()
	if ex, ok := g.byKey[req.GetIdempotencyKey()]; ok && req.GetIdempotencyKey() != "" {
		resp := &executionv1.InvokeCapabilityResponse{ExecutionId: ex.GetExecutionId(),
			Acceptance: executionv1.InvokeAcceptance_INVOKE_ACCEPTANCE_DUPLICATE, Status: ex.GetStatus()}
		g.mu.Unlock()
		return resp, nil
	}
	g.seq++
	seq := g.seq
	ex := &executionv1.Execution{ExecutionId: uuid.NewString(), Capability: req.GetCapability(), Release: "v1",
		Status: executionv1.ExecutionStatus_EXECUTION_STATUS_QUEUED, IdempotencyKey: req.GetIdempotencyKey(), CreatedAt: timestamppb.Now()}
	g.byKey[req.GetIdempotencyKey()] = ex
	g.byID[ex.GetExecutionId()] = ex
	if g.settle && !g.stopping {
		g.deliveries.Add(1)
		go func() {
			defer g.deliveries.Done()
			time.Sleep(10 * time.Millisecond)
			g.settleFile(ex.GetExecutionId(), in, seq)
		}()
	}
	g.mu.Unlock()
	g.accepted.Add(1)
	return &executionv1.InvokeCapabilityResponse{ExecutionId: ex.GetExecutionId(),
		Acceptance: executionv1.InvokeAcceptance_INVOKE_ACCEPTANCE_ACCEPTED, Status: executionv1.ExecutionStatus_EXECUTION_STATUS_QUEUED}, nil
}

// settleFile runs a FileCapability execution: source → Decide per row →
// output object, and settles it SUCCEEDED with the summary as output (or
// FAILED with fileFailure).
func (g *fakeGateway) settleFile(id string, in steps.Input, seq int) {
	out, err := g.processFile(id, in)
	g.mu.Lock()
	ex := g.byID[id]
	ex.Attempts = 1
	ex.SettledAt = timestamppb.Now()
	ex.UpdatedAt = ex.GetSettledAt()
	switch {
	case g.fileFailure != nil:
		ex.Status = executionv1.ExecutionStatus_EXECUTION_STATUS_FAILED
		ex.Failure = g.fileFailure
	case err != nil:
		ex.Status = executionv1.ExecutionStatus_EXECUTION_STATUS_FAILED
		ex.Failure = &executionv1.Failure{Class: "source.invalid", Message: err.Error()}
	default:
		ex.Status = executionv1.ExecutionStatus_EXECUTION_STATUS_SUCCEEDED
		ex.Output = out
		ex.OutputContentType = "application/json"
	}
	g.deliverLocked(ex, seq)
}

// processFile publishes the output of a FileCapability execution and
// returns its summary (JSON).
func (g *fakeGateway) processFile(id string, in steps.Input) ([]byte, error) {
	st, err := objectstore.NewLocal(g.objectsDir)
	if err != nil {
		return nil, err
	}
	defer st.Close()
	ctx := context.Background()
	rc, err := st.Open(ctx, in.Source)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	recs, err := csv.NewReader(rc).ReadAll()
	if err != nil || len(recs) == 0 {
		return nil, fmt.Errorf("source: %v", err)
	}
	var buf bytes.Buffer
	w := csv.NewWriter(&buf)
	_ = w.Write(OutputHeader)
	rows := recs[1:]
	if g.fileSwapRows && len(rows) > 1 {
		rows[0], rows[1] = rows[1], rows[0]
	}
	sum := steps.Summary{Object: in.Output, Items: len(rows), Rows: len(rows), Window: 128, MaxInFlight: min(128, len(rows))}
	for _, rec := range rows {
		p := payment.Payment{ID: rec[0], Recipient: rec[1], Amount: rec[2], Currency: rec[3]}
		o := payment.Decide(p)
		row := append([]string{}, rec...)
		if o.Succeeded {
			row = append(row, "SUCCEEDED", o.Result.ProviderReference, o.Result.Fee, "", "")
			sum.Succeeded++
		} else {
			row = append(row, "FAILED", "", "", o.FailureClass, o.FailureMessage)
			sum.Failed++
		}
		_ = w.Write(append(row, "1", id))
	}
	w.Flush()
	h := sha256.Sum256(buf.Bytes())
	sum.Bytes, sum.SHA256 = int64(buf.Len()), hex.EncodeToString(h[:])
	ow, err := st.Create(ctx, in.Output)
	if err != nil {
		return nil, err
	}
	if _, err := ow.Write(buf.Bytes()); err != nil {
		return nil, err
	}
	if err := ow.Commit(ctx); err != nil {
		return nil, err
	}
	return json.Marshal(sum)
}
