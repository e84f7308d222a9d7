package faultproxy

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/allot-dev/allot/internal/loopback"
)

func start(t *testing.T, cfg Config) *Proxy {
	t.Helper()
	up := loopback.Echo(t)
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

// TestForwardsInOrderThroughJitterAndLoss: bytes written in many small
// chunks, each drawing a delay from a range far wider than the gap between
// writes (and some a loss penalty on top), come back unchanged and in
// order. A proxy that wrote each chunk when its own draw said would
// deliver them out of order: a chunk drawing 2 ms written just after one
// drawing 20 ms overtakes it. (How long the round trip takes is
// TestDelaysEachWay's and TestLossArrivesPenaltyLate's.)
func TestForwardsInOrderThroughJitterAndLoss(t *testing.T) {
	const writes = 100
	cfg := Config{DelayMin: 2 * time.Millisecond, DelayMax: 20 * time.Millisecond, Loss: 0.2, LossPenalty: 10 * time.Millisecond}
	p := start(t, cfg)
	c, err := net.Dial("tcp", p.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var sent bytes.Buffer
	for i := 0; i < writes; i++ {
		msg := []byte{byte(i), byte(i >> 8), 'x', 'y'}
		sent.Write(msg)
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
		// Separate chunks (the proxy reads each write on its own), 0.2-1 ms
		// apart: well inside the 18 ms spread of the delays.
		time.Sleep(200 * time.Microsecond)
	}
	got := make([]byte, sent.Len())
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, sent.Bytes()) {
		t.Fatalf("bytes came back changed or out of order:\n got %v\nwant %v", got, sent.Bytes())
	}
	// The order check means something only if the writes crossed the proxy
	// as many chunks: coalesced into a few reads, there would be nothing to
	// reorder. Chunks counts both directions; the client's side alone
	// must have made at least half the writes' worth.
	if s := p.Stats(); s.Conns != 1 || s.Chunks < writes/2 || s.Lost == 0 {
		t.Errorf("stats = %+v, want one connection, at least %d chunks and some lost", s, writes/2)
	}
}

// stampingEcho starts an upstream that echoes every connection and sends
// the time it read each chunk, before echoing it, on the returned channel.
func stampingEcho(t *testing.T) (string, <-chan time.Time) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	stamps := make(chan time.Time, 64)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 1024)
				for {
					n, err := c.Read(buf)
					if n > 0 {
						select {
						case stamps <- time.Now():
						default:
						}
						if _, err := c.Write(buf[:n]); err != nil {
							return
						}
					}
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String(), stamps
}

// oneWays sends one message through a proxy with fault set cfg to a
// stamping echo, rounds times over one connection, and returns each
// exchange's time there (write to the upstream's read) and back (the
// upstream's read to the client's read of the reply). The test sleeps
// nowhere: all of the time is the proxy's.
func oneWays(t *testing.T, cfg Config, rounds int) (p *Proxy, there, back []time.Duration) {
	t.Helper()
	up, stamps := stampingEcho(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p = New(ln, func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", up)
	}, cfg, 7)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	c, err := net.Dial("tcp", p.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	msg, got := []byte("ping"), make([]byte, 4)
	for range rounds {
		sent := time.Now()
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, msg) {
			t.Fatalf("reply %q, %v; want %q", got, err, msg)
		}
		replied := time.Now()
		var arrived time.Time
		select {
		case arrived = <-stamps:
		case <-time.After(5 * time.Second):
			t.Fatal("the upstream never stamped the request")
		}
		there, back = append(there, arrived.Sub(sent)), append(back, replied.Sub(arrived))
	}
	return p, there, back
}

// TestDelaysEachWay: a request and its reply each arrive at least DelayMin
// after they were sent, every time.
func TestDelaysEachWay(t *testing.T) {
	cfg := Config{DelayMin: 25 * time.Millisecond, DelayMax: 35 * time.Millisecond}
	p, there, back := oneWays(t, cfg, 5)
	for i := range there {
		if there[i] < cfg.DelayMin || back[i] < cfg.DelayMin {
			t.Errorf("round %d: there %s, back %s; want each at least DelayMin %s", i, there[i], back[i], cfg.DelayMin)
		}
	}
	if s := p.Stats(); s.Chunks < 10 || s.Lost != 0 {
		t.Errorf("stats = %+v, want 10 chunks (a request and a reply a round) and none lost", s)
	}
}

// TestLossArrivesPenaltyLate: with every chunk lost (Loss 1) and no delay,
// a request and its reply each arrive at least LossPenalty late: loss
// delays by a retransmission, it never drops bytes.
func TestLossArrivesPenaltyLate(t *testing.T) {
	cfg := Config{Loss: 1, LossPenalty: 60 * time.Millisecond}
	p, there, back := oneWays(t, cfg, 3)
	for i := range there {
		if there[i] < cfg.LossPenalty || back[i] < cfg.LossPenalty {
			t.Errorf("round %d: there %s, back %s; want each at least LossPenalty %s", i, there[i], back[i], cfg.LossPenalty)
		}
	}
	if s := p.Stats(); s.Chunks < 6 || s.Lost != s.Chunks {
		t.Errorf("stats = %+v, want every chunk (at least 6) lost", s)
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
