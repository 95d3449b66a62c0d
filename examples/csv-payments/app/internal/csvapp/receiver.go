package csvapp

import (
	"errors"
	"io"
	"log/slog"
	"net/http"

	"github.com/capstan-dev/capstan/pkg/client"
)

// maxEventBytes bounds a webhook body (the output of an execution is far
// smaller than this).
const maxEventBytes = 4 << 20

// receiver serves POST /events: it verifies each webhook and hands the event
// to the tracker.
type receiver struct {
	verifier *client.EventVerifier
	tracker  *tracker
	logger   *slog.Logger
}

// handler returns the receiver's HTTP handler: POST /events answers 200 for
// a verified event (new, duplicate or of an unknown execution), 401 for a
// missing or bad signature or a stale timestamp, 400 for an authentic body
// that is not a completion event, 413 for a body over 4 MiB.
func (rc *receiver) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /events", rc.serveEvent)
	return mux
}

// serveEvent handles one webhook delivery.
func (rc *receiver) serveEvent(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxEventBytes))
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			http.Error(w, "body too large", http.StatusRequestEntityTooLarge)
			return
		}
		http.Error(w, "cannot read body", http.StatusBadRequest)
		return
	}
	ev, err := rc.verifier.Verify(r.Header, body)
	if err != nil {
		rc.logger.WarnContext(r.Context(), "webhook refused",
			slog.String("webhook_id", r.Header.Get(client.HeaderWebhookID)),
			slog.Any("error", err))
		if errors.Is(err, client.ErrEventBody) {
			http.Error(w, "invalid event body", http.StatusBadRequest)
			return
		}
		http.Error(w, "signature not verified", http.StatusUnauthorized)
		return
	}
	duplicate, known := rc.tracker.onEvent(ev)
	rc.logger.DebugContext(r.Context(), "webhook received",
		slog.String("event_id", ev.GetEventId()),
		slog.String("execution_id", ev.GetExecutionId()),
		slog.String("type", ev.GetType()),
		slog.Bool("duplicate", duplicate),
		slog.Bool("known", known))
	w.WriteHeader(http.StatusOK)
}
