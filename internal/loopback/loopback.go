// Package loopback starts throwaway TCP servers on 127.0.0.1 for tests: an
// echo server and a black hole that reads and never answers. Each stops,
// with every connection it accepted, when its test ends.
package loopback

import (
	"io"
	"net"
	"sync"
	"testing"
)

// Serve listens on a free loopback port and runs handle on every
// connection until tb ends; then it closes the listener and the
// connections. It returns the address.
func Serve(tb testing.TB, handle func(net.Conn)) string {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	var (
		mu     sync.Mutex
		conns  []net.Conn
		closed bool
		wg     sync.WaitGroup
	)
	tb.Cleanup(func() {
		ln.Close()
		mu.Lock()
		closed = true
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			if closed { // accepted as the test ended
				mu.Unlock()
				c.Close()
				return
			}
			conns = append(conns, c)
			wg.Add(1)
			mu.Unlock()
			go func() { defer wg.Done(); defer c.Close(); handle(c) }()
		}
	}()
	return ln.Addr().String()
}

// Echo starts a server that writes back what it reads.
func Echo(tb testing.TB) string {
	tb.Helper()
	return Serve(tb, func(c net.Conn) { _, _ = io.Copy(c, c) })
}

// BlackHole starts a server that accepts connections and reads them, and
// never answers: an endpoint behind a connection a partition left
// half-dead, or a stopped process.
func BlackHole(tb testing.TB) string {
	tb.Helper()
	return Serve(tb, func(c net.Conn) { _, _ = io.Copy(io.Discard, c) })
}
