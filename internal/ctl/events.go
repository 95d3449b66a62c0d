package ctl

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	adminv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/admin/v1"
)

const eventsUsage = `events list [--app ID] [--status PENDING|DELIVERED|DEAD] [--since T] [--limit N] |
          show ID [--payload] | replay ID [--force] | replay --app ID --since T (every DEAD event)`

// eventStatuses maps --status values to the API's enum.
var eventStatuses = map[string]adminv1.EventStatus{
	"":          adminv1.EventStatus_EVENT_STATUS_UNSPECIFIED,
	"PENDING":   adminv1.EventStatus_EVENT_STATUS_PENDING,
	"DELIVERED": adminv1.EventStatus_EVENT_STATUS_DELIVERED,
	"DEAD":      adminv1.EventStatus_EVENT_STATUS_DEAD,
}

// events runs `capstanctl events …` against the admin API.
func events(ctx context.Context, args []string, out io.Writer) error {
	if len(args) == 0 {
		return fmt.Errorf("%w: %s", ErrUsage, eventsUsage)
	}
	cmd, rest := args[0], args[1:]
	var id string
	if len(rest) > 0 && !strings.HasPrefix(rest[0], "-") {
		id, rest = rest[0], rest[1:]
	}
	fs := flag.NewFlagSet("events "+cmd, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	af := addAdminFlags(fs)
	app := fs.String("app", "", "application id (UUID)")
	status := fs.String("status", "", "PENDING, DELIVERED or DEAD")
	since := fs.String("since", "", "events created at or after: RFC 3339 time or a duration ago (24h)")
	limit := fs.Int("limit", 100, "list: at most this many events, newest first")
	payload := fs.Bool("payload", false, "show: include the payload (application data)")
	force := fs.Bool("force", false, "replay: also replay a DELIVERED event")
	if err := fs.Parse(rest); err != nil {
		return fmt.Errorf("%w: %v", ErrUsage, err)
	}
	var sinceTS *timestamppb.Timestamp
	if *since != "" {
		t, err := parseSince(*since, time.Now())
		if err != nil {
			return err
		}
		sinceTS = timestamppb.New(t)
	}

	switch cmd {
	case "list":
		st, ok := eventStatuses[strings.ToUpper(*status)]
		if !ok {
			return fmt.Errorf("%w: --status %q: want PENDING, DELIVERED or DEAD", ErrUsage, *status)
		}
		if *limit <= 0 {
			return fmt.Errorf("%w: --limit must be positive", ErrUsage)
		}
		c, cctx, done, err := af.dial(ctx)
		if err != nil {
			return err
		}
		defer done()
		tw := tabwriter.NewWriter(out, 2, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "EVENT\tAPPLICATION\tTYPE\tSTATUS\tATTEMPTS\tLAST\tCREATED")
		req := &adminv1.ListEventsRequest{ApplicationId: *app, Status: st, Since: sinceTS, PageSize: int32(min(*limit, 1000))}
		for left := *limit; left > 0; {
			req.PageSize = int32(min(left, 1000))
			page, err := c.ListEvents(cctx, req)
			if err != nil {
				return err
			}
			for _, e := range page.GetEvents() {
				last := "-"
				if e.GetLastStatusCode() != 0 {
					last = fmt.Sprint(e.GetLastStatusCode())
				} else if e.GetLastError() != "" {
					last = "error"
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\t%s\n", e.GetEventId(), e.GetApplicationId(), e.GetType(),
					strings.TrimPrefix(e.GetStatus().String(), "EVENT_STATUS_"), e.GetDeliveryAttempts(), last,
					e.GetCreatedAt().AsTime().Format(time.RFC3339))
			}
			left -= len(page.GetEvents())
			if page.GetNextPageToken() == "" {
				break
			}
			req.PageToken = page.GetNextPageToken()
		}
		return tw.Flush()
	case "show":
		if id == "" {
			return fmt.Errorf("%w: events show ID", ErrUsage)
		}
		c, cctx, done, err := af.dial(ctx)
		if err != nil {
			return err
		}
		defer done()
		resp, err := c.GetEvent(cctx, &adminv1.GetEventRequest{EventId: id, IncludePayload: *payload})
		if err != nil {
			return err
		}
		return printJSON(out, resp)
	case "replay":
		switch {
		case id != "" && (*app != "" || sinceTS != nil):
			return fmt.Errorf("%w: replay either one event (ID) or an application's dead events (--app, --since)", ErrUsage)
		case id == "" && (*app == "" || sinceTS == nil):
			return fmt.Errorf("%w: events replay ID [--force] | events replay --app ID --since T", ErrUsage)
		}
		c, cctx, done, err := af.dial(ctx)
		if err != nil {
			return err
		}
		defer done()
		if id != "" {
			resp, err := c.ReplayEvent(cctx, &adminv1.ReplayEventRequest{EventId: id, Force: *force})
			if err != nil {
				return err
			}
			fmt.Fprintf(out, "event %s replayed: PENDING, delivery %d will follow\n", id, resp.GetEvent().GetDeliveryAttempts()+1)
			return nil
		}
		resp, err := c.ReplayDeadEvents(cctx, &adminv1.ReplayDeadEventsRequest{ApplicationId: *app, Since: sinceTS})
		if err != nil {
			return err
		}
		fmt.Fprintf(out, "%d dead events of %s replayed\n", resp.GetReplayed(), *app)
		return nil
	}
	return fmt.Errorf("%w: unknown events command %q: %s", ErrUsage, cmd, eventsUsage)
}
