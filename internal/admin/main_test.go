package admin_test

import (
	"os"
	"testing"

	"github.com/capstan-dev/capstan/internal/testutil/pgtest"
)

// TestMain runs the tests, stops the shared PostgreSQL cluster and checks
// for leaked goroutines.
func TestMain(m *testing.M) { os.Exit(pgtest.RunMain(m)) }
