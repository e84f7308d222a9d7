package bench

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/allot-dev/allot/internal/redistest"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// TestLeanConnectMode runs the agent suite's lean HTTP/1.1 mode briefly
// against a real agent and Redis: every call is decided and allowed.
func TestLeanConnectMode(t *testing.T) { runAgentModes(t, "connect-lean") }

// runAgentModes runs the agent suite's modes briefly (8 workers, 100 keys,
// 2 connections) against a real agent and a private Redis, and wants calls
// and no errors from each.
// privateRedis starts a redis-server for t and returns a client of it; both
// end with the test.
func privateRedis(t *testing.T) *redis.Client {
	t.Helper()
	srv, err := redistest.StartServer(context.Background())
	redistest.Require(t, err)
	t.Cleanup(srv.Close)
	client := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	t.Cleanup(func() { client.Close() })
	return client
}

func runAgentModes(t *testing.T, modes ...string) {
	t.Helper()
	client := privateRedis(t)
	cfg := DefaultAgentSuiteConfig()
	cfg.Modes = modes
	cfg.Workers, cfg.Keys, cfg.Requests, cfg.Connections = 8, 100, 3000, 2
	cfg.Duration, cfg.Warmup = 5*time.Second, 100*time.Millisecond
	var out strings.Builder
	figs, err := RunAgentSuite(context.Background(), client, cfg, &out)
	if err != nil {
		t.Fatal(err)
	}
	if len(figs) != len(modes) {
		t.Fatalf("want %d figures, got %d\n%s", len(modes), len(figs), out.String())
	}
	for _, f := range figs {
		if f.Calls == 0 || f.Errors != 0 {
			t.Errorf("%s: %d calls, %d errors; want calls and no errors\n%s", f.Name, f.Calls, f.Errors, out.String())
		}
	}
}

// TestLeanConnectErrors: a response that is not a 200 with a body the
// client can read is an error naming what was wrong, never a decision.
func TestLeanConnectErrors(t *testing.T) {
	for _, tc := range []struct {
		name    string
		handler http.HandlerFunc
		want    string
	}{
		{"status", func(w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte(`{"code":"unavailable"}`))
		}, "status 503"},
		{"body", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/proto")
			_, _ = w.Write([]byte{0xff, 0xff, 0xff})
		}, "proto"},
		{"chunked", func(w http.ResponseWriter, _ *http.Request) {
			w.(http.Flusher).Flush() // no Content-Length: chunked
			_, _ = w.Write([]byte("x"))
		}, "no Content-Length"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := httptest.NewServer(tc.handler)
			defer s.Close()
			l, err := newLeanH1(strings.TrimPrefix(s.URL, "http://"), []*allotv1.CheckRequest{{}}, 1)
			if err != nil {
				t.Fatal(err)
			}
			defer l.close()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			err = l.target()(ctx, 0, 0)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}
