package pgstore

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// QueryRowForTest exposes the pool to tests of this package.
func (s *Store) QueryRowForTest(ctx context.Context, sql string, args ...any) pgx.Row {
	return s.pool.QueryRow(ctx, sql, args...)
}

// EnsureUnitForTest opens a unit and its interaction without parking, as a
// replay or an itemized step would.
func (s *Store) EnsureUnitForTest(ctx context.Context, o AwaitOpen) error {
	return s.withTx(ctx, func(tx pgx.Tx) error {
		_, _, err := ensureUnitTx(ctx, tx, o)
		return err
	})
}
