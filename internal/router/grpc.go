package router

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/capstan-dev/capstan/internal/store/pgstore"
	eventv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/event/v1"
)

// grpcConns caches one client connection per gRPC consumer target. A
// connection stays open until the router's Run returns (targets are few:
// one per application at most).
type grpcConns struct {
	mu    sync.Mutex
	conns map[string]*grpc.ClientConn
	opts  []grpc.DialOption
}

// get returns the connection to target, creating it (without connecting:
// gRPC connects on first use).
func (g *grpcConns) get(target string) (*grpc.ClientConn, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if c, ok := g.conns[target]; ok {
		return c, nil
	}
	c, err := grpc.NewClient("passthrough:///"+target, g.opts...)
	if err != nil {
		return nil, err
	}
	if g.conns == nil {
		g.conns = map[string]*grpc.ClientConn{}
	}
	g.conns[target] = c
	return c, nil
}

// closeAll closes every cached connection.
func (g *grpcConns) closeAll() {
	g.mu.Lock()
	defer g.mu.Unlock()
	for t, c := range g.conns {
		_ = c.Close()
		delete(g.conns, t)
	}
}

// grpcDialOptions are the default options for gRPC consumers: plaintext
// (HTTP/2 without TLS; put TLS in front with a mesh or proxy) and, unless
// allowPrivate, a dialer that refuses non-public addresses after name
// resolution, as for webhooks.
func grpcDialOptions(allowPrivate bool) []grpc.DialOption {
	d := &net.Dialer{Timeout: dialTimeout}
	if !allowPrivate {
		d.Control = refuseNonPublic
	}
	return []grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return d.DialContext(ctx, "tcp", addr)
		}),
		grpc.WithUserAgent(userAgent),
		// The delivery span's context reaches the consumer in the metadata.
		grpc.WithStatsHandler(otelgrpc.NewClientHandler()),
	}
}

// deliverGRPC calls capstan.event.v1.EventConsumerService/Deliver on the
// consumer's target with the event, its payload bytes and Standard Webhooks
// metadata (webhook-id, webhook-timestamp and, with secrets,
// webhook-signature over the payload). Success is an OK answer within
// config.Router.Timeout; any other code is a failed attempt, recorded as
// "grpc <Code>: <message>" without an HTTP status.
func (r *Router) deliverGRPC(ctx context.Context, ev pgstore.EventDelivery) attemptResult {
	var msg eventv1.CompletionEvent
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(ev.Payload, &msg); err != nil {
		return failed(0, "grpc: stored payload is not a CompletionEvent")
	}
	conn, err := r.grpc.get(ev.ConsumerTarget)
	if err != nil {
		return failed(0, "grpc: invalid target")
	}
	id := ev.ID.String()
	ts := r.now().Unix()
	md := metadata.Pairs(HeaderWebhookID, id, HeaderWebhookTimestamp, strconv.FormatInt(ts, 10))
	if len(ev.Secrets) > 0 {
		sig, err := signatures(id, ts, ev.Payload, ev.Secrets)
		if err != nil {
			return failed(0, errBadSecret)
		}
		md.Set(HeaderWebhookSignature, sig)
	}
	ctx, cancel := context.WithTimeout(metadata.NewOutgoingContext(ctx, md), r.cfg.Timeout)
	defer cancel()
	_, err = eventv1.NewEventConsumerServiceClient(conn).Deliver(ctx, &eventv1.DeliverRequest{
		Event: &msg, Payload: ev.Payload, Attempt: int32(min(ev.Attempts+1, 1<<30)),
	})
	if err == nil {
		return attemptResult{Delivered: true}
	}
	st := status.Convert(err)
	switch {
	case st.Code() == codes.DeadlineExceeded && errors.Is(ctx.Err(), context.DeadlineExceeded):
		return failed(0, fmt.Sprintf("grpc: timeout after %v", r.cfg.Timeout))
	}
	reason := "grpc " + st.Code().String()
	res := failed(0, reason)
	if m := truncate(sanitize([]byte(st.Message())), MaxResponseExcerpt); m != "" {
		res.Error = truncate(reason+": "+m, maxErrorBytes)
	}
	return res
}
