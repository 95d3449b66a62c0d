package ctl

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	adminv1 "github.com/capstan-dev/capstan/pkg/gen/capstan/admin/v1"
)

// The consumers and events commands are clients of the gateway's admin
// API (capstan.admin.v1.AdminService): they never touch the database, so
// validation, encryption of signing secrets and the operator token all
// apply in one place.
const (
	// envAdminAddr and envAdminToken are the defaults of --admin-addr and
	// --admin-token.
	envAdminAddr  = "CAPSTAN_ADMIN_ADDR"
	envAdminToken = "CAPSTAN_ADMIN_TOKEN"
	// defaultAdminAddr is the gateway's default gRPC address.
	defaultAdminAddr = "127.0.0.1:7233"
	// adminCallTimeout bounds one admin call.
	adminCallTimeout = 30 * time.Second
)

// adminFlags are the connection flags of every admin command.
type adminFlags struct {
	addr, token *string
}

func addAdminFlags(fs *flag.FlagSet) adminFlags {
	addr := os.Getenv(envAdminAddr)
	if addr == "" {
		addr = defaultAdminAddr
	}
	return adminFlags{
		addr:  fs.String("admin-addr", addr, "gateway gRPC address (default $"+envAdminAddr+" or "+defaultAdminAddr+")"),
		token: fs.String("admin-token", os.Getenv(envAdminToken), "operator token, gateway.admin_token (default $"+envAdminToken+")"),
	}
}

// dial connects to the admin API and returns a client, a context carrying
// the token (bounded by adminCallTimeout) and a function releasing both.
func (f adminFlags) dial(ctx context.Context) (adminv1.AdminServiceClient, context.Context, func(), error) {
	if *f.token == "" {
		return nil, nil, nil, fmt.Errorf("%w: --admin-token (or $%s) is required", ErrUsage, envAdminToken)
	}
	conn, err := grpc.NewClient(*f.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, nil, nil, fmt.Errorf("admin api %s: %w", *f.addr, err)
	}
	ctx, cancel := context.WithTimeout(ctx, adminCallTimeout)
	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+*f.token)
	return adminv1.NewAdminServiceClient(conn), ctx, func() { cancel(); _ = conn.Close() }, nil
}

// stringList is a repeatable string flag.
type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, ",") }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }

// printJSON writes m as indented protobuf JSON. protojson deliberately
// varies its whitespace between builds, so the output is re-indented with
// encoding/json to keep it stable for people and scripts.
func printJSON(out io.Writer, m proto.Message) error {
	b, err := protojson.Marshal(m)
	if err != nil {
		return err
	}
	var buf bytes.Buffer
	if err := json.Indent(&buf, b, "", "  "); err != nil {
		return err
	}
	_, err = fmt.Fprintln(out, buf.String())
	return err
}

// readSecrets returns the secrets of --secret flags and of --secrets-file
// (one per line; blank lines and lines starting with # are skipped).
func readSecrets(flags []string, file string) ([]string, error) {
	out := append([]string(nil), flags...)
	if file == "" {
		return out, nil
	}
	f, err := os.Open(file)
	if err != nil {
		return nil, fmt.Errorf("secrets file: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if l := strings.TrimSpace(sc.Text()); l != "" && !strings.HasPrefix(l, "#") {
			out = append(out, l)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("secrets file: %w", err)
	}
	return out, nil
}

const consumersUsage = `consumers list | get --app ID | set --app ID (--webhook-url U | --kafka-topic T | --grpc-target H:P)
          [--secret S]... [--secrets-file F] [--expected-version N] | rotate-secret --app ID [--secret S]
          [--retire-after D] | remove-secret --app ID --secret-id ID | enable --app ID`

// consumers runs `capstanctl consumers …` against the admin API.
func consumers(ctx context.Context, args []string, out io.Writer) error {
	if len(args) == 0 {
		return fmt.Errorf("%w: %s", ErrUsage, consumersUsage)
	}
	fs := flag.NewFlagSet("consumers "+args[0], flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	af := addAdminFlags(fs)
	app := fs.String("app", "", "application id (UUID)")
	webhook := fs.String("webhook-url", "", "webhook URL (http or https)")
	topic := fs.String("kafka-topic", "", "Kafka topic the application reads")
	target := fs.String("grpc-target", "", "host:port of the application's EventConsumerService")
	var secrets stringList
	fs.Var(&secrets, "secret", "signing secret whsec_<base64> (repeatable; replaces the current ones)")
	secretsFile := fs.String("secrets-file", "", "file with one signing secret per line (keeps them off the command line)")
	expected := fs.Int64("expected-version", 0, "apply only if the consumer is at this version")
	retire := fs.Duration("retire-after", -1, "rotate-secret: current secrets stop signing after this long (e.g. 24h; default: keep them)")
	secretID := fs.String("secret-id", "", "remove-secret: the secret's id")
	if err := fs.Parse(args[1:]); err != nil {
		return fmt.Errorf("%w: %v", ErrUsage, err)
	}
	needApp := func() error { return need("app", *app) }

	switch args[0] {
	case "list":
		c, cctx, done, err := af.dial(ctx)
		if err != nil {
			return err
		}
		defer done()
		tw := tabwriter.NewWriter(out, 2, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "APPLICATION\tKIND\tTARGET\tSECRETS\tVERSION\tDISABLED")
		req := &adminv1.ListEventConsumersRequest{PageSize: 500}
		for {
			page, err := c.ListEventConsumers(cctx, req)
			if err != nil {
				return err
			}
			for _, ec := range page.GetConsumers() {
				kind, tgt := consumerTarget(ec)
				active := 0
				for _, s := range ec.GetSecrets() {
					if s.GetActive() {
						active++
					}
				}
				disabled := "-"
				if ec.GetDisabledAt() != nil {
					disabled = ec.GetDisabledAt().AsTime().Format(time.RFC3339) + " " + ec.GetDisabledReason()
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d active\t%d\t%s\n", ec.GetApplicationId(), kind, tgt, active, ec.GetVersion(), disabled)
			}
			if page.GetNextPageToken() == "" {
				break
			}
			req.PageToken = page.GetNextPageToken()
		}
		return tw.Flush()
	case "get":
		if err := needApp(); err != nil {
			return err
		}
		c, cctx, done, err := af.dial(ctx)
		if err != nil {
			return err
		}
		defer done()
		resp, err := c.GetEventConsumer(cctx, &adminv1.GetEventConsumerRequest{ApplicationId: *app})
		if err != nil {
			return err
		}
		return printJSON(out, resp.GetConsumer())
	case "set":
		if err := needApp(); err != nil {
			return err
		}
		req := &adminv1.SetEventConsumerRequest{ApplicationId: *app, ExpectedVersion: *expected}
		n := 0
		if *webhook != "" {
			n++
			req.Target = &adminv1.SetEventConsumerRequest_Webhook{Webhook: &adminv1.WebhookTarget{Url: *webhook}}
		}
		if *topic != "" {
			n++
			req.Target = &adminv1.SetEventConsumerRequest_Kafka{Kafka: &adminv1.KafkaTarget{Topic: *topic}}
		}
		if *target != "" {
			n++
			req.Target = &adminv1.SetEventConsumerRequest_Grpc{Grpc: &adminv1.GrpcTarget{Target: *target}}
		}
		if n != 1 {
			return fmt.Errorf("%w: exactly one of --webhook-url, --kafka-topic, --grpc-target", ErrUsage)
		}
		var err error
		if req.Secrets, err = readSecrets(secrets, *secretsFile); err != nil {
			return err
		}
		c, cctx, done, err := af.dial(ctx)
		if err != nil {
			return err
		}
		defer done()
		resp, err := c.SetEventConsumer(cctx, req)
		if err != nil {
			return err
		}
		return printJSON(out, resp.GetConsumer())
	case "rotate-secret":
		if err := needApp(); err != nil {
			return err
		}
		list, err := readSecrets(secrets, *secretsFile)
		if err != nil {
			return err
		}
		if len(list) > 1 {
			return fmt.Errorf("%w: rotate-secret takes at most one --secret", ErrUsage)
		}
		req := &adminv1.RotateSigningSecretRequest{ApplicationId: *app}
		if len(list) == 1 {
			req.Secret = list[0]
		}
		if *retire >= 0 {
			req.RetirePreviousAfter = durationpb.New(*retire)
		}
		c, cctx, done, err := af.dial(ctx)
		if err != nil {
			return err
		}
		defer done()
		resp, err := c.RotateSigningSecret(cctx, req)
		if err != nil {
			return err
		}
		if resp.GetSecret() != "" {
			fmt.Fprintf(out, "new signing secret (shown once, store it now): %s\n", resp.GetSecret())
		}
		fmt.Fprintf(out, "secret id %s\n", resp.GetSecretId())
		return printJSON(out, resp.GetConsumer())
	case "remove-secret":
		if err := needApp(); err != nil {
			return err
		}
		if err := need("secret-id", *secretID); err != nil {
			return err
		}
		c, cctx, done, err := af.dial(ctx)
		if err != nil {
			return err
		}
		defer done()
		resp, err := c.RemoveSigningSecret(cctx, &adminv1.RemoveSigningSecretRequest{ApplicationId: *app, SecretId: *secretID})
		if err != nil {
			return err
		}
		return printJSON(out, resp.GetConsumer())
	case "enable":
		if err := needApp(); err != nil {
			return err
		}
		c, cctx, done, err := af.dial(ctx)
		if err != nil {
			return err
		}
		defer done()
		resp, err := c.EnableEventConsumer(cctx, &adminv1.EnableEventConsumerRequest{ApplicationId: *app})
		if err != nil {
			return err
		}
		return printJSON(out, resp.GetConsumer())
	}
	return fmt.Errorf("%w: unknown consumers command %q: %s", ErrUsage, args[0], consumersUsage)
}

func consumerTarget(c *adminv1.EventConsumer) (kind, target string) {
	switch t := c.GetTarget().(type) {
	case *adminv1.EventConsumer_Webhook:
		return "webhook", t.Webhook.GetUrl()
	case *adminv1.EventConsumer_Kafka:
		return "kafka", t.Kafka.GetTopic()
	case *adminv1.EventConsumer_Grpc:
		return "grpc", t.Grpc.GetTarget()
	}
	return "?", ""
}

var errSince = errors.New("--since: want an RFC 3339 time (2026-03-01T00:00:00Z) or a duration ago (24h)")

// parseSince reads --since: an RFC 3339 time, or a duration meaning that
// long before now.
func parseSince(v string, now time.Time) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339Nano, v); err == nil {
		return t, nil
	}
	if d, err := time.ParseDuration(v); err == nil && d >= 0 {
		return now.Add(-d), nil
	}
	return time.Time{}, fmt.Errorf("%w: %w", ErrUsage, errSince)
}
