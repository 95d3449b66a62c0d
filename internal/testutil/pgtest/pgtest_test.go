package pgtest_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/internal/testutil/pgtest"
)

func TestMain(m *testing.M) {
	os.Exit(pgtest.RunMain(m))
}

func connect(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), url)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

func migrateItems(ctx context.Context, url string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "create table items (owner text not null)"); err != nil {
		return fmt.Errorf("create table: %w", err)
	}
	return nil
}

// databaseExists reports whether a database named name exists.
func databaseExists(t *testing.T, name string) bool {
	t.Helper()
	var exists bool
	require.NoError(t, connect(t, pgtest.AdminURL(t)).QueryRow(t.Context(),
		"select exists (select from pg_database where datname = $1)", name).Scan(&exists))
	return exists
}

// TestNewDatabaseIsolation runs parallel tests that each write into their own
// database and must see only their own rows; the databases are dropped
// afterwards.
func TestNewDatabaseIsolation(t *testing.T) {
	t.Parallel()
	var (
		mu    sync.Mutex
		names = map[string]string{} // test -> database
	)
	t.Run("group", func(t *testing.T) {
		for _, owner := range []string{"alice", "bob"} {
			t.Run(owner, func(t *testing.T) {
				t.Parallel()
				url := pgtest.NewDatabase(t, migrateItems)
				conn := connect(t, url)
				for range 3 {
					_, err := conn.Exec(t.Context(), "insert into items (owner) values ($1)", owner)
					require.NoError(t, err)
				}
				var db string
				var n int
				var others int
				require.NoError(t, conn.QueryRow(t.Context(), `select current_database(),
					count(*) filter (where owner = $1), count(*) filter (where owner <> $1) from items`, owner).
					Scan(&db, &n, &others))
				assert.Equal(t, 3, n)
				assert.Zero(t, others, "rows of the other test leaked in")
				assert.True(t, strings.HasPrefix(db, "t_testnewdatabaseisolation_group_"+owner+"_"), db)
				assert.LessOrEqual(t, len(db), 63)
				assert.True(t, databaseExists(t, db))

				mu.Lock()
				names[owner] = db
				mu.Unlock()
			})
		}
	})
	require.Len(t, names, 2)
	assert.NotEqual(t, names["alice"], names["bob"])
	for _, db := range names {
		assert.False(t, databaseExists(t, db), "database %s not dropped", db)
	}
}

// TestNewDatabaseDropsWithOpenConnections checks that cleanup drops the
// database even if the test forgot to close a connection.
func TestNewDatabaseDropsWithOpenConnections(t *testing.T) {
	t.Parallel()
	var db string
	var leaked *pgx.Conn
	t.Run("leaky", func(t *testing.T) {
		url := pgtest.NewDatabase(t, nil)
		var err error
		leaked, err = pgx.Connect(t.Context(), url)
		require.NoError(t, err)
		require.NoError(t, leaked.QueryRow(t.Context(), "select current_database()").Scan(&db))
	})
	assert.False(t, databaseExists(t, db))
	// The connection was terminated by DROP ... WITH (FORCE); closing it
	// stops its goroutines so goleak stays quiet.
	assert.Error(t, leaked.Ping(t.Context()))
	leaked.Close(context.Background())
}

func TestNewDatabaseLongName(t *testing.T) {
	t.Parallel()
	name := strings.Repeat("very long subtest name ", 5)
	t.Run(name, func(t *testing.T) {
		var db string
		require.NoError(t, connect(t, pgtest.NewDatabase(t, nil)).QueryRow(t.Context(), "select current_database()").Scan(&db))
		assert.LessOrEqual(t, len(db), 63)
		assert.Regexp(t, `^t_[a-z0-9_]+_[0-9a-f]{16}$`, db)
	})
}

// TestClusterOutage stops the shared server; it must not run in parallel with
// the tests above (top-level serial tests finish before parallel ones run).
func TestClusterOutage(t *testing.T) {
	c := pgtest.Cluster(t)
	url := pgtest.NewDatabase(t, migrateItems)
	_, err := connect(t, url).Exec(t.Context(), "insert into items values ('kept')")
	require.NoError(t, err)

	require.NoError(t, c.StopServer(t.Context()))
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	defer cancel()
	_, err = pgx.Connect(ctx, url)
	require.Error(t, err, "connect while the server is down")

	require.NoError(t, c.StartServer(t.Context()))
	var owner string
	require.NoError(t, connect(t, url).QueryRow(t.Context(), "select owner from items").Scan(&owner))
	assert.Equal(t, "kept", owner)
}

// TestClusterRestartedAfterTest checks that Cluster's cleanup brings the
// server back if a test leaves it down.
func TestClusterRestartedAfterTest(t *testing.T) {
	var c interface{ Running() bool }
	t.Run("leaves server down", func(t *testing.T) {
		cl := pgtest.Cluster(t)
		c = cl
		require.NoError(t, cl.StopServer(t.Context()))
	})
	assert.True(t, c.Running())
	connect(t, pgtest.AdminURL(t))
}

// TestExternalDatabaseURL points DATABASE_URL at the shared cluster to
// exercise the external-server path.
func TestExternalDatabaseURL(t *testing.T) {
	admin := pgtest.AdminURL(t)
	t.Setenv(pgtest.EnvDatabaseURL, strings.Replace(admin, "/postgres?", "/ignored?", 1))

	t.Run("new database", func(t *testing.T) {
		url := pgtest.NewDatabase(t, migrateItems)
		assert.Contains(t, url, "sslmode=disable", "query parameters are kept")
		_, err := connect(t, url).Exec(t.Context(), "insert into items values ('x')")
		require.NoError(t, err)
		assert.Equal(t, admin, pgtest.AdminURL(t))
	})

	reached := false
	t.Run("cluster skips", func(t *testing.T) {
		pgtest.Cluster(t)
		reached = true
	})
	assert.False(t, reached, "Cluster must skip when DATABASE_URL is set")
}
