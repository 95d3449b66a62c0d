// Package pgstore is Capstan's PostgreSQL storage adapter (pgx/v5). It owns
// the schema (embedded goose migrations) and every SQL statement. Each
// state-changing statement is guarded by version, status, attempt or lease
// token, and documents what zero rows means; due and expiry times always
// come from the database clock (now()), never from the caller's clock.
//
// Errors: pgx and pgconn errors are translated here into the sentinels of
// package execution (ErrNotFound, ErrConflict, ErrLeaseLost,
// ErrIdempotencyConflict) or wrapped with ErrUnavailable when the database
// cannot be reached.
package pgstore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/capstan-dev/capstan/internal/execution"
)

// DefaultIdleInTransactionTimeout is the server-side limit on a session
// idle inside a transaction, unless the URL sets
// idle_in_transaction_session_timeout (e.g. ?idle_in_transaction_session_timeout=30s).
const DefaultIdleInTransactionTimeout = "10s"

// DefaultMaxConns is the pool size when the URL does not set pool_max_conns.
const DefaultMaxConns = 20

// Store is the PostgreSQL store. It is safe for concurrent use.
type Store struct {
	pool   *pgxpool.Pool
	logger *slog.Logger
}

// Open connects a pool to url (a libpq URL or DSN). It does not wait for the
// database: the first query does, so daemons can start while PostgreSQL is
// still coming up and report not-ready meanwhile.
func Open(ctx context.Context, url string, logger *slog.Logger) (*Store, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("database url: %w", err)
	}
	if cfg.MaxConns < DefaultMaxConns && !strings.Contains(url, "pool_max_conns") {
		cfg.MaxConns = DefaultMaxConns
	}
	if _, set := cfg.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"]; !set {
		// A process stopped inside a transaction (SIGSTOP, a paused VM, a
		// network split that keeps the socket open) must not hold its row
		// locks until it resumes: the server ends such a session, its
		// transaction rolls back, and leases and claims do the rest.
		cfg.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = DefaultIdleInTransactionTimeout
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("database pool: %w", err)
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Store{pool: pool, logger: logger}, nil
}

func pgxConnConfig(url string) (*pgx.ConnConfig, error) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("database url: %w", err)
	}
	return cfg, nil
}

// Close closes the pool.
func (s *Store) Close() { s.pool.Close() }

// Ping checks that the database answers and that its schema is at
// SchemaVersion; it returns an error saying which of the two failed.
func (s *Store) Ping(ctx context.Context) error {
	var v int64
	err := s.pool.QueryRow(ctx, `SELECT coalesce(max(version_id), 0) FROM goose_db_version WHERE is_applied`).Scan(&v)
	if err != nil {
		return translate(fmt.Errorf("ping: %w", err))
	}
	if v != SchemaVersion {
		return fmt.Errorf("schema version %d, want %d: run `capstanctl migrate`", v, SchemaVersion)
	}
	return nil
}

// Now returns the database clock.
func (s *Store) Now(ctx context.Context) (time.Time, error) {
	var t time.Time
	if err := s.pool.QueryRow(ctx, `SELECT now()`).Scan(&t); err != nil {
		return time.Time{}, translate(err)
	}
	return t, nil
}

// withTx runs fn in a transaction, committing when fn returns nil. The
// rollback runs under a detached context so a cancelled caller still
// releases the connection cleanly.
func (s *Store) withTx(ctx context.Context, fn func(tx pgx.Tx) error) error {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return translate(fmt.Errorf("begin: %w", err))
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = tx.Rollback(rctx)
	}()
	if err := fn(tx); err != nil {
		return translate(err)
	}
	if err := tx.Commit(ctx); err != nil {
		return translate(fmt.Errorf("commit: %w", err))
	}
	return nil
}

// translate maps connection-level failures to execution.ErrUnavailable and
// leaves domain sentinels as they are.
func translate(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, execution.ErrNotFound) || errors.Is(err, execution.ErrConflict) ||
		errors.Is(err, execution.ErrLeaseLost) || errors.Is(err, execution.ErrIdempotencyConflict) ||
		errors.Is(err, execution.ErrUnavailable) || errors.Is(err, execution.ErrPermissionDenied) ||
		errors.Is(err, execution.ErrCompletionRefused) {
		return err
	}
	if errors.Is(err, pgx.ErrNoRows) {
		// Keep the caller's context ("get execution X"), not the driver's words.
		return fmt.Errorf("%w: %s", execution.ErrNotFound, strings.TrimSuffix(err.Error(), ": "+pgx.ErrNoRows.Error()))
	}
	if isUnavailable(err) {
		return fmt.Errorf("%w: %w", execution.ErrUnavailable, err)
	}
	return err
}

func isUnavailable(err error) bool {
	var netErr net.Error
	if errors.As(err, &netErr) {
		return true
	}
	var connErr *pgconn.ConnectError
	if errors.As(err, &connErr) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		// Class 08: connection exception; 57P01-57P03: admin shutdown,
		// crash shutdown, cannot connect now; 53300: too many connections.
		switch {
		case len(pgErr.Code) == 5 && pgErr.Code[:2] == "08",
			pgErr.Code == "57P01", pgErr.Code == "57P02", pgErr.Code == "57P03", pgErr.Code == "53300":
			return true
		}
		return false
	}
	if pgconn.SafeToRetry(err) || pgconn.Timeout(err) {
		return true
	}
	return errors.Is(err, net.ErrClosed) || errors.Is(err, context.DeadlineExceeded)
}

// OpenForDaemon is how every daemon opens its store: it applies pending
// migrations first when migrateOnStart is set (under the migration lock, so
// replicas may race), then opens the pool.
func OpenForDaemon(ctx context.Context, url string, migrateOnStart bool, logger *slog.Logger) (*Store, error) {
	if migrateOnStart {
		v, err := Migrate(ctx, url, logger)
		if err != nil {
			return nil, err
		}
		if logger != nil {
			logger.Info("database migrated", "schema_version", v)
		}
	}
	return Open(ctx, url, logger)
}
