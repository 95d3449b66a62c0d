package pgcluster_test

import (
	"context"
	"log/slog"
	"net"
	"os"
	osexec "os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/capstan-dev/capstan/internal/pgcluster"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// testLogger sends the cluster's logs to the test log.
func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// start starts a cluster and registers a Stop that must succeed.
func start(t *testing.T, opts pgcluster.Options) *pgcluster.Cluster {
	t.Helper()
	if opts.Logger == nil {
		opts.Logger = testLogger(t)
	}
	c, err := pgcluster.Start(t.Context(), opts)
	require.NoError(t, err)
	t.Cleanup(func() {
		// t.Context is already cancelled here; Stop must cope.
		assert.NoError(t, c.Stop(context.Background()))
	})
	return c
}

func connect(ctx context.Context, t *testing.T, url string) (*pgx.Conn, error) {
	t.Helper()
	cfg, err := pgx.ParseConfig(url)
	require.NoError(t, err)
	cfg.ConnectTimeout = 2 * time.Second
	return pgx.ConnectConfig(ctx, cfg)
}

// exec runs sql on a fresh connection to url.
func exec(t *testing.T, url, sql string, args ...any) {
	t.Helper()
	conn, err := connect(t.Context(), t, url)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	_, err = conn.Exec(t.Context(), sql, args...)
	require.NoError(t, err)
}

// queryInt runs a single-int query on a fresh connection to url.
func queryInt(t *testing.T, url, sql string) int {
	t.Helper()
	conn, err := connect(t.Context(), t, url)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	var n int
	require.NoError(t, conn.QueryRow(t.Context(), sql).Scan(&n))
	return n
}

// processesIn lists the pids of processes whose working directory or
// command line mentions dir. Every postgres process chdirs into its data
// directory, so this finds the postmaster and all its children.
func processesIn(t *testing.T, dir string) []int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	require.NoError(t, err)
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cwd, _ := os.Readlink(filepath.Join("/proc", e.Name(), "cwd"))
		cmdline, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if strings.HasPrefix(cwd, dir) || strings.Contains(string(cmdline), dir) {
			pids = append(pids, pid)
		}
	}
	return pids
}

func requireNoProcesses(t *testing.T, dir string) {
	t.Helper()
	require.Eventually(t, func() bool { return len(processesIn(t, dir)) == 0 },
		5*time.Second, 20*time.Millisecond, "postgres processes remain for %s: %v", dir, processesIn(t, dir))
}

// TestLifecycle walks one cluster through every state change; the steps
// share the server, so they run in order.
func TestLifecycle(t *testing.T) {
	t.Parallel()
	abandoned, ours, unowned := makeTempClusterDirs(t)
	c, err := pgcluster.Start(t.Context(), pgcluster.Options{Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Stop(context.Background()) }) // in case a step fails
	url := c.URL("postgres")
	dir := c.Dir()

	t.Run("start removed abandoned temp dirs", func(t *testing.T) {
		assert.NoDirExists(t, abandoned)
		assert.DirExists(t, ours)
		assert.DirExists(t, unowned)
	})

	t.Run("accepts queries", func(t *testing.T) {
		assert.Equal(t, 1, queryInt(t, url, "select 1"))
		assert.True(t, c.Running())
		assert.Equal(t, "postgres://postgres@127.0.0.1:"+strconv.Itoa(c.Port())+"/app?sslmode=disable", c.URL("app"))
		assert.NotEmpty(t, processesIn(t, dir))
	})

	t.Run("restart keeps data", func(t *testing.T) {
		exec(t, url, "create table kept (n int); insert into kept values (42)")
		port := c.Port()
		require.NoError(t, c.Restart(t.Context()))
		assert.Equal(t, port, c.Port())
		assert.Equal(t, 42, queryInt(t, url, "select n from kept"))
	})

	t.Run("stop server then start server", func(t *testing.T) {
		conn, err := connect(t.Context(), t, url)
		require.NoError(t, err)
		defer conn.Close(context.Background())

		require.NoError(t, c.StopServer(t.Context()))
		assert.False(t, c.Running())
		require.NoError(t, c.StopServer(t.Context()), "StopServer is idempotent")
		_, err = connect(t.Context(), t, url)
		require.Error(t, err, "connect while the server is down")
		assert.Error(t, conn.Ping(t.Context()), "existing connections break when the server stops")
		requireNoProcesses(t, c.Dir())

		require.NoError(t, c.StartServer(t.Context()))
		require.NoError(t, c.StartServer(t.Context()), "StartServer is idempotent")
		assert.Equal(t, 42, queryInt(t, url, "select n from kept"))
	})

	t.Run("stop removes everything", func(t *testing.T) {
		// A cancelled context only skips the graceful shutdown.
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		require.NoError(t, c.Stop(ctx))
		_, err := os.Stat(dir)
		assert.ErrorIs(t, err, os.ErrNotExist)
		requireNoProcesses(t, dir)
		assert.NoError(t, c.Stop(t.Context()), "Stop is idempotent")
		assert.ErrorIs(t, c.StartServer(t.Context()), pgcluster.ErrClosed)
		assert.ErrorIs(t, c.Restart(t.Context()), pgcluster.ErrClosed)
		assert.NoError(t, c.StopServer(t.Context()))
	})
}

// TestExplicitDirAndPort checks a caller-chosen directory and port, and
// that a second cluster on the same directory reuses its data.
func TestExplicitDirAndPort(t *testing.T) {
	t.Parallel()
	dir := worldSearchableTempDir(t)
	port := freePort(t)

	c := start(t, pgcluster.Options{Dir: dir, Port: port})
	assert.Equal(t, port, c.Port())
	assert.Equal(t, dir, c.Dir())
	assert.FileExists(t, filepath.Join(dir, "data", "PG_VERSION"))
	assert.FileExists(t, c.LogPath())
	exec(t, c.URL("postgres"), "create table kept (n int); insert into kept values (7)")
	require.NoError(t, c.Stop(t.Context()))
	assert.DirExists(t, dir, "Stop keeps a caller-provided dir")
	requireNoProcesses(t, filepath.Join(dir, "data"))

	c2 := start(t, pgcluster.Options{Dir: dir})
	assert.Equal(t, 7, queryInt(t, c2.URL("postgres"), "select n from kept"))

	// Another cluster asking for c2's port must fail rather than talk to c2.
	c3, err := pgcluster.Start(t.Context(), pgcluster.Options{Port: c2.Port(), Logger: testLogger(t)})
	if c3 != nil {
		_ = c3.Stop(context.Background())
	}
	require.ErrorIs(t, err, pgcluster.ErrPortInUse)
	assert.Equal(t, 7, queryInt(t, c2.URL("postgres"), "select n from kept"), "c2 unaffected")
}

func TestStartErrors(t *testing.T) {
	t.Parallel()
	// A port somebody else is listening on.
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { busy.Close() })
	busyPort := busy.Addr().(*net.TCPAddr).Port

	tests := []struct {
		name      string
		opts      func(t *testing.T) pgcluster.Options
		rootOnly  bool
		wantIs    error
		wantInErr []string
	}{
		{
			name:      "negative port",
			opts:      func(*testing.T) pgcluster.Options { return pgcluster.Options{Port: -1} },
			wantInErr: []string{"invalid port"},
		},
		{
			name:      "port in use",
			opts:      func(*testing.T) pgcluster.Options { return pgcluster.Options{Port: busyPort} },
			wantIs:    pgcluster.ErrPortInUse,
			wantInErr: []string{"server log", "could not bind"},
		},
		{
			name: "dir not traversable by postgres",
			opts: func(t *testing.T) pgcluster.Options {
				return pgcluster.Options{Dir: filepath.Join(t.TempDir(), "pg")} // t.TempDir's parent is 0700
			},
			rootOnly:  true,
			wantIs:    os.ErrPermission,
			wantInErr: []string{"not traversable"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if tt.rootOnly && os.Geteuid() != 0 {
				t.Skip("only relevant when running as root")
			}
			opts := tt.opts(t)
			opts.Logger = testLogger(t)
			c, err := pgcluster.Start(t.Context(), opts)
			if c != nil {
				_ = c.Stop(context.Background())
			}
			require.Error(t, err)
			assert.Nil(t, c)
			if tt.wantIs != nil {
				assert.ErrorIs(t, err, tt.wantIs)
			}
			for _, s := range tt.wantInErr {
				assert.Contains(t, err.Error(), s)
			}
		})
	}
}

// TestConcurrentStarts checks that clusters started at the same time get
// distinct ports and do not interfere.
func TestConcurrentStarts(t *testing.T) {
	t.Parallel()
	const n = 2
	clusters := make(chan *pgcluster.Cluster, n)
	errs := make(chan error, n)
	for range n {
		go func() {
			c, err := pgcluster.Start(t.Context(), pgcluster.Options{Logger: testLogger(t)})
			if err != nil {
				errs <- err
				return
			}
			clusters <- c
		}()
	}
	var got []*pgcluster.Cluster
	for range n {
		select {
		case err := <-errs:
			t.Error(err)
		case c := <-clusters:
			got = append(got, c)
			t.Cleanup(func() { assert.NoError(t, c.Stop(context.Background())) })
		}
	}
	require.Len(t, got, n)
	assert.NotEqual(t, got[0].Port(), got[1].Port())
	for _, c := range got {
		assert.Equal(t, 1, queryInt(t, c.URL("postgres"), "select 1"))
	}
}

// worldSearchableTempDir returns a fresh directory postgres can traverse
// even when we run as root, removed at the end of the test.
func worldSearchableTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "pgcluster-test-")
	require.NoError(t, err)
	require.NoError(t, os.Chmod(dir, 0o755))
	t.Cleanup(func() { assert.NoError(t, os.RemoveAll(dir)) })
	return dir
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// makeTempClusterDirs creates temporary cluster directories as a dead
// process, a live process (us) and no process would have left them.
func makeTempClusterDirs(t *testing.T) (abandoned, ours, unowned string) {
	t.Helper()
	// A pid that certainly belonged to a process which has exited.
	dead := osexec.Command("true")
	require.NoError(t, dead.Run())

	mk := func(owner string) string {
		dir, err := os.MkdirTemp("", "capstan-pg-test-")
		require.NoError(t, err)
		t.Cleanup(func() { _ = os.RemoveAll(dir) })
		if owner != "" {
			require.NoError(t, os.WriteFile(filepath.Join(dir, "owner.pid"), []byte(owner+"\n"), 0o644))
		}
		return dir
	}
	return mk(strconv.Itoa(dead.Process.Pid)), mk(strconv.Itoa(os.Getpid())), mk("")
}
