package faultproxy

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"testing"
	"time"
)

// echo starts an upstream that echoes every connection.
func echo(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); _, _ = io.Copy(c, c) }()
		}
	}()
	return ln.Addr().String()
}

func start(t *testing.T, cfg Config) *Proxy {
	t.Helper()
	up := echo(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := New(ln, func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", up)
	}, cfg, 7)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return p
}

func TestForwardsInOrderThroughJitterAndLoss(t *testing.T) {
	cfg := Config{DelayMin: 2 * time.Millisecond, DelayMax: 8 * time.Millisecond, Loss: 0.2, LossPenalty: 3 * time.Millisecond}
	p := start(t, cfg)
	c, err := net.Dial("tcp", p.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var sent bytes.Buffer
	began := time.Now()
	for i := 0; i < 100; i++ {
		msg := []byte{byte(i), byte(i >> 8), 'x', 'y'}
		sent.Write(msg)
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
		time.Sleep(200 * time.Microsecond) // separate chunks, so jitter could reorder them
	}
	got := make([]byte, sent.Len())
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, sent.Bytes()) {
		t.Fatal("bytes came back changed or out of order")
	}
	// Each byte crossed the proxy twice, each time at least DelayMin late.
	if el := time.Since(began); el < 2*cfg.DelayMin {
		t.Errorf("round trip took %s, less than twice the minimum delay", el)
	}
	if s := p.Stats(); s.Conns != 1 || s.Chunks == 0 || s.Lost == 0 {
		t.Errorf("stats = %+v, want one connection, chunks and some lost", s)
	}
}

func TestCutResetsAndRefuses(t *testing.T) {
	p := start(t, Config{})
	c, err := net.Dial("tcp", p.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(c, buf); err != nil {
		t.Fatal(err)
	}
	p.Cut(true)
	if _, err := io.ReadFull(c, buf); err == nil {
		t.Fatal("read on a cut link succeeded")
	}
	c2, err := net.Dial("tcp", p.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if _, err := io.ReadFull(c2, buf); err == nil {
		t.Fatal("a new connection on a cut link was served")
	}
	p.Cut(false)
	c3, err := net.Dial("tcp", p.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c3.Close()
	if _, err := c3.Write([]byte("pong")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c3, buf); err != nil || string(buf) != "pong" {
		t.Fatalf("after the heal: %q, %v", buf, err)
	}
	if s := p.Stats(); s.Refused != 1 {
		t.Errorf("refused = %d, want 1", s.Refused)
	}
}

func TestValidate(t *testing.T) {
	tests := []struct {
		give Config
		ok   bool
	}{
		{give: Config{}, ok: true},
		{give: Config{DelayMin: 40 * time.Millisecond, DelayMax: 60 * time.Millisecond, Loss: 0.01}, ok: true},
		{give: Config{DelayMin: 60 * time.Millisecond, DelayMax: 40 * time.Millisecond}},
		{give: Config{Loss: 1.5}},
		{give: Config{LossPenalty: -time.Second}},
	}
	for _, tt := range tests {
		err := tt.give.Validate()
		if (err == nil) != tt.ok || (err != nil && !errors.Is(err, ErrBadConfig)) {
			t.Errorf("Validate(%+v) = %v, want ok=%v", tt.give, err, tt.ok)
		}
	}
}

// TestHalfCloseKeepsTheReply: a client that sends its request and then
// half-closes (FIN) still gets the whole reply, through a delay: the proxy
// passes the half-close on instead of closing both connections.
func TestHalfCloseKeepsTheReply(t *testing.T) {
	for _, delay := range []time.Duration{0, 20 * time.Millisecond} {
		p := start(t, Config{DelayMin: delay, DelayMax: delay})
		c, err := net.Dial("tcp", p.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Write([]byte("hello")); err != nil {
			t.Fatal(err)
		}
		if err := c.(*net.TCPConn).CloseWrite(); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		got, err := io.ReadAll(c)
		c.Close()
		if err != nil || string(got) != "hello" {
			t.Fatalf("delay %s: read %q, %v; want the echoed %q and EOF", delay, got, err, "hello")
		}
	}
}
