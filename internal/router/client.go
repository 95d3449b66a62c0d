package router

import (
	"net"
	"net/http"
	"time"
)

// dialTimeout bounds establishing one TCP connection; the whole delivery is
// bounded by config.Router.Timeout as well.
const dialTimeout = 10 * time.Second

// newHTTPClient returns the client deliveries use by default: redirects are
// returned, never followed (a 3xx is a failed delivery), and, unless
// allowPrivate, connections to non-public addresses are refused by the
// dialer's Control hook. With the guard on, environment proxies are ignored,
// since a proxy would connect on the router's behalf and bypass the check.
func newHTTPClient(allowPrivate bool) *http.Client {
	dialer := &net.Dialer{Timeout: dialTimeout, KeepAlive: 30 * time.Second}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	if !allowPrivate {
		dialer.Control = refuseNonPublic
		tr.Proxy = nil
	}
	tr.DialContext = dialer.DialContext
	tr.MaxResponseHeaderBytes = 64 << 10
	return &http.Client{
		Transport: tr,
		CheckRedirect: func(*http.Request, []*http.Request) error {
			return http.ErrUseLastResponse
		},
	}
}
