// Package gopool runs short functions on reused goroutines. A goroutine
// that runs a deep call path (a store round trip, an RPC) grows its stack
// each time it is new: on the benchmark machine that growth was a tenth of
// a busy agent's CPU when every check of a batch had a goroutine of its
// own. A Pool hands each function to an idle goroutine when there is one
// and starts a new one otherwise, so it never queues and never limits
// concurrency; a goroutine idle for the pool's idle time leaves, and all
// leave on Close.
package gopool

import (
	"sync"
	"sync/atomic"
	"time"
)

// Pool runs functions on reused goroutines; the zero value is not usable.
type Pool struct {
	work    chan func() // unbuffered: a send succeeds only into an idle goroutine
	idle    time.Duration
	stop    chan struct{}  // closed by Close
	mu      sync.Mutex     // orders Close against Go's starting of goroutines
	closed  bool           // under mu: Close was called
	running sync.WaitGroup // the pool's goroutines
	started atomic.Int64   // goroutines started, for tests
}

// New returns a pool whose goroutines leave after idle without work.
func New(idle time.Duration) *Pool {
	return &Pool{work: make(chan func()), idle: idle, stop: make(chan struct{})}
}

// Go runs f on an idle goroutine of the pool, or on a new one. Once Close
// has been called, f runs on a goroutine of its own that Close does not
// wait for (a straggler of a caller that is shutting down).
func (p *Pool) Go(f func()) {
	select {
	case p.work <- f:
		return
	default:
	}
	p.mu.Lock()
	closed := p.closed
	if !closed {
		p.started.Add(1)
		p.running.Add(1)
	}
	p.mu.Unlock()
	if closed {
		go f()
		return
	}
	go p.worker(f)
}

// Close makes idle goroutines leave at once and the busy ones when their
// function returns, and waits for all of them: a caller that needs its
// functions to end sooner must make them end (cancel their context).
func (p *Pool) Close() {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		close(p.stop)
	}
	p.mu.Unlock()
	p.running.Wait()
}

func (p *Pool) worker(f func()) {
	defer p.running.Done()
	t := time.NewTimer(p.idle)
	defer t.Stop()
	for {
		f()
		t.Reset(p.idle)
		select {
		case f = <-p.work:
		case <-t.C:
			return
		case <-p.stop:
			return
		}
	}
}
