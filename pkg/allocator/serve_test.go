package allocator

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestServeClosesStalledConnections: a client that holds a call open past
// the grace period is cut off when Serve returns, so no handler keeps
// running against a node or an agent its caller closes next.
func TestServeClosesStalledConnections(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	entered := make(chan struct{})
	handlerDone := make(chan error, 1)
	srv := HTTPServer(ln.Addr().String(), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(entered)
		_, err := io.ReadAll(r.Body) // the client never finishes its body
		handlerDone <- err
	}))
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- Serve(ctx, srv, ln, 200*time.Millisecond) }()

	pr, pw := io.Pipe()
	defer pw.Close()
	go func() {
		req, _ := http.NewRequest(http.MethodPost, "http://"+ln.Addr().String()+"/", pr)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	if _, err := pw.Write([]byte(strings.Repeat("x", 10))); err != nil {
		t.Fatal(err)
	}
	select {
	case <-entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the handler was not called")
	}
	cancel()
	select {
	case err := <-served:
		if err == nil {
			t.Fatal("Serve returned nil after a drain cut short; want the shutdown's error")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Serve did not return")
	}
	select {
	case <-handlerDone: // its connection was closed under it
	case <-time.After(2 * time.Second):
		t.Fatal("the stalled handler is still running 2 s after Serve returned")
	}
}
