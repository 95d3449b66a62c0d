// Package pgtest gives tests fresh PostgreSQL databases.
//
// A test binary that uses pgtest must call [RunMain] from TestMain:
//
//	func TestMain(m *testing.M) { os.Exit(pgtest.RunMain(m)) }
//
// Databases live on one of two servers:
//
//   - If the environment variable DATABASE_URL is set (a postgres:// URL of
//     a role allowed to CREATE DATABASE), on that server. pgtest connects to
//     its "postgres" database to create and drop test databases, keeping the
//     URL's user, password, host and query parameters.
//   - Otherwise on one throwaway cluster per test binary ([pgcluster]),
//     started lazily on first use, so a binary whose database tests are all
//     skipped (for example with -short) never starts one, and stopped by
//     RunMain after the tests.
//
// Each [NewDatabase] call creates its own uniquely named database and drops it
// when the test ends, so tests using it may run in parallel.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/capstan-dev/capstan/internal/pgcluster"
)

// EnvDatabaseURL names the environment variable that points pgtest at an
// existing server instead of a throwaway cluster.
const EnvDatabaseURL = "DATABASE_URL"

// Timeouts for work that is not bound to a test's context.
const (
	// clusterStartTimeout bounds starting the shared cluster.
	clusterStartTimeout = 2 * time.Minute
	// clusterStopTimeout bounds the graceful part of stopping it.
	clusterStopTimeout = 30 * time.Second
	// dropTimeout bounds dropping a test database at cleanup.
	dropTimeout = 30 * time.Second
)

// shared is the test binary's cluster. It is process state by nature: one
// cluster per test binary.
var shared struct {
	once    sync.Once
	cluster *pgcluster.Cluster
	err     error
	started atomic.Bool // once.Do ran (the cluster may still have failed)
}

// mainRunning records that RunMain is in charge of stopping the cluster.
var mainRunning atomic.Bool

// RunMain runs the tests of m and returns the exit code to pass to os.Exit.
// Call it from TestMain. After m.Run it stops the shared cluster, if one was
// started, and, if the tests passed, checks for leaked goroutines with
// goleak.Find (opts are passed on, e.g. goleak.IgnoreTopFunction). A failure
// to stop the cluster or a leak is reported on stderr and turns exit code 0
// into 1.
func RunMain(m *testing.M, opts ...goleak.Option) int {
	mainRunning.Store(true)
	code := m.Run()

	if shared.started.Load() && shared.cluster != nil {
		ctx, cancel := context.WithTimeout(context.Background(), clusterStopTimeout)
		err := shared.cluster.Stop(ctx)
		cancel()
		if err != nil {
			fmt.Fprintf(os.Stderr, "pgtest: stop shared PostgreSQL cluster: %v\n", err)
			if code == 0 {
				code = 1
			}
		}
	}
	if code == 0 {
		if err := goleak.Find(opts...); err != nil {
			fmt.Fprintf(os.Stderr, "pgtest: goroutines leaked after passing tests: %v\n", err)
			code = 1
		}
	}
	return code
}

// Cluster returns the test binary's shared cluster, starting it if needed,
// for tests that stop, restart or otherwise disturb the server (outage
// tests). It skips the test if DATABASE_URL is set, since an external server
// cannot be stopped, and fails it if the cluster cannot start.
//
// Such tests affect every other test of the binary using the server, so they
// must not call t.Parallel, and other tests must not be running: a top-level
// test without t.Parallel runs before any parallel test resumes. A cleanup
// registered by Cluster restarts the server if the test left it stopped.
func Cluster(t testing.TB) *pgcluster.Cluster {
	t.Helper()
	if os.Getenv(EnvDatabaseURL) != "" {
		t.Skipf("pgtest: %s is set; this test needs the embedded cluster because it stops or restarts the server", EnvDatabaseURL)
	}
	c := sharedCluster(t)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), clusterStartTimeout)
		defer cancel()
		if err := c.StartServer(ctx); err != nil {
			t.Errorf("pgtest: restart the shared cluster after %s: %v", t.Name(), err)
		}
	})
	return c
}

// NewDatabase creates an empty database with a unique name, runs migrate on
// it (if migrate is non-nil) with the test's context and the database's URL,
// and returns that URL. The database is dropped (WITH (FORCE), so open
// connections do not block it) when the test and its subtests end. Any error
// fails the test. It is safe to call from parallel tests.
func NewDatabase(t testing.TB, migrate func(ctx context.Context, url string) error) string {
	t.Helper()
	base := serverURL(t)
	name := databaseName(t)
	ctx := t.Context()

	admin := withDatabase(base, "postgres")
	if err := execAdmin(ctx, admin, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("pgtest: create database %s: %v", name, err)
	}
	t.Cleanup(func() {
		// t.Context is cancelled by the time cleanups run.
		ctx, cancel := context.WithTimeout(context.Background(), dropTimeout)
		defer cancel()
		if err := execAdmin(ctx, admin, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Errorf("pgtest: drop database %s: %v", name, err)
		}
	})

	dbURL := withDatabase(base, name)
	if migrate != nil {
		if err := migrate(ctx, dbURL); err != nil {
			t.Fatalf("pgtest: migrate database %s: %v", name, err)
		}
	}
	return dbURL
}

// AdminURL returns the URL of the "postgres" maintenance database on the
// server NewDatabase uses (DATABASE_URL's server or the shared cluster,
// starting it if needed), for tests that inspect server-wide state. Tests
// must not create or drop objects in it.
func AdminURL(t testing.TB) string {
	t.Helper()
	return withDatabase(serverURL(t), "postgres")
}

// sharedCluster starts the binary's cluster on first use.
func sharedCluster(t testing.TB) *pgcluster.Cluster {
	t.Helper()
	if !mainRunning.Load() {
		t.Fatalf("pgtest: call os.Exit(pgtest.RunMain(m)) from TestMain so the shared PostgreSQL cluster is stopped (or set %s)", EnvDatabaseURL)
	}
	shared.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), clusterStartTimeout)
		defer cancel()
		// Only problems are worth seeing; go test shows them when a
		// package fails.
		logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
		shared.cluster, shared.err = pgcluster.Start(ctx, pgcluster.Options{Logger: logger})
		shared.started.Store(true)
	})
	if shared.err != nil {
		t.Fatalf("pgtest: start shared PostgreSQL cluster: %v", shared.err)
	}
	return shared.cluster
}

// serverURL returns the URL of the server to create databases on.
func serverURL(t testing.TB) *url.URL {
	t.Helper()
	raw := os.Getenv(EnvDatabaseURL)
	if raw == "" {
		raw = sharedCluster(t).URL("postgres")
	}
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") || u.Host == "" {
		t.Fatalf("pgtest: %s must be a postgres:// URL with a host, got %q (parse error: %v)", EnvDatabaseURL, redact(raw), err)
	}
	return u
}

// withDatabase returns base with its database replaced by name.
func withDatabase(base *url.URL, name string) string {
	u := *base
	u.Path = "/" + name
	u.RawPath = ""
	return u.String()
}

// execAdmin runs one statement on a short-lived connection to adminURL.
func execAdmin(ctx context.Context, adminURL, sql string) error {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, sql); err != nil {
		return fmt.Errorf("exec: %w", err)
	}
	return nil
}

// databaseName derives a unique, valid, readable database name from the
// test name: "t_<sanitized name>_<random hex>", at most 63 bytes (the
// PostgreSQL identifier limit).
func databaseName(t testing.TB) string {
	var b strings.Builder
	for _, r := range strings.ToLower(t.Name()) {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9':
			b.WriteRune(r)
		default:
			if s := b.String(); s != "" && !strings.HasSuffix(s, "_") {
				b.WriteByte('_')
			}
		}
	}
	stem := strings.Trim(b.String(), "_")
	const maxStem = 63 - len("t_") - len("_") - 16
	if len(stem) > maxStem {
		stem = stem[len(stem)-maxStem:] // the end (subtest names) is most telling
	}
	var rnd [8]byte
	_, _ = rand.Read(rnd[:]) // crypto/rand.Read never fails
	return "t_" + stem + "_" + hex.EncodeToString(rnd[:])
}

// redact hides a URL's password for error messages.
func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparsable)"
	}
	return u.Redacted()
}
