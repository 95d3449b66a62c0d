package pgstore

import (
	"context"
	"fmt"
)

// MigrateToForTest applies the embedded migrations up to version (or, when
// down, rolls back to it), for tests of a migration's data changes.
func MigrateToForTest(ctx context.Context, url string, version int64, down bool) error {
	db, err := openSQL(url)
	if err != nil {
		return err
	}
	defer db.Close()
	p, err := newMigrator(db, nil)
	if err != nil {
		return err
	}
	if down {
		_, err = p.DownTo(ctx, version)
	} else {
		_, err = p.UpTo(ctx, version)
	}
	if err != nil {
		return fmt.Errorf("migrate to %d: %w", version, err)
	}
	return nil
}
