package bench

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
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
