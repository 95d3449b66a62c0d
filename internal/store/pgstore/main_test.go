package pgstore_test

import (
	"context"
	"os"
	"testing"

	"github.com/capstan-dev/capstan/internal/store/pgstore"
	"github.com/capstan-dev/capstan/internal/testutil/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.RunMain(m)) }

func migrate(ctx context.Context, url string) error {
	_, err := pgstore.Migrate(ctx, url, nil)
	return err
}
