package admission

import (
	"fmt"
	"sync"
	"time"
)

// batcher groups concurrent store calls into pipelines. A call is sent at
// once when no pipeline is in flight (no added latency when idle). While
// pipelines are in flight, calls accumulate and are sent when BatchSize are
// pending, when a pipeline slot frees up, or after BatchDelay, whichever
// comes first; at most MaxPipelines are in flight. This is how the SDK
// approaches the throughput of a hand-pipelined client while each caller
// still waits only for its own decision.
//
// Each pipeline runs on a goroutine of its own; close waits for all of them.
type batcher struct {
	cfg  RedisConfig
	exec func([]*op)

	mu       sync.Mutex
	pending  []*op
	inflight int
	timer    *time.Timer
	armed    bool
	closed   bool
	wg       sync.WaitGroup
}

func newBatcher(cfg RedisConfig, exec func([]*op)) *batcher {
	return &batcher{cfg: cfg, exec: exec}
}

// submit queues o; the batcher closes o.done when it has a result.
func (b *batcher) submit(o *op) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case b.closed:
		return ErrClosed
	case len(b.pending) >= b.cfg.MaxPending:
		return fmt.Errorf("%w: %d calls pending", ErrOverloaded, len(b.pending))
	}
	b.pending = append(b.pending, o)
	b.dispatchLocked(false)
	return nil
}

// dispatchLocked starts pipelines while slots are free and calls wait.
// Unless force is set, a partial batch waits for BatchDelay when other
// pipelines are in flight.
func (b *batcher) dispatchLocked(force bool) {
	for len(b.pending) > 0 && b.inflight < b.cfg.MaxPipelines {
		if !force && b.inflight > 0 && len(b.pending) < b.cfg.BatchSize && b.cfg.BatchDelay > 0 {
			b.armLocked()
			return
		}
		n := min(len(b.pending), b.cfg.BatchSize)
		batch := make([]*op, n)
		copy(batch, b.pending)
		rest := copy(b.pending, b.pending[n:])
		clear(b.pending[rest:])
		b.pending = b.pending[:rest]
		b.inflight++
		b.wg.Add(1)
		go b.run(batch)
	}
}

func (b *batcher) armLocked() {
	if b.armed {
		return
	}
	b.armed = true
	b.wg.Add(1)
	if b.timer == nil {
		b.timer = time.AfterFunc(b.cfg.BatchDelay, b.fire)
		return
	}
	b.timer.Reset(b.cfg.BatchDelay)
}

func (b *batcher) fire() {
	defer b.wg.Done()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.armed = false
	if !b.closed {
		b.dispatchLocked(true)
	}
}

func (b *batcher) run(batch []*op) {
	defer b.wg.Done()
	b.exec(batch)
	b.mu.Lock()
	b.inflight--
	if !b.closed {
		b.dispatchLocked(false)
	}
	b.mu.Unlock()
}

// close fails the pending calls and waits for the pipelines in flight.
func (b *batcher) close() {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		b.wg.Wait()
		return
	}
	b.closed = true
	for _, o := range b.pending {
		o.err = ErrClosed
		close(o.done)
	}
	b.pending = nil
	if b.armed && b.timer.Stop() {
		b.armed = false
		b.wg.Done()
	}
	b.mu.Unlock()
	b.wg.Wait()
}
