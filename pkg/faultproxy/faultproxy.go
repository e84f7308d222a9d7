// Package faultproxy is a small TCP proxy that puts WAN faults on one link of
// a local topology: one-way delay with jitter, loss, and cuts. The chaos
// suite puts one on every region-to-allocator link; deploy/multiregion uses
// it for its -wan-latency.
//
// The kernel of the chaos machines has no tc netem, so delay and loss are
// made here, above TCP. Bytes are never dropped (that would corrupt the
// stream): a "lost" chunk arrives one retransmission penalty late, which is
// what loss looks like to a TCP application. Order is preserved: jitter never
// lets a later chunk overtake an earlier one in the same direction.
//
// The proxy takes its listener and its upstream dialer from the caller, so
// both can live in a network namespace (see topology.Host.Listen and
// DialContext); Toxiproxy opens its own listener and cannot do that.
//
// Usage:
//
//	p := faultproxy.New(ln, dial, faultproxy.Config{DelayMin: 40 * time.Millisecond, DelayMax: 60 * time.Millisecond}, seed)
//	go p.Run(ctx)   // until ctx ends; Run closes every connection before it returns
//	p.Cut(true)     // reset open connections and refuse new ones
package faultproxy

import (
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"time"
)

// Config is the fault set of a link. The zero value forwards without faults.
type Config struct {
	// DelayMin and DelayMax bound the one-way delay added to every chunk of
	// bytes in each direction; each chunk draws uniformly from the range.
	DelayMin, DelayMax time.Duration
	// Loss is the probability that a chunk is lost once and retransmitted:
	// it then arrives LossPenalty later than its delay says.
	Loss float64
	// LossPenalty is the retransmission delay of a lost chunk (default 200ms,
	// Linux's minimum TCP retransmission timeout).
	LossPenalty time.Duration
}

// ErrBadConfig is returned by Validate for a config that cannot be applied.
var ErrBadConfig = errors.New("faultproxy: bad config")

// Validate says what is wrong with c.
func (c Config) Validate() error {
	switch {
	case c.DelayMin < 0 || c.DelayMax < c.DelayMin:
		return errors.Join(ErrBadConfig, errors.New("want 0 <= DelayMin <= DelayMax"))
	case !(c.Loss >= 0 && c.Loss <= 1):
		return errors.Join(ErrBadConfig, errors.New("want Loss in [0, 1]"))
	case c.LossPenalty < 0:
		return errors.Join(ErrBadConfig, errors.New("want LossPenalty >= 0"))
	}
	return nil
}

// DialFunc opens the upstream connection for one accepted connection.
type DialFunc func(ctx context.Context) (net.Conn, error)

// Stats counts what the proxy did.
type Stats struct {
	// Conns is the connections accepted and dialed upstream.
	Conns int64
	// Refused is the connections closed at once because the link was cut or
	// the upstream dial failed.
	Refused int64
	// Chunks is the chunks forwarded; Lost is how many of them were delayed
	// by a loss penalty.
	Chunks, Lost int64
}

// Proxy forwards connections accepted on a listener to an upstream.
type Proxy struct {
	ln   net.Listener
	dial DialFunc

	mu    sync.Mutex
	cfg   Config
	rng   *rand.Rand
	cut   bool
	conns map[net.Conn]struct{}
	stats Stats
	wg    sync.WaitGroup
}

// New returns a proxy from ln to the upstream that dial reaches, with fault
// set cfg (see Validate; an invalid cfg forwards without faults) and a
// random seed for delays and losses.
func New(ln net.Listener, dial DialFunc, cfg Config, seed uint64) *Proxy {
	if cfg.Validate() != nil {
		cfg = Config{}
	}
	return &Proxy{ln: ln, dial: dial, cfg: cfg, rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), conns: map[net.Conn]struct{}{}}
}

// Addr is the listening address.
func (p *Proxy) Addr() net.Addr { return p.ln.Addr() }

// Set replaces the fault set; it applies to bytes read from now on.
func (p *Proxy) Set(cfg Config) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	p.mu.Lock()
	p.cfg = cfg
	p.mu.Unlock()
	return nil
}

// Config returns the current fault set.
func (p *Proxy) Config() Config {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cfg
}

// Cut cuts the link (closing every open connection and refusing new ones)
// or restores it.
func (p *Proxy) Cut(cut bool) {
	p.mu.Lock()
	p.cut = cut
	var open []net.Conn
	if cut {
		for c := range p.conns {
			open = append(open, c)
		}
	}
	p.mu.Unlock()
	for _, c := range open {
		c.Close()
	}
}

// Stats returns the counters so far.
func (p *Proxy) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stats
}

// Run accepts and forwards connections until ctx ends or the listener fails,
// then closes the listener and every connection and waits for them.
func (p *Proxy) Run(ctx context.Context) error {
	stop := context.AfterFunc(ctx, func() { p.ln.Close() })
	defer stop()
	var err error
	for {
		var c net.Conn
		c, err = p.ln.Accept()
		if err != nil {
			break
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			p.serve(ctx, c)
		}()
	}
	p.ln.Close()
	p.Cut(true)
	p.wg.Wait()
	if ctx.Err() != nil {
		return nil
	}
	return err
}

func (p *Proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cut {
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *Proxy) untrack(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
}

func (p *Proxy) refuse(c net.Conn) {
	p.mu.Lock()
	p.stats.Refused++
	p.mu.Unlock()
	c.Close()
}

func (p *Proxy) serve(ctx context.Context, down net.Conn) {
	if !p.track(down) {
		p.refuse(down)
		return
	}
	defer p.untrack(down)
	dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	up, err := p.dial(dctx)
	cancel()
	if err != nil {
		p.refuse(down)
		return
	}
	if !p.track(up) {
		up.Close()
		p.refuse(down)
		return
	}
	defer p.untrack(up)
	p.mu.Lock()
	p.stats.Conns++
	p.mu.Unlock()
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); p.pipe(down, up) }()
	go func() { defer wg.Done(); p.pipe(up, down) }()
	wg.Wait()
	down.Close()
	up.Close()
}

type chunk struct {
	b   []byte
	due time.Time
}

// delay draws the extra delay of one chunk.
func (p *Proxy) delay() time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	c := p.cfg
	d := c.DelayMin
	if span := c.DelayMax - c.DelayMin; span > 0 {
		d += time.Duration(p.rng.Int64N(int64(span) + 1))
	}
	p.stats.Chunks++
	if c.Loss > 0 && p.rng.Float64() < c.Loss {
		p.stats.Lost++
		pen := c.LossPenalty
		if pen == 0 {
			pen = 200 * time.Millisecond
		}
		d += pen
	}
	return d
}

// pipe copies src to dst, holding each chunk until its due time; due times
// never decrease, so jitter keeps the order. When src ends cleanly (EOF: the
// sender half-closed), dst is half-closed once everything before the end has
// been written, and the other direction goes on: a request-then-FIN
// exchange still gets its reply. Any other end (an error, a reset, a failed
// write) closes both connections, which ends the other direction too.
func (p *Proxy) pipe(src, dst net.Conn) {
	q := make(chan chunk, 256)
	done := make(chan struct{})
	var eof bool // written before close(q): the reader saw a clean EOF
	go func() {
		defer close(done)
		t := time.NewTimer(0)
		defer t.Stop()
		failed := false
		for c := range q {
			if wait := time.Until(c.due); wait > 0 {
				t.Reset(wait)
				<-t.C
			}
			if _, err := dst.Write(c.b); err != nil {
				failed = true
				break
			}
		}
		for range q { // drain so the reader never blocks
		}
		if hc, ok := dst.(interface{ CloseWrite() error }); ok && eof && !failed {
			_ = hc.CloseWrite()
			return
		}
		dst.Close()
		src.Close()
	}()
	var last time.Time
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			due := time.Now().Add(p.delay())
			if due.Before(last) {
				due = last
			}
			last = due
			q <- chunk{b: append([]byte(nil), buf[:n]...), due: due}
		}
		if err != nil {
			eof = errors.Is(err, io.EOF)
			break
		}
	}
	close(q)
	<-done
}
