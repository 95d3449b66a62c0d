// Package client is the Go client that applications use to talk to a Capstan
// gateway: invoke capabilities, read executions, and verify the signed
// completion webhooks that Capstan delivers.
//
// A Client wraps one gRPC connection to the gateway's ExecutionService and
// attaches "authorization: Bearer <api key>" metadata to every call. It is
// safe for concurrent use.
package client

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	executionv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/execution/v1"
)

// DefaultContentType is the content type Invoke sends when the caller passes
// an empty one; the gateway applies the same default.
const DefaultContentType = "application/json"

var (
	// ErrEmptyTarget is returned by Dial when target is empty.
	ErrEmptyTarget = errors.New("client: empty gateway target")
	// ErrEmptyAPIKey is returned by Dial when apiKey is empty or contains
	// characters that cannot travel in a gRPC metadata value.
	ErrEmptyAPIKey = errors.New("client: empty or malformed api key")
	// ErrEmptyResponse is returned when the gateway answers OK without the
	// expected message body (a gateway bug).
	ErrEmptyResponse = errors.New("client: gateway answered with an empty response")
)

// Client calls the gateway's ExecutionService. Create it with Dial and
// release it with Close. All methods are safe for concurrent use.
type Client struct {
	conn *grpc.ClientConn
	svc  executionv1.ExecutionServiceClient
}

// Dial creates a Client for the gateway at target (a gRPC target such as
// "127.0.0.1:7443" or "dns:///gateway:7443") that authenticates every call
// with apiKey as a bearer token.
//
// By default the connection uses insecure (plaintext) transport credentials,
// which suits a gateway on loopback; pass grpc.WithTransportCredentials in
// opts to use TLS (options in opts are applied after the defaults and win).
// Dial does not wait for the connection to be established: the first RPC
// connects. ctx is checked once so that a cancelled caller gets no client.
//
// Errors: ErrEmptyTarget, ErrEmptyAPIKey, the context's error, or the wrapped
// error of grpc.NewClient for an unparsable target or invalid options.
func Dial(ctx context.Context, target, apiKey string, opts ...grpc.DialOption) (*Client, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("client: dial %q: %w", target, err)
	}
	if strings.TrimSpace(target) == "" {
		return nil, ErrEmptyTarget
	}
	if apiKey == "" || strings.ContainsAny(apiKey, "\r\n\x00") {
		return nil, ErrEmptyAPIKey
	}
	all := make([]grpc.DialOption, 0, len(opts)+2)
	all = append(all,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithPerRPCCredentials(bearerCredentials{token: apiKey}),
	)
	all = append(all, opts...)
	conn, err := grpc.NewClient(target, all...)
	if err != nil {
		return nil, fmt.Errorf("client: dial %q: %w", target, err)
	}
	return &Client{conn: conn, svc: executionv1.NewExecutionServiceClient(conn)}, nil
}

// Invoke asks the gateway to run capability once with input (opaque bytes,
// at most the gateway's max_input_bytes, 256 KiB by default) of contentType
// (empty means DefaultContentType). idempotencyKey (at most 256 bytes, may be
// empty) makes the call safe to repeat: the same key with the same request
// returns the existing execution with acceptance DUPLICATE.
//
// The gateway answers only after the execution is committed. The error, if
// any, wraps the gRPC status error, so status.Code(err) gives the code:
// INVALID_ARGUMENT, NOT_FOUND (unknown capability), ALREADY_EXISTS (key used
// with a different request), UNAUTHENTICATED, UNAVAILABLE (nothing accepted;
// retry with the same key) or DEADLINE_EXCEEDED.
func (c *Client) Invoke(ctx context.Context, capability string, input []byte, contentType, idempotencyKey string) (*executionv1.InvokeCapabilityResponse, error) {
	if contentType == "" {
		contentType = DefaultContentType
	}
	resp, err := c.svc.InvokeCapability(ctx, &executionv1.InvokeCapabilityRequest{
		Capability:     capability,
		Input:          input,
		ContentType:    contentType,
		IdempotencyKey: idempotencyKey,
	})
	if err != nil {
		return nil, fmt.Errorf("client: invoke %q: %w", capability, err)
	}
	if resp.GetExecutionId() == "" {
		return nil, fmt.Errorf("client: invoke %q: %w", capability, ErrEmptyResponse)
	}
	return resp, nil
}

// Get returns the execution executionID (a UUID) of the calling application.
//
// The error, if any, wraps the gRPC status error: INVALID_ARGUMENT (not a
// UUID), NOT_FOUND (no such execution for this application),
// UNAUTHENTICATED, UNAVAILABLE; or ErrEmptyResponse.
func (c *Client) Get(ctx context.Context, executionID string) (*executionv1.Execution, error) {
	resp, err := c.svc.GetExecution(ctx, &executionv1.GetExecutionRequest{ExecutionId: executionID})
	if err != nil {
		return nil, fmt.Errorf("client: get execution %q: %w", executionID, err)
	}
	if resp.GetExecution() == nil {
		return nil, fmt.Errorf("client: get execution %q: %w", executionID, ErrEmptyResponse)
	}
	return resp.GetExecution(), nil
}

// Close releases the connection. Calls in flight fail with CANCELED. It
// returns the wrapped error of closing the connection, if any.
func (c *Client) Close() error {
	if err := c.conn.Close(); err != nil {
		return fmt.Errorf("client: close: %w", err)
	}
	return nil
}

// IsTerminal reports whether s is one of the terminal statuses (SUCCEEDED,
// FAILED, TIMED_OUT, CANCELLED), which an execution never leaves.
func IsTerminal(s executionv1.ExecutionStatus) bool {
	switch s {
	case executionv1.ExecutionStatus_EXECUTION_STATUS_SUCCEEDED,
		executionv1.ExecutionStatus_EXECUTION_STATUS_FAILED,
		executionv1.ExecutionStatus_EXECUTION_STATUS_TIMED_OUT,
		executionv1.ExecutionStatus_EXECUTION_STATUS_CANCELLED:
		return true
	default:
		return false
	}
}

// bearerCredentials adds the api key as a bearer token to every RPC.
type bearerCredentials struct {
	token string
}

var _ credentials.PerRPCCredentials = bearerCredentials{}

// GetRequestMetadata returns the authorization metadata.
func (b bearerCredentials) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + b.token}, nil
}

// RequireTransportSecurity is false so that loopback gateways work without
// TLS; use TLS transport credentials for anything that leaves the host.
func (bearerCredentials) RequireTransportSecurity() bool { return false }
