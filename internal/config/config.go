// Package config loads Capstan's configuration from a YAML file and
// CAPSTAN_* environment variables (viper; this is the only package that
// imports it), applies defaults and validates everything at start with
// errors that name the key.
//
// Environment variables map to keys by upper-casing and replacing "." with
// "_": CAPSTAN_DATABASE_URL sets database.url, CAPSTAN_KAFKA_BROKERS sets
// kafka.brokers (comma-separated). DATABASE_URL and KAFKA_BROKERS are also
// honoured when the CAPSTAN_ forms are unset.
package config

import (
	"encoding/base64"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/go-viper/mapstructure/v2"
	"github.com/spf13/viper"

	"github.com/capstan-dev/capstan/internal/execution"
)

// Config is the whole configuration; each daemon reads its own section.
type Config struct {
	Database     Database     `mapstructure:"database"`
	Kafka        Kafka        `mapstructure:"kafka"`
	Gateway      Gateway      `mapstructure:"gateway"`
	Dispatcher   Dispatcher   `mapstructure:"dispatcher"`
	Consumer     Consumer     `mapstructure:"consumer"`
	Router       Router       `mapstructure:"router"`
	Log          Log          `mapstructure:"log"`
	Capabilities []Capability `mapstructure:"capabilities"`
	// MaxAsyncBudget caps any release's async_budget. Default 24h.
	MaxAsyncBudget time.Duration `mapstructure:"max_async_budget"`
	// CallbackSecret signs callback and resume tokens (base64 of at least 32
	// bytes). The consumer issues tokens and the gateway verifies them, so
	// both need the same value. Empty: adapters get no callback token and
	// "accepted" answers can only be completed through InteractionService.
	CallbackSecret string `mapstructure:"callback_secret"`
	// ObjectStore holds the objects that releases with steps read and
	// publish.
	ObjectStore ObjectStore `mapstructure:"object_store"`
}

// ObjectStore configures the object store (a local directory; an
// S3-compatible provider can implement the same interface,
// internal/objectstore.Store).
type ObjectStore struct {
	// Dir is the root directory of the local provider. Required when a
	// release has steps.
	Dir string `mapstructure:"dir"`
}

// Database configures PostgreSQL.
type Database struct {
	// URL is a libpq URL, e.g. postgres://user@host:5432/capstan. Required.
	URL string `mapstructure:"url"`
	// MigrateOnStart applies pending migrations when a daemon starts.
	// Default false (use `capstanctl migrate` or the migration Job).
	MigrateOnStart bool `mapstructure:"migrate_on_start"`
}

// Kafka configures the Kafka client.
type Kafka struct {
	// Brokers are the seed brokers, host:port. Required.
	Brokers []string `mapstructure:"brokers"`
	// ExecutionTopic carries dispatch records. Default "capstan.executions".
	ExecutionTopic string `mapstructure:"execution_topic"`
	// ExecutionPartitions is used when the topic has to be created. Default 8.
	ExecutionPartitions int32 `mapstructure:"execution_partitions"`
}

// Gateway configures cmd/gateway.
type Gateway struct {
	// Listen is the gRPC address. Default ":7233".
	Listen string `mapstructure:"listen"`
	// AdminListen serves /healthz and /readyz over HTTP. Default ":7234"; "" disables.
	AdminListen string `mapstructure:"admin_listen"`
	// DispatcherAddr is the dispatcher's gRPC address for nudges; "" disables nudges.
	DispatcherAddr string `mapstructure:"dispatcher_addr"`
	// MaxInputBytes bounds InvokeCapability input. Default 262144 (256 KiB), max 16 MiB.
	MaxInputBytes int `mapstructure:"max_input_bytes"`
	// NudgeTimeout bounds one nudge. Default 200ms.
	NudgeTimeout time.Duration `mapstructure:"nudge_timeout"`
	// HTTPListen serves the webhook transport's completion endpoint
	// (POST /v1/interactions/complete). Default ":7239"; "" disables it.
	HTTPListen string `mapstructure:"http_listen"`
	// PublicURL is the base URL at which partners reach HTTPListen, e.g.
	// https://capstan.example.com; sent as completion_url in webhook
	// requests. Required when a release uses the webhook transport.
	PublicURL string `mapstructure:"public_url"`
	// AdminToken authenticates the operator API (capstan.admin.v1.AdminService,
	// used by capstanctl consumers/events) as "authorization: Bearer <token>",
	// compared in constant time. Default "": the admin API is not served. When
	// set, at least 16 bytes.
	AdminToken string `mapstructure:"admin_token"`
}

// Dispatcher configures cmd/dispatcher.
type Dispatcher struct {
	// Listen is the gRPC address (Nudge). Default ":7235".
	Listen string `mapstructure:"listen"`
	// AdminListen serves /healthz and /readyz. Default ":7236".
	AdminListen string `mapstructure:"admin_listen"`
	// PassInterval is the longest wait between scheduled passes. Default 1s.
	PassInterval time.Duration `mapstructure:"pass_interval"`
	// BatchSize is the most records claimed per pass. Default 500.
	BatchSize int `mapstructure:"batch_size"`
	// ClaimTTL is how long a claim lasts before another dispatcher may take
	// the record again. Default 30s.
	ClaimTTL time.Duration `mapstructure:"claim_ttl"`
	// Lookahead publishes records due within this window early. Default 0.
	Lookahead time.Duration `mapstructure:"lookahead"`
}

// Consumer configures cmd/consumer.
type Consumer struct {
	// AdminListen serves /healthz and /readyz. Default ":7237".
	AdminListen string `mapstructure:"admin_listen"`
	// Group is the Kafka consumer group. Default "capstan-consumer".
	Group string `mapstructure:"group"`
	// MaxInFlight bounds attempts running at once per process. Default 256.
	MaxInFlight int `mapstructure:"max_in_flight"`
	// ReapInterval is how often expired leases and budgets are swept. Default 5s.
	ReapInterval time.Duration `mapstructure:"reap_interval"`
	// WorkerID names this process in leases; default hostname-pid.
	WorkerID string `mapstructure:"worker_id"`
	// SessionTimeout is the Kafka group session timeout: how long a silent
	// member keeps its partitions before a rebalance. Default 45s.
	SessionTimeout time.Duration `mapstructure:"session_timeout"`
}

// Router configures cmd/router.
type Router struct {
	// AdminListen serves /healthz and /readyz. Default ":7238".
	AdminListen string `mapstructure:"admin_listen"`
	// PollInterval is the longest wait between claims when idle. Default 500ms.
	PollInterval time.Duration `mapstructure:"poll_interval"`
	// BatchSize is the most events claimed per pass. Default 200.
	BatchSize int `mapstructure:"batch_size"`
	// Concurrency bounds deliveries in flight per process. Default 64.
	Concurrency int `mapstructure:"concurrency"`
	// ClaimTTL must exceed Timeout; an event whose router died is retried
	// after it. Default 60s.
	ClaimTTL time.Duration `mapstructure:"claim_ttl"`
	// Timeout bounds one delivery. Default 15s.
	Timeout time.Duration `mapstructure:"timeout"`
	// RetryDelays: the delays after the 1st..5th failed delivery; the event is
	// DEAD after len(RetryDelays)+1 failures. Default 1m, 5m, 30m, 2h, 6h.
	RetryDelays []time.Duration `mapstructure:"retry_delays"`
	// Jitter is the relative spread of each delay. Default 0.1.
	Jitter float64 `mapstructure:"jitter"`
	// AllowPrivateAddresses permits webhook URLs on loopback and private
	// networks. Default true; set false in production.
	AllowPrivateAddresses bool `mapstructure:"allow_private_addresses"`
	// PerApplicationConcurrency bounds the deliveries in flight for one
	// application (counted across router replicas through their claims), so
	// one application's slow or dead consumer never takes every worker.
	// Default 8; 1..Concurrency.
	PerApplicationConcurrency int `mapstructure:"per_application_concurrency"`
	// SecretKey is the AES-256-GCM key (base64 of 32 bytes) that encrypts the
	// consumers' signing secrets at rest. Read by the router (to sign) and the
	// gateway's admin API (to store). Default "": secrets are stored in
	// plaintext (development only; the router and the gateway log a warning)
	// and secrets already encrypted cannot be used.
	SecretKey string `mapstructure:"secret_key"`
}

// Log configures logging.
type Log struct {
	// Level is debug, info, warn or error. Default info.
	Level string `mapstructure:"level"`
	// Format is json or text. Default json.
	Format string `mapstructure:"format"`
}

// Capability binds a capability name to its current release.
type Capability struct {
	// Name, e.g. "payments.send". Required, 1-128 bytes.
	Name string `mapstructure:"name"`
	// Release version, e.g. "v1". Default "v1".
	Release string `mapstructure:"release"`
	// Adapter is the adapter's gRPC address (host:port). Required.
	Adapter string `mapstructure:"adapter"`
	// Mode is ASYNC or SYNC. Default ASYNC.
	Mode string `mapstructure:"mode"`
	// MaxAttempts is the attempt ceiling. Default 10.
	MaxAttempts int `mapstructure:"max_attempts"`
	// RetryDelays is the retry schedule; the last repeats. Default 1m, 5m, 30m, 2h, 6h.
	RetryDelays []time.Duration `mapstructure:"retry_delays"`
	// Jitter is the relative spread of each delay, 0..0.5. Default 0.1.
	Jitter *float64 `mapstructure:"jitter"`
	// AttemptTimeout bounds one adapter call. Default 30s.
	AttemptTimeout time.Duration `mapstructure:"attempt_timeout"`
	// LeaseDuration is the lease length; heartbeats renew it every third. Default 60s.
	LeaseDuration time.Duration `mapstructure:"lease_duration"`
	// AsyncBudget is the time from acceptance to TIMED_OUT. Default 24h, at most max_async_budget.
	AsyncBudget time.Duration `mapstructure:"async_budget"`
	// AwaitTimeout is the deadline of the interaction opened when the
	// adapter answers "accepted". Default 1h.
	AwaitTimeout time.Duration `mapstructure:"await_timeout"`
	// Await, when set, makes the release's step an await on the outside
	// world instead of an adapter call: the attempt sends the input out over
	// the transport and parks on an await unit (SYSTEM §6).
	Await *AwaitStep `mapstructure:"await"`
	// Steps, when set, makes the release a short pipeline over a file
	// instead of one adapter call: source → await (per item or collected)
	// → optional map → publish (SYSTEM §6; docs/release-steps.md).
	// Adapter is then not required.
	Steps *ReleaseSteps `mapstructure:"steps"`
	// AdapterKeySHA256 is the hex SHA-256 of the key the adapter presents
	// ("authorization: Bearer <key>") on AdapterCallbackService and
	// InteractionService. Empty: no adapter may call back for it.
	AdapterKeySHA256 string `mapstructure:"adapter_key_sha256"`
}

// AwaitStep configures a release whose step is an await.
type AwaitStep struct {
	// Transport is "webhook" or "kafka" (requests are pushed) or
	// "interaction-api" (requests are listed for InteractionService).
	Transport string `mapstructure:"transport"`
	// URL receives the webhook transport's signed POSTs of InteractionRequest.
	URL string `mapstructure:"url"`
	// Secret ("whsec_" + base64) signs the webhook transport's requests and
	// verifies its completions; share it with the partner.
	Secret string `mapstructure:"secret"`
	// RequestTopic and ResponseTopic are the kafka transport's topics.
	RequestTopic  string `mapstructure:"request_topic"`
	ResponseTopic string `mapstructure:"response_topic"`
	// Timeout is the interaction's deadline from the park (for a release
	// step: from the item's dispatch). Default 1h.
	Timeout time.Duration `mapstructure:"timeout"`
	// Cardinality (release steps only) is ONE_TO_ONE (one interaction per
	// item, streamed), MANY_TO_ONE (the items collected into one request,
	// one result), ONE_TO_MANY (one item, a list back) or MANY_TO_MANY
	// (collected, a list back). Default ONE_TO_ONE.
	Cardinality string `mapstructure:"cardinality"`
	// Window (release steps only) bounds the interactions dispatched and not
	// yet consumed by the next step. Default 128, at most 4096.
	Window int `mapstructure:"window"`
	// MaxItems (release steps only) bounds the items a collecting
	// cardinality collects, and the list a ONE_TO_MANY or MANY_TO_MANY
	// completion may return. Default 10000; more fails the execution with
	// class limits.too_many_items.
	MaxItems int `mapstructure:"max_items"`
}

// Release-step defaults.
const (
	DefaultWindow   = 128
	MaxWindow       = 4096
	DefaultMaxItems = 10000
)

// Cardinalities of an await step (SYSTEM §6).
const (
	OneToOne   = "ONE_TO_ONE"
	ManyToOne  = "MANY_TO_ONE"
	OneToMany  = "ONE_TO_MANY"
	ManyToMany = "MANY_TO_MANY"
)

// ReleaseSteps is a release declared as a pipeline over an object: the
// execution's input is the JSON object {"source": "<key>", "output":
// "<key>"} naming the source object and the object to publish.
type ReleaseSteps struct {
	// Source parses the source object lazily. Required.
	Source *SourceStep `mapstructure:"source"`
	// Await sends the items out over a transport. Required.
	Await *AwaitStep `mapstructure:"await"`
	// Map, when set, passes each successful item's result through an
	// adapter before it is published.
	Map *MapStep `mapstructure:"map"`
	// Publish writes the terminal items to the output object. Required.
	Publish *PublishStep `mapstructure:"publish"`
}

// SourceStep configures how the source object is read.
type SourceStep struct {
	// Format is "csv" (a header row, then one item per row, sent as a JSON
	// object keyed by column name) or "jsonl" (one JSON object per line).
	Format string `mapstructure:"format"`
}

// MapStep configures the per-item map.
type MapStep struct {
	// Adapter is the map adapter's gRPC address (host:port); it is called
	// with Execute, the item's result as input. Required.
	Adapter string `mapstructure:"adapter"`
	// Timeout bounds one map call. Default 30s.
	Timeout time.Duration `mapstructure:"timeout"`
}

// PublishStep configures Object Publish.
type PublishStep struct {
	// Format is "csv" or "jsonl".
	Format string `mapstructure:"format"`
	// Columns are the output's columns, in order. Empty: the item's fields
	// followed by status, result, failure_class and failure_message.
	Columns []Column `mapstructure:"columns"`
}

// Column is one output column: Name is its header (or JSON key), Value an
// expression: item.<field>, result.<field>, result, status, failure.class,
// failure.message, index (1-based), sends, interaction_id, execution_id.
type Column struct {
	Name  string `mapstructure:"name"`
	Value string `mapstructure:"value"`
}

// AwaitStep returns the await step of a release: Await, or Steps.Await for
// a release declared as steps; nil when there is none.
func (c Capability) AwaitStep() *AwaitStep {
	if c.Await != nil {
		return c.Await
	}
	if c.Steps != nil {
		return c.Steps.Await
	}
	return nil
}

// DefaultAwaitTimeout is the default of capabilities[].await_timeout.
const DefaultAwaitTimeout = time.Hour

// AwaitDeadline returns the capability's await timeout with its default:
// await.timeout for an await step, await_timeout for an adapter that
// answers "accepted".
func (c Capability) AwaitDeadline() time.Duration {
	if a := c.AwaitStep(); a != nil && a.Timeout > 0 {
		return a.Timeout
	}
	if c.AwaitTimeout > 0 {
		return c.AwaitTimeout
	}
	return DefaultAwaitTimeout
}

// Policy returns the release policy of c with defaults applied.
func (c Capability) Policy() execution.Policy {
	p := execution.DefaultPolicy()
	if c.Mode != "" {
		p.Mode = execution.Mode(strings.ToUpper(c.Mode))
	}
	if c.MaxAttempts != 0 {
		p.MaxAttempts = c.MaxAttempts
	}
	if len(c.RetryDelays) > 0 {
		p.RetryDelays = c.RetryDelays
	}
	if c.Jitter != nil {
		p.Jitter = *c.Jitter
	}
	if c.AttemptTimeout != 0 {
		p.AttemptTimeout = c.AttemptTimeout
	}
	if c.LeaseDuration != 0 {
		p.LeaseDuration = c.LeaseDuration
	}
	if c.AsyncBudget != 0 {
		p.AsyncBudget = c.AsyncBudget
	}
	return p
}

// Lookup returns the capability named name.
func (c *Config) Lookup(name string) (Capability, bool) {
	for _, cp := range c.Capabilities {
		if cp.Name == name {
			return cp, true
		}
	}
	return Capability{}, false
}

// ErrInvalid is wrapped by every validation error.
var ErrInvalid = errors.New("invalid configuration")

func setDefaults(v *viper.Viper) {
	v.SetDefault("max_async_budget", 24*time.Hour)
	v.SetDefault("kafka.execution_topic", "capstan.executions")
	v.SetDefault("kafka.execution_partitions", 8)
	v.SetDefault("gateway.listen", ":7233")
	v.SetDefault("gateway.admin_listen", ":7234")
	v.SetDefault("gateway.max_input_bytes", 256*1024)
	v.SetDefault("gateway.nudge_timeout", 200*time.Millisecond)
	v.SetDefault("gateway.http_listen", ":7239")
	v.SetDefault("dispatcher.listen", ":7235")
	v.SetDefault("dispatcher.admin_listen", ":7236")
	v.SetDefault("dispatcher.pass_interval", time.Second)
	v.SetDefault("dispatcher.batch_size", 500)
	v.SetDefault("dispatcher.claim_ttl", 30*time.Second)
	v.SetDefault("object_store.dir", "")
	v.SetDefault("consumer.admin_listen", ":7237")
	v.SetDefault("consumer.group", "capstan-consumer")
	v.SetDefault("consumer.max_in_flight", 256)
	v.SetDefault("consumer.reap_interval", 5*time.Second)
	v.SetDefault("consumer.session_timeout", 45*time.Second)
	v.SetDefault("router.admin_listen", ":7238")
	v.SetDefault("router.poll_interval", 500*time.Millisecond)
	v.SetDefault("router.batch_size", 200)
	v.SetDefault("router.concurrency", 64)
	v.SetDefault("router.claim_ttl", 60*time.Second)
	v.SetDefault("router.timeout", 15*time.Second)
	v.SetDefault("router.retry_delays", []string{"1m", "5m", "30m", "2h", "6h"})
	v.SetDefault("router.jitter", 0.1)
	v.SetDefault("router.allow_private_addresses", true)
	v.SetDefault("router.per_application_concurrency", 8)
	v.SetDefault("log.level", "info")
	v.SetDefault("log.format", "json")
}

// Load reads the file at path (YAML; "" for none), overlays CAPSTAN_*
// environment variables, applies defaults and validates. Errors name the
// offending key and wrap ErrInvalid.
func Load(path string) (*Config, error) {
	v := viper.New()
	setDefaults(v)
	v.SetEnvPrefix("CAPSTAN")
	v.SetEnvKeyReplacer(strings.NewReplacer(".", "_"))
	v.AutomaticEnv()
	// AutomaticEnv only sees keys viper knows; bind the required ones.
	for _, k := range []string{"callback_secret", "database.url", "kafka.brokers", "database.migrate_on_start", "consumer.worker_id", "gateway.dispatcher_addr",
		"gateway.admin_token", "router.secret_key"} {
		_ = v.BindEnv(k)
	}
	if path != "" {
		v.SetConfigFile(path)
		if err := v.ReadInConfig(); err != nil {
			return nil, fmt.Errorf("%w: read %s: %w", ErrInvalid, path, err)
		}
	}
	if v.GetString("database.url") == "" {
		if u := os.Getenv("DATABASE_URL"); u != "" {
			v.Set("database.url", u)
		}
	}
	if len(v.GetStringSlice("kafka.brokers")) == 0 {
		if b := os.Getenv("KAFKA_BROKERS"); b != "" {
			v.Set("kafka.brokers", b)
		}
	}
	var c Config
	err := v.Unmarshal(&c, viper.DecodeHook(mapstructure.ComposeDecodeHookFunc(
		mapstructure.StringToTimeDurationHookFunc(),
		mapstructure.StringToSliceHookFunc(","),
	)), func(dc *mapstructure.DecoderConfig) { dc.ErrorUnused = true })
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return &c, nil
}

// Validate checks every key; the first problem is returned, naming the key.
func (c *Config) Validate() error {
	if c.Database.URL == "" {
		return bad("database.url", "required (or set DATABASE_URL)")
	}
	if u, err := url.Parse(c.Database.URL); err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		if !strings.Contains(c.Database.URL, "=") { // allow key=value DSNs
			return bad("database.url", "want postgres://… or a key=value DSN")
		}
	}
	if len(c.Kafka.Brokers) == 0 {
		return bad("kafka.brokers", "required (or set KAFKA_BROKERS)")
	}
	if c.Kafka.ExecutionTopic == "" {
		return bad("kafka.execution_topic", "required")
	}
	if c.Gateway.MaxInputBytes <= 0 || c.Gateway.MaxInputBytes > 16<<20 {
		return bad("gateway.max_input_bytes", "%d: want 1..16777216", c.Gateway.MaxInputBytes)
	}
	if c.Dispatcher.PassInterval <= 0 {
		return bad("dispatcher.pass_interval", "want > 0")
	}
	if c.Dispatcher.BatchSize <= 0 || c.Dispatcher.BatchSize > 10000 {
		return bad("dispatcher.batch_size", "%d: want 1..10000", c.Dispatcher.BatchSize)
	}
	if c.Dispatcher.ClaimTTL <= 0 {
		return bad("dispatcher.claim_ttl", "want > 0")
	}
	if c.Dispatcher.Lookahead < 0 {
		return bad("dispatcher.lookahead", "want ≥ 0")
	}
	if c.Consumer.MaxInFlight <= 0 || c.Consumer.MaxInFlight > 100000 {
		return bad("consumer.max_in_flight", "%d: want 1..100000", c.Consumer.MaxInFlight)
	}
	if c.Consumer.SessionTimeout < time.Second || c.Consumer.SessionTimeout > 30*time.Minute {
		return bad("consumer.session_timeout", "%v: want 1s..30m", c.Consumer.SessionTimeout)
	}
	if c.Consumer.ReapInterval <= 0 {
		return bad("consumer.reap_interval", "want > 0")
	}
	if c.Router.Timeout <= 0 {
		return bad("router.timeout", "want > 0")
	}
	if c.Router.ClaimTTL <= c.Router.Timeout {
		return bad("router.claim_ttl", "%v: must exceed router.timeout %v", c.Router.ClaimTTL, c.Router.Timeout)
	}
	if len(c.Router.RetryDelays) == 0 {
		return bad("router.retry_delays", "want at least one delay")
	}
	for i, d := range c.Router.RetryDelays {
		if d <= 0 {
			return bad(fmt.Sprintf("router.retry_delays[%d]", i), "want > 0")
		}
	}
	if c.Router.Concurrency <= 0 || c.Router.BatchSize <= 0 || c.Router.PollInterval <= 0 {
		return bad("router", "concurrency, batch_size and poll_interval must be > 0")
	}
	if c.Router.PerApplicationConcurrency <= 0 || c.Router.PerApplicationConcurrency > c.Router.Concurrency {
		return bad("router.per_application_concurrency", "%d: want 1..router.concurrency (%d)",
			c.Router.PerApplicationConcurrency, c.Router.Concurrency)
	}
	if c.Router.SecretKey != "" {
		if k, err := base64.StdEncoding.DecodeString(c.Router.SecretKey); err != nil || len(k) != 32 {
			return bad("router.secret_key", "want base64 of exactly 32 bytes")
		}
	}
	if c.Gateway.AdminToken != "" && len(c.Gateway.AdminToken) < 16 {
		return bad("gateway.admin_token", "want at least 16 bytes (or empty to disable the admin API)")
	}
	switch c.Log.Level {
	case "debug", "info", "warn", "error":
	default:
		return bad("log.level", "%q: want debug, info, warn or error", c.Log.Level)
	}
	if c.Log.Format != "json" && c.Log.Format != "text" {
		return bad("log.format", "%q: want json or text", c.Log.Format)
	}
	if c.CallbackSecret != "" {
		if b, err := base64.StdEncoding.DecodeString(c.CallbackSecret); err != nil || len(b) < 32 {
			return bad("callback_secret", "want base64 of at least 32 bytes")
		}
	}
	seen := map[string]bool{}
	for i, cp := range c.Capabilities {
		key := fmt.Sprintf("capabilities[%d]", i)
		if cp.Name == "" || len(cp.Name) > 128 {
			return bad(key+".name", "required, 1-128 bytes")
		}
		if seen[cp.Name] {
			return bad(key+".name", "%q is configured twice", cp.Name)
		}
		seen[cp.Name] = true
		if cp.Adapter == "" && cp.Steps == nil {
			return bad(key+".adapter", "required (host:port of the adapter's gRPC server)")
		}
		if h := cp.AdapterKeySHA256; h != "" && (len(h) != 64 || strings.Trim(strings.ToLower(h), "0123456789abcdef") != "") {
			return bad(key+".adapter_key_sha256", "want 64 hex digits (sha256 of the adapter's key)")
		}
		if cp.AwaitTimeout < 0 {
			return bad(key+".await_timeout", "want > 0")
		}
		if cp.Steps != nil {
			if cp.Await != nil {
				return bad(key+".await", "not with steps (use steps.await)")
			}
			if err := c.validateSteps(i); err != nil {
				return err
			}
		}
		if err := c.validateAwait(key+".await", cp.Name, cp.Await); err != nil {
			return err
		}
		if c.Capabilities[i].Release == "" {
			c.Capabilities[i].Release = "v1"
		}
		if err := cp.Policy().Validate(c.MaxAsyncBudget); err != nil {
			return fmt.Errorf("%w: %s (%q): %w", ErrInvalid, key, cp.Name, err)
		}
	}
	return nil
}

func bad(key, format string, args ...any) error {
	return fmt.Errorf("%w: %s: %s", ErrInvalid, key, fmt.Sprintf(format, args...))
}

// validateSteps checks capabilities[i].steps and fills in its defaults.
func (c *Config) validateSteps(i int) error {
	cp := c.Capabilities[i]
	key := fmt.Sprintf("capabilities[%d].steps", i)
	st := cp.Steps
	if cp.Mode != "" && !strings.EqualFold(cp.Mode, "ASYNC") {
		return bad(fmt.Sprintf("capabilities[%d].mode", i), "%q: a release with steps is ASYNC", cp.Mode)
	}
	if st.Source == nil {
		return bad(key+".source", "required")
	}
	if st.Source.Format != "csv" && st.Source.Format != "jsonl" {
		return bad(key+".source.format", "%q: want csv or jsonl", st.Source.Format)
	}
	if st.Await == nil {
		return bad(key+".await", "required")
	}
	if st.Await.Transport == "" {
		return bad(key+".await.transport", "required: webhook, kafka or interaction-api")
	}
	if err := c.validateAwait(key+".await", cp.Name, st.Await); err != nil {
		return err
	}
	switch st.Await.Cardinality {
	case "":
		st.Await.Cardinality = OneToOne
	case OneToOne, ManyToOne, OneToMany, ManyToMany:
	default:
		return bad(key+".await.cardinality", "%q: want ONE_TO_ONE, MANY_TO_ONE, ONE_TO_MANY or MANY_TO_MANY", st.Await.Cardinality)
	}
	switch w := st.Await.Window; {
	case w == 0:
		st.Await.Window = DefaultWindow
	case w < 0 || w > MaxWindow:
		return bad(key+".await.window", "%d: want 1..%d", w, MaxWindow)
	}
	switch m := st.Await.MaxItems; {
	case m == 0:
		st.Await.MaxItems = DefaultMaxItems
	case m < 0:
		return bad(key+".await.max_items", "%d: want > 0", m)
	}
	if st.Map != nil {
		if st.Await.Cardinality != OneToOne {
			return bad(key+".map", "only with the ONE_TO_ONE cardinality (a map is per item)")
		}
		if st.Map.Adapter == "" {
			return bad(key+".map.adapter", "required (host:port of the map adapter)")
		}
		if st.Map.Timeout < 0 {
			return bad(key+".map.timeout", "want > 0")
		}
		if st.Map.Timeout == 0 {
			st.Map.Timeout = 30 * time.Second
		}
	}
	if st.Publish == nil {
		return bad(key+".publish", "required")
	}
	if st.Publish.Format != "csv" && st.Publish.Format != "jsonl" {
		return bad(key+".publish.format", "%q: want csv or jsonl", st.Publish.Format)
	}
	names := map[string]bool{}
	for j, col := range st.Publish.Columns {
		ckey := fmt.Sprintf("%s.publish.columns[%d]", key, j)
		if col.Name == "" {
			return bad(ckey+".name", "required")
		}
		if names[col.Name] {
			return bad(ckey+".name", "%q appears twice", col.Name)
		}
		names[col.Name] = true
		if err := ValidColumnValue(col.Value); err != nil {
			return bad(ckey+".value", "%v", err)
		}
	}
	if c.ObjectStore.Dir == "" {
		return bad("object_store.dir", "required by the steps of %q (where source and output objects live)", cp.Name)
	}
	return nil
}

// ValidColumnValue checks a Column.Value expression.
func ValidColumnValue(v string) error {
	switch v {
	case "result", "status", "failure.class", "failure.message", "index", "sends", "interaction_id", "execution_id":
		return nil
	}
	for _, p := range []string{"item.", "result."} {
		if strings.HasPrefix(v, p) && len(v) > len(p) {
			return nil
		}
	}
	return fmt.Errorf("%q: want item.<field>, result.<field>, result, status, failure.class, failure.message, index, sends, interaction_id or execution_id", v)
}

// validateAwait checks an await step (key names it in errors).
func (c *Config) validateAwait(key, name string, a *AwaitStep) error {
	if a != nil {
		switch a.Transport {
		case "webhook":
			if u, err := url.Parse(a.URL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
				return bad(key+".url", "want an http(s) URL for the webhook transport")
			}
			if !strings.HasPrefix(a.Secret, "whsec_") {
				return bad(key+".secret", "want whsec_<base64> for the webhook transport")
			}
			if c.Gateway.PublicURL == "" {
				return bad("gateway.public_url", "required by the webhook transport of %q (where partners POST completions)", name)
			}
		case "kafka":
			if a.RequestTopic == "" || a.ResponseTopic == "" {
				return bad(key, "request_topic and response_topic are required for the kafka transport")
			}
		case "interaction-api":
		default:
			return bad(key+".transport", "%q: want webhook, kafka or interaction-api", a.Transport)
		}
		if a.Transport != "interaction-api" && c.CallbackSecret == "" {
			return bad("callback_secret", "required by the %s transport of %q (it signs resume tokens)", a.Transport, name)
		}
		if a.Timeout < 0 {
			return bad(key+".timeout", "want > 0")
		}
	}
	return nil
}
