package bench

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sync/errgroup"
)

// TestLeanH2Modes runs the agent suite's lean HTTP/2 modes briefly against
// a real agent and Redis: Check over Connect on h2c and Envoy's
// ShouldRateLimit over gRPC, every call decided and allowed.
func TestLeanH2Modes(t *testing.T) { runAgentModes(t, "connect-lean-h2", "envoy-lean") }

// TestLeanH2Errors: a response that is not a successful one the generator
// can read is an error naming what was wrong, never a decision, and a
// server that goes away fails the call instead of hanging it.
func TestLeanH2Errors(t *testing.T) {
	grpcBody := func(w http.ResponseWriter, body []byte, status string) {
		w.Header().Set("Content-Type", "application/grpc")
		w.Header().Set("Trailer", "Grpc-Status")
		_, _ = w.Write(body)
		w.Header().Set("Grpc-Status", status)
	}
	for _, tc := range []struct {
		name    string
		grpc    bool
		handler http.HandlerFunc
		want    string
	}{
		{"connect status", false, func(w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte(`{"code":"unavailable"}`))
		}, "status 503"},
		{"connect body", false, func(w http.ResponseWriter, _ *http.Request) {
			_, _ = w.Write([]byte{0xff, 0xff, 0xff})
		}, "proto"},
		{"grpc status", true, func(w http.ResponseWriter, _ *http.Request) {
			grpcBody(w, nil, "8")
		}, "grpc-status 8"},
		{"grpc framing", true, func(w http.ResponseWriter, _ *http.Request) {
			grpcBody(w, []byte{0, 0, 0, 0, 9, 1}, "0")
		}, "not one uncompressed gRPC message"},
		{"server gone", false, func(w http.ResponseWriter, _ *http.Request) {
			panic(http.ErrAbortHandler) // resets the stream
		}, "stream reset"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := httptest.NewUnstartedServer(tc.handler)
			s.Config.Protocols = new(http.Protocols)
			s.Config.Protocols.SetUnencryptedHTTP2(true)
			s.Start()
			defer s.Close()
			l := newLeanH2(strings.TrimPrefix(s.URL, "http://"), "/x.Y/Z", tc.grpc, [][]byte{{}}, 1, 1, checkResponses(1))
			defer l.close()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			err := l.target()(ctx, 0, 0)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// TestLeanH2FlowControl moves more than both connection windows over one
// connection: 100 requests of 4 KiB (the server's initial window is 64 KiB,
// so sends wait for its WINDOW_UPDATEs) and responses of 1 MiB (100 MiB in
// all, so the generator must credit what it reads). Every call completes.
func TestLeanH2FlowControl(t *testing.T) {
	reply := bytes.Repeat([]byte{'r'}, 1<<20)
	s := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil || len(body) != 4096 {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		_, _ = w.Write(reply)
	}))
	s.Config.Protocols = new(http.Protocols)
	s.Config.Protocols.SetUnencryptedHTTP2(true)
	s.Start()
	defer s.Close()
	var got atomic.Int64
	l := newLeanH2(strings.TrimPrefix(s.URL, "http://"), "/x.Y/Z", false, [][]byte{bytes.Repeat([]byte{'q'}, 4096)}, 4, 1,
		func(_ int, msg []byte) error {
			if len(msg) != len(reply) {
				return fmt.Errorf("response of %d bytes, want %d", len(msg), len(reply))
			}
			got.Add(1)
			return nil
		})
	defer l.close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	target := l.target()
	var g errgroup.Group
	for w := 0; w < 4; w++ {
		g.Go(func() error {
			for i := 0; i < 25; i++ {
				if err := target(ctx, w, uint64(i)); err != nil {
					return err
				}
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	if got.Load() != 100 {
		t.Fatalf("%d calls completed, want 100", got.Load())
	}
}
