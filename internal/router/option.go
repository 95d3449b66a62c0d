package router

import (
	"net/http"
	"time"
)

// Option configures a Router.
type Option func(*Router)

// WithClock sets the clock that stamps the webhook-timestamp header and the
// recorded start of each attempt. Default time.Now; nil is ignored.
func WithClock(now func() time.Time) Option {
	return func(r *Router) {
		if now != nil {
			r.now = now
		}
	}
}

// WithHTTPClient replaces the delivery client, for tests. The client is used
// as given: the default client's redirect refusal and private-address guard
// (config.Router.AllowPrivateAddresses) do not apply to it, while
// config.Router.Timeout still bounds every delivery. nil is ignored.
func WithHTTPClient(c *http.Client) Option {
	return func(r *Router) {
		if c != nil {
			r.client = c
		}
	}
}

// WithWorkerID names this router in its claims and logs. Default
// "<hostname>-<pid>"; "" is ignored.
func WithWorkerID(id string) Option {
	return func(r *Router) {
		if id != "" {
			r.workerID = id
		}
	}
}
