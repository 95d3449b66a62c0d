package router

import (
	"context"
	"log/slog"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/store/pgstore"
)

func TestMainDeliversAndStops(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	arrived := make(chan struct{}, 1)
	rc := newReceiver(t, func(int, http.ResponseWriter, *http.Request) {
		select {
		case arrived <- struct{}{}:
		default:
		}
	})
	id := h.event(t, h.app(t, rc.URL, newSecret(t)).ID)
	cfg := &config.Config{
		Database: config.Database{URL: h.url, MigrateOnStart: true},
		Router:   compressedConfig(),
	}
	cfg.Router.AdminListen = "127.0.0.1:0"
	logger := slog.New(slog.NewTextHandler(t.Output(), nil))
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	done := make(chan error, 1)

	go func() { done <- Main(ctx, cfg, logger) }()
	select {
	case <-arrived:
	case err := <-done:
		t.Fatalf("Main returned before delivering: %v", err)
	case <-time.After(waitTimeout):
		t.Fatal("no delivery")
	}
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(waitTimeout):
		t.Fatal("Main did not return after cancel")
	}
	require.Equal(t, pgstore.EventDelivered, h.eventRow(t, id).Status, "the delivery in flight was drained")
}

func TestMainFailsFast(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		cfg  func(c *config.Config)
		want string
	}{
		{"bad database url", func(c *config.Config) { c.Database.URL = "postgres://%zz" }, "database url"},
		{"bad admin address", func(c *config.Config) { c.Router.AdminListen = "127.0.0.1:99999" }, "admin"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := &config.Config{
				// Never connected to: each case fails before the first query.
				Database: config.Database{URL: "postgres://postgres@127.0.0.1:1/none"},
				Router:   compressedConfig(),
			}
			tt.cfg(cfg)
			err := Main(t.Context(), cfg, slog.New(slog.DiscardHandler))
			require.ErrorContains(t, err, tt.want)
		})
	}
}
