package pgstore

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"io/fs"
	"log/slog"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

//go:embed migration/*.sql
var migrations embed.FS

// SchemaVersion is the migration version this binary expects; /readyz and
// the daemons compare it with the database's.
const SchemaVersion = 5

func newMigrator(db *sql.DB, logger *slog.Logger) (*goose.Provider, error) {
	sub, err := fs.Sub(migrations, "migration")
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	locker, err := lock.NewPostgresSessionLocker()
	if err != nil {
		return nil, fmt.Errorf("migration lock: %w", err)
	}
	opts := []goose.ProviderOption{goose.WithSessionLocker(locker), goose.WithDisableGlobalRegistry(true)}
	if logger != nil {
		opts = append(opts, goose.WithSlog(logger))
	}
	return goose.NewProvider(goose.DialectPostgres, db, sub, opts...)
}

// Migrate applies every pending embedded migration to the database at url,
// under a PostgreSQL advisory lock so several processes may call it at once.
// It returns the schema version reached.
func Migrate(ctx context.Context, url string, logger *slog.Logger) (int64, error) {
	db, err := openSQL(url)
	if err != nil {
		return 0, err
	}
	defer db.Close()
	p, err := newMigrator(db, logger)
	if err != nil {
		return 0, err
	}
	if _, err := p.Up(ctx); err != nil {
		return 0, fmt.Errorf("migrate up: %w", err)
	}
	v, err := p.GetDBVersion(ctx)
	if err != nil {
		return 0, fmt.Errorf("migrate: read version: %w", err)
	}
	return v, nil
}

// MigrateStatus returns the database's schema version (0 for an empty
// database) without changing anything.
func MigrateStatus(ctx context.Context, url string) (int64, error) {
	db, err := openSQL(url)
	if err != nil {
		return 0, err
	}
	defer db.Close()
	p, err := newMigrator(db, nil)
	if err != nil {
		return 0, err
	}
	v, err := p.GetDBVersion(ctx)
	if err != nil {
		return 0, fmt.Errorf("migrate: read version: %w", err)
	}
	return v, nil
}

func openSQL(url string) (*sql.DB, error) {
	cfg, err := pgxConnConfig(url)
	if err != nil {
		return nil, err
	}
	return stdlib.OpenDB(*cfg), nil
}
