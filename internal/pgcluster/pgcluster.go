// Package pgcluster starts throwaway PostgreSQL clusters for development
// and tests.
//
// [Start] runs initdb into a directory (a fresh temporary one by default),
// starts a postgres server on a loopback port tuned for speed over
// durability (fsync, synchronous_commit and full_page_writes are off), and
// waits until it accepts connections. Every database is reachable as the
// "postgres" superuser with trust authentication via [Cluster.URL].
//
// When the process runs as root (as in CI containers), initdb, pg_ctl and
// postgres run as the "postgres" OS user, because PostgreSQL refuses to run
// as root; the directories the server needs are chowned to that user and the
// temporary directory is made world-searchable.
//
// The server is a child of the calling process and is sent SIGQUIT
// (immediate shutdown) by the kernel if the calling process dies, so a
// crashed or killed test binary does not leave a server running. Callers
// must still call [Cluster.Stop], which also removes the temporary directory.
package pgcluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// ErrClosed is returned by [Cluster.StartServer] and [Cluster.Restart] after
// [Cluster.Stop] has been called.
var ErrClosed = errors.New("pgcluster: cluster is stopped")

// ErrPortInUse is wrapped by the errors of [Start], [Cluster.StartServer] and
// [Cluster.Restart] when the server's port is taken by another process.
// Start only returns it for an explicit [Options].Port; with Port 0 it retries
// with other free ports first.
var ErrPortInUse = errors.New("pgcluster: port already in use")

// Timeouts and limits. They are not configurable: the cluster is for tests
// and development only.
const (
	// readyTimeout bounds how long a server start waits for the server to
	// accept connections (unless the caller's context ends sooner).
	readyTimeout = 30 * time.Second
	// stopTimeout bounds the fast shutdown when the caller's context does
	// not bound it more tightly.
	stopTimeout = 30 * time.Second
	// escalateTimeout bounds the immediate-shutdown and SIGKILL steps
	// together (half each); they run even when the caller's context has
	// ended.
	escalateTimeout = 10 * time.Second
	// portAttempts is how many free ports Start tries when Options.Port is
	// 0 and another process grabs the chosen port first.
	portAttempts = 3
	// logTailBytes is how much of the server log errors include.
	logTailBytes = 4 << 10
)

// Options configures [Start]. The zero value is valid.
type Options struct {
	// Dir is the directory holding the cluster: the data directory
	// (Dir/data), the Unix socket directory (Dir/sock) and the server log
	// (Dir/postgres.log). Empty (the default) creates a temporary directory
	// (os.TempDir()/capstan-pg-*) that Stop removes; such directories left
	// behind by processes that died without Stop are removed by later
	// Starts. A non-empty Dir is created if missing and never
	// removed; if Dir/data already holds a cluster, it is reused instead of
	// running initdb, so data survives across runs. When running as root,
	// every ancestor of Dir must be searchable by the postgres OS user.
	Dir string

	// Port is the TCP port the server listens on at 127.0.0.1. 0 (the
	// default) picks a free port, retrying with another one if the port is
	// taken before the server binds it.
	Port int

	// Logger receives progress and shutdown messages. nil discards them.
	Logger *slog.Logger
}

// Cluster is a running (or stopped) throwaway PostgreSQL cluster. It is safe
// for concurrent use. Callers must call [Cluster.Stop] when done.
type Cluster struct {
	log     *slog.Logger
	bins    binaries
	user    *osUser // nil: run as ourselves
	dir     string
	dataDir string
	sockDir string
	logPath string
	ownsDir bool

	port int // fixed once Start returns

	mu     sync.Mutex  // guards proc and closed
	proc   *serverProc // nil while the server is stopped
	closed bool
}

// serverProc is one run of the postgres server process.
type serverProc struct {
	cmd     *exec.Cmd
	logFile *os.File
	exited  chan struct{} // closed when cmd.Wait returns
	waitErr error         // cmd.Wait's result, valid once exited is closed
}

// Start creates (or reuses, see [Options].Dir) a cluster and starts its
// server, returning once the server accepts connections. ctx bounds the
// whole start; the server start itself also gives up after 30 s.
//
// On error nothing is left behind: the server is stopped and a temporary
// directory is removed. Errors from a failed server start include the tail of
// the server log. Errors wrap [exec.ErrNotFound] if the PostgreSQL binaries
// are missing and [os.ErrPermission] if Dir is not traversable by the
// postgres OS user.
func Start(ctx context.Context, opts Options) (_ *Cluster, err error) {
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if opts.Port < 0 || opts.Port > 65535 {
		return nil, fmt.Errorf("pgcluster: invalid port %d", opts.Port)
	}
	bins, err := findBinaries()
	if err != nil {
		return nil, err
	}
	u, err := serverUser()
	if err != nil {
		return nil, err
	}

	c := &Cluster{log: log, bins: bins, user: u, port: opts.Port}
	if opts.Dir == "" {
		removeAbandoned(ctx, log)
		dir, err := os.MkdirTemp("", tempPrefix)
		if err != nil {
			return nil, fmt.Errorf("pgcluster: create temp dir: %w", err)
		}
		c.dir, c.ownsDir = dir, true
		if err := writeOwner(dir); err != nil {
			_ = os.RemoveAll(dir)
			return nil, fmt.Errorf("pgcluster: write owner file: %w", err)
		}
		if u != nil {
			// MkdirTemp makes the directory 0700; postgres must traverse it.
			if err := os.Chmod(dir, 0o755); err != nil {
				_ = os.RemoveAll(dir)
				return nil, fmt.Errorf("pgcluster: chmod %s: %w", dir, err)
			}
		}
	} else {
		dir, err := filepath.Abs(opts.Dir)
		if err != nil {
			return nil, fmt.Errorf("pgcluster: absolute path of %s: %w", opts.Dir, err)
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fmt.Errorf("pgcluster: create dir: %w", err)
		}
		c.dir = dir
	}
	c.dataDir = filepath.Join(c.dir, "data")
	c.sockDir = filepath.Join(c.dir, "sock")
	c.logPath = filepath.Join(c.dir, "postgres.log")
	defer func() {
		if err != nil {
			// Stop kills whatever runs and removes a temp dir; it cannot
			// fail in a way that matters more than err.
			_ = c.Stop(context.WithoutCancel(ctx))
		}
	}()

	if err := u.checkTraversable(c.dir); err != nil {
		return nil, err
	}
	if err := c.initdb(ctx); err != nil {
		return nil, err
	}

	c.mu.Lock()
	defer c.mu.Unlock()
	for attempt := 1; ; attempt++ {
		pick := opts.Port == 0
		if pick {
			if c.port, err = freePort(); err != nil {
				return nil, err
			}
		}
		err = c.startLocked(ctx)
		if err == nil || !pick || attempt == portAttempts || !errors.Is(err, ErrPortInUse) {
			break
		}
		log.DebugContext(ctx, "pgcluster: port taken, retrying", "port", c.port, "attempt", attempt)
	}
	if err != nil {
		return nil, err
	}
	return c, nil
}

// initdb creates the data directory unless it already holds a cluster.
func (c *Cluster) initdb(ctx context.Context) error {
	if _, err := os.Stat(filepath.Join(c.dataDir, "PG_VERSION")); err == nil {
		c.log.InfoContext(ctx, "pgcluster: reusing existing data directory", "dir", c.dataDir)
		return c.prepareDirs()
	}
	if err := c.prepareDirs(); err != nil {
		return err
	}
	start := time.Now()
	cmd := exec.CommandContext(ctx, c.bins.initdb,
		"-D", c.dataDir,
		"-A", "trust",
		"-U", "postgres",
		"--no-sync",
		"-E", "UTF8",
		"--locale=C",
	)
	cmd.Dir = c.dir
	cmd.SysProcAttr = c.user.sysProcAttr(0)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("pgcluster: initdb %s: %w\n%s", c.dataDir, err, strings.TrimSpace(string(out)))
	}
	c.log.DebugContext(ctx, "pgcluster: initdb done", "dir", c.dataDir, "took", time.Since(start))
	return nil
}

// prepareDirs creates the data and socket directories with the owner and
// mode postgres requires (0700, owned by the server's OS user).
func (c *Cluster) prepareDirs() error {
	for _, d := range []string{c.dataDir, c.sockDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return fmt.Errorf("pgcluster: create %s: %w", d, err)
		}
		if err := c.user.chown(d); err != nil {
			return err
		}
		if err := os.Chmod(d, 0o700); err != nil {
			return fmt.Errorf("pgcluster: chmod %s: %w", d, err)
		}
	}
	return nil
}

// URL returns the connection URL of database dbname as the postgres
// superuser over TCP, e.g.
// postgres://postgres@127.0.0.1:54321/app?sslmode=disable. It does not create
// the database; "postgres" always exists.
func (c *Cluster) URL(dbname string) string {
	u := url.URL{
		Scheme:   "postgres",
		User:     url.User("postgres"),
		Host:     net.JoinHostPort("127.0.0.1", strconv.Itoa(c.port)),
		Path:     "/" + dbname,
		RawQuery: "sslmode=disable",
	}
	return u.String()
}

// Port returns the TCP port the server listens on at 127.0.0.1. It stays
// the same across [Cluster.Restart], [Cluster.StopServer] and
// [Cluster.StartServer].
func (c *Cluster) Port() int {
	// port is written only by Start, before c is returned.
	return c.port
}

// Dir returns the directory holding the data directory, socket directory
// and server log.
func (c *Cluster) Dir() string { return c.dir }

// LogPath returns the path of the server log file. Each server start
// appends to it.
func (c *Cluster) LogPath() string { return c.logPath }

// Running reports whether the server process is running (it may still be
// starting up or shutting down).
func (c *Cluster) Running() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.proc == nil {
		return false
	}
	select {
	case <-c.proc.exited:
		return false
	default:
		return true
	}
}

// StartServer starts the server after [Cluster.StopServer], on the same port
// and data directory, returning once it accepts connections (at most 30 s,
// or until ctx ends). It is a no-op if the server is running. It returns
// [ErrClosed] after [Cluster.Stop], and an error including the server log's
// tail if the server does not come up (for example because another process
// took the port meanwhile).
func (c *Cluster) StartServer(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	if c.proc != nil {
		select {
		case <-c.proc.exited:
			c.log.WarnContext(ctx, "pgcluster: server had exited on its own", "err", c.proc.waitErr, "port", c.port)
			c.reapLocked()
		default:
			return nil
		}
	}
	return c.startLocked(ctx)
}

// StopServer stops the server (pg_ctl stop -m fast, escalating to an
// immediate shutdown and then SIGKILL) but keeps the data directory, so
// [Cluster.StartServer] can bring it back: use it to simulate a database
// outage. Connections fail while the server is down. ctx bounds the fast
// shutdown; escalation happens even if ctx has ended, so the server is always
// down when StopServer returns. It is a no-op if the server is not running.
func (c *Cluster) StopServer(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.stopLocked(ctx)
}

// Restart stops the server with a fast shutdown and starts it again on the
// same port and data directory, like [Cluster.StopServer] followed by
// [Cluster.StartServer]. Committed data is kept; open connections are
// terminated. It returns [ErrClosed] after [Cluster.Stop].
func (c *Cluster) Restart(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	if err := c.stopLocked(ctx); err != nil {
		return err
	}
	return c.startLocked(ctx)
}

// Stop stops the server (as [Cluster.StopServer]) and, if Start created a
// temporary directory, removes it. It is idempotent: later calls return nil.
// After Stop the cluster cannot be started again. ctx bounds the graceful
// part of the shutdown only; the server is always gone when Stop returns.
func (c *Cluster) Stop(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	err := c.stopLocked(ctx)
	if c.ownsDir {
		if rmErr := os.RemoveAll(c.dir); rmErr != nil {
			err = errors.Join(err, fmt.Errorf("pgcluster: remove %s: %w", c.dir, rmErr))
		}
	}
	return err
}

// startLocked starts the server process and waits until it accepts
// connections. c.mu must be held and the server must not be running.
func (c *Cluster) startLocked(ctx context.Context) error {
	start := time.Now()
	logFile, err := os.OpenFile(c.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("pgcluster: open server log: %w", err)
	}
	st, err := logFile.Stat()
	if err != nil {
		logFile.Close()
		return fmt.Errorf("pgcluster: stat server log: %w", err)
	}
	logStart := st.Size()

	cmd := exec.Command(c.bins.postgres,
		"-D", c.dataDir,
		"-c", "listen_addresses=127.0.0.1",
		"-c", "port="+strconv.Itoa(c.port),
		"-c", "unix_socket_directories="+c.sockDir,
		"-c", "fsync=off",
		"-c", "synchronous_commit=off",
		"-c", "full_page_writes=off",
		"-c", "max_connections=300",
		"-c", "shared_buffers=128MB",
	)
	cmd.Dir = c.dir
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	// SIGQUIT is an immediate shutdown: if we die, so does the server.
	cmd.SysProcAttr = c.user.sysProcAttr(syscall.SIGQUIT)
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return fmt.Errorf("pgcluster: start postgres: %w", err)
	}
	p := &serverProc{cmd: cmd, logFile: logFile, exited: make(chan struct{})}
	go func() {
		p.waitErr = cmd.Wait()
		close(p.exited)
	}()
	c.proc = p

	if err := c.waitReady(ctx, p); err != nil {
		// Make sure the half-started server is gone before reading the
		// log, so the log is complete and the port is free.
		_ = c.stopLocked(ctx)
		logTail := c.logSince(logStart)
		if !errors.Is(err, ErrPortInUse) && (strings.Contains(logTail, "could not bind") || strings.Contains(logTail, "already in use")) {
			err = fmt.Errorf("%w: %w", ErrPortInUse, err)
		}
		return fmt.Errorf("pgcluster: start postgres on port %d: %w\nserver log (%s):\n%s", c.port, err, c.logPath, logTail)
	}
	c.log.InfoContext(ctx, "pgcluster: postgres ready", "port", c.port, "dir", c.dir, "pid", cmd.Process.Pid, "took", time.Since(start))
	return nil
}

// waitReady connects with pgx until the server accepts a connection, the
// server exits, ctx ends or readyTimeout passes.
func (c *Cluster) waitReady(ctx context.Context, p *serverProc) error {
	ctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	// A connect attempt can hang until its timeout if something else
	// accepts on the port; abandon it as soon as the server exits.
	connCtx, connCancel := context.WithCancel(ctx)
	defer connCancel()
	go func() {
		select {
		case <-p.exited:
			connCancel()
		case <-connCtx.Done():
		}
	}()
	cfg, err := pgx.ParseConfig(c.URL("postgres"))
	if err != nil {
		return fmt.Errorf("parse URL: %w", err)
	}
	cfg.ConnectTimeout = 2 * time.Second
	backoff := 5 * time.Millisecond
	for {
		conn, err := pgx.ConnectConfig(connCtx, cfg)
		if err == nil {
			return c.checkIdentity(connCtx, conn)
		}
		timer := time.NewTimer(backoff)
		select {
		case <-p.exited:
			timer.Stop()
			return fmt.Errorf("server exited during startup: %v", p.waitErr)
		case <-ctx.Done():
			timer.Stop()
			return fmt.Errorf("server not ready: %w (last connect error: %v)", ctx.Err(), err)
		case <-timer.C:
		}
		backoff = min(backoff*2, 250*time.Millisecond)
	}
}

// checkIdentity makes sure conn reached our server and not another one
// that owns the port (our server then fails to bind and exits, but the
// connection may win the race against that exit). It closes conn.
func (c *Cluster) checkIdentity(ctx context.Context, conn *pgx.Conn) error {
	defer conn.Close(context.WithoutCancel(ctx))
	var dataDir string
	if err := conn.QueryRow(ctx, "select current_setting('data_directory')").Scan(&dataDir); err != nil {
		return fmt.Errorf("query data_directory: %w", err)
	}
	if !samePath(dataDir, c.dataDir) {
		return fmt.Errorf("%w: port %d is served by another server (data directory %s)", ErrPortInUse, c.port, dataDir)
	}
	return nil
}

// samePath reports whether a and b name the same directory.
func samePath(a, b string) bool {
	if filepath.Clean(a) == filepath.Clean(b) {
		return true
	}
	sa, errA := os.Stat(a)
	sb, errB := os.Stat(b)
	return errA == nil && errB == nil && os.SameFile(sa, sb)
}

// stopLocked shuts the server down: pg_ctl stop -m fast (bounded by ctx
// and stopTimeout), then an immediate shutdown (SIGQUIT), then SIGKILL,
// until our child process has exited. c.mu must be held. It is a no-op if the server is
// not running.
func (c *Cluster) stopLocked(ctx context.Context) error {
	p := c.proc
	if p == nil {
		return nil
	}
	defer c.reapLocked()
	select {
	case <-p.exited:
		return nil
	default:
	}
	start := time.Now()

	fastCtx, cancel := context.WithTimeout(ctx, stopTimeout)
	err := c.pgCtlStop(fastCtx, p, "fast")
	cancel()
	if err == nil {
		c.log.InfoContext(ctx, "pgcluster: postgres stopped", "port", c.port, "took", time.Since(start))
		return nil
	}
	c.log.WarnContext(ctx, "pgcluster: fast shutdown failed, shutting down immediately (SIGQUIT)", "port", c.port, "err", err)

	// Immediate shutdown is what pg_ctl stop -m immediate would do; we
	// signal our child directly, which also works before the server has
	// written postmaster.pid (when pg_ctl refuses).
	escCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), escalateTimeout)
	defer cancel()
	for _, sig := range []os.Signal{syscall.SIGQUIT, os.Kill} {
		if serr := p.cmd.Process.Signal(sig); serr != nil && !errors.Is(serr, os.ErrProcessDone) {
			return fmt.Errorf("pgcluster: signal postgres pid %d: %w", p.cmd.Process.Pid, serr)
		}
		wait := time.NewTimer(escalateTimeout / 2)
		select {
		case <-p.exited:
			wait.Stop()
			return nil
		case <-wait.C:
			c.log.WarnContext(ctx, "pgcluster: postgres did not exit, escalating", "port", c.port, "signal", sig)
		case <-escCtx.Done():
			wait.Stop()
		}
	}
	return fmt.Errorf("pgcluster: postgres pid %d did not exit after SIGKILL: %w", p.cmd.Process.Pid, escCtx.Err())
}

// pgCtlStop runs pg_ctl stop with the given mode and waits for our child to
// exit, both bounded by ctx.
func (c *Cluster) pgCtlStop(ctx context.Context, p *serverProc, mode string) error {
	timeout := stopTimeout
	if dl, ok := ctx.Deadline(); ok {
		timeout = time.Until(dl)
	}
	secs := max(int(timeout/time.Second), 1)
	cmd := exec.CommandContext(ctx, c.bins.pgCtl, "stop", "-D", c.dataDir, "-m", mode, "-w", "-t", strconv.Itoa(secs), "-s")
	cmd.Dir = c.dir
	cmd.SysProcAttr = c.user.sysProcAttr(0)
	out, err := cmd.CombinedOutput()
	if err != nil {
		select {
		case <-p.exited:
			return nil // it went away anyway (e.g. exited before pg_ctl looked)
		default:
		}
		return fmt.Errorf("pg_ctl stop -m %s: %w: %s", mode, err, strings.TrimSpace(string(out)))
	}
	select {
	case <-p.exited:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("pg_ctl stop -m %s returned but postgres pid %d is still running: %w", mode, p.cmd.Process.Pid, ctx.Err())
	}
}

// reapLocked forgets a server process that has exited (or is being
// abandoned) and closes our copy of its log file.
func (c *Cluster) reapLocked() {
	if c.proc == nil {
		return
	}
	c.proc.logFile.Close()
	c.proc = nil
}

// logSince returns the tail (at most logTailBytes) of what the server log
// gained after offset off, so errors show only the failed start's output.
func (c *Cluster) logSince(off int64) string {
	s := tailFrom(c.logPath, off, logTailBytes)
	if s == "" {
		return "(empty)"
	}
	return s
}

// freePort asks the kernel for a free TCP port on 127.0.0.1. Another
// process may take it before the server binds it; Start retries then.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pgcluster: pick free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
