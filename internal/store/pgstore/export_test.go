package pgstore

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// QueryRowForTest exposes the pool to tests of this package.
func (s *Store) QueryRowForTest(ctx context.Context, sql string, args ...any) pgx.Row {
	return s.pool.QueryRow(ctx, sql, args...)
}
