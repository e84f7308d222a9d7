package admission

import (
	"fmt"
	"runtime"
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
// A caller that stops waiting (its timeout or its context) before its call
// is sent abandons it (op.abandon), and the batcher drops it unsent
// (op.claim decides, with one CAS, which of the two got there first): a
// request already answered by its fail mode is not also charged when the
// store comes back, and a backlog of such calls is not replayed into a
// store that has just recovered.
//
// A worker given a partial batch first yields the processor once
// (runtime.Gosched) and then tops the batch up from the calls that came
// meanwhile; while it gathers, new calls start no other pipeline. Callers
// that are ready to run at the same moment (woken together by the network
// or by timers) so share one round trip instead of each taking a pipeline
// slot of its own, without waiting on a timer. Measured at half of the
// benchmark's maximum rate: the median fell by a third and Redis's reads
// by ~8% (ready callers are few there: pipelines carry ~1.2 calls), the
// tail did not move; at the maximum rate batches are full and never yield.
//
// Pipelines run on at most MaxPipelines worker goroutines, started on
// demand: a worker takes the next batch itself when calls wait, and
// otherwise waits up to workerIdle for one. (A goroutine per pipeline grew
// its stack through go-redis's pipeline code every time: 9% of a busy
// client's CPU.) close stops them and waits for all of them.
type batcher struct {
	cfg  RedisConfig
	exec func([]*op)
	work chan []*op // batches for idle workers; never more than idle
	// idleFor is how long a worker waits for a batch (workerIdle).
	idleFor time.Duration
	// yield lets the callers that are ready to run submit before a partial
	// batch is topped up and sent (runtime.Gosched; tests replace it).
	yield func()

	mu        sync.Mutex
	pending   []*op
	inflight  int
	gathering int     // partial batches handed out and not yet topped up
	spare     [][]*op // sent batches' lists, empty, for the next batches
	idle      int     // workers waiting on work
	started   int     // workers started so far, for tests
	timer     *time.Timer
	armed     bool
	closed    bool
	wg        sync.WaitGroup
}

func newBatcher(cfg RedisConfig, exec func([]*op)) *batcher {
	return &batcher{cfg: cfg, exec: exec, work: make(chan []*op, cfg.MaxPipelines), idleFor: workerIdle, yield: runtime.Gosched}
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
	for {
		batch := b.nextLocked(force)
		if batch == nil {
			return
		}
		if b.idle > 0 {
			b.idle--
			b.work <- batch // buffered for every idle worker: never blocks
			continue
		}
		b.wg.Add(1)
		b.started++
		go b.worker(batch)
	}
}

// nextLocked takes the next batch to send and counts it in flight, or
// returns nil when none may go now (arming the timer for a partial batch
// that waits).
//
// A partial batch is counted as gathering until its worker tops it up
// (gather); meanwhile calls wait for it rather than start pipelines.
func (b *batcher) nextLocked(force bool) []*op {
	if len(b.pending) == 0 || b.inflight >= b.cfg.MaxPipelines {
		return nil
	}
	if !force && b.gathering > 0 && len(b.pending) < b.cfg.BatchSize {
		return nil // the gathering worker takes them
	}
	if !force && b.inflight > 0 && len(b.pending) < b.cfg.BatchSize && b.cfg.BatchDelay > 0 {
		b.armLocked()
		return nil
	}
	var list []*op
	if n := len(b.spare); n > 0 {
		list, b.spare = b.spare[n-1], b.spare[:n-1]
	} else {
		list = make([]*op, 0, b.cfg.BatchSize)
	}
	batch := b.takeLocked(list)
	if len(batch) == 0 { // every pending call was abandoned
		b.spare = append(b.spare, batch)
		return nil
	}
	if len(batch) < b.cfg.BatchSize {
		b.gathering++
	}
	b.inflight++
	return batch
}

// takeLocked moves pending calls to batch until it holds BatchSize. Calls
// their callers abandoned are dropped on the way and take no room.
func (b *batcher) takeLocked(batch []*op) []*op {
	n := 0
	for ; n < len(b.pending) && len(batch) < b.cfg.BatchSize; n++ {
		if o := b.pending[n]; o.abandoned() {
			o.drop()
		} else {
			batch = append(batch, o)
		}
	}
	rest := copy(b.pending, b.pending[n:])
	clear(b.pending[rest:])
	b.pending = b.pending[:rest]
	return batch
}

// claim takes the calls of batch for sending and returns them; the calls
// whose callers gave up before (after they were taken from pending) are
// dropped: finished with errDropped, never sent. A caller that gives up
// after this may see its call applied: that is the unknown outcome of a
// timeout.
func claim(batch []*op) []*op {
	live := batch[:0]
	for _, o := range batch {
		if o.claim() {
			live = append(live, o)
		} else {
			o.drop()
		}
	}
	clear(batch[len(live):])
	return live
}

// gather tops up a partial batch with the calls submitted while its worker
// yielded, and sends on the calls that do not fit.
func (b *batcher) gather(batch []*op) []*op {
	b.yield()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.gathering--
	if !b.closed {
		batch = b.takeLocked(batch)
		b.dispatchLocked(false)
	}
	return batch
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

// workerIdle is how long a worker waits for a batch before it leaves.
const workerIdle = 500 * time.Millisecond

// worker sends batch, then the batches that wait, then waits for more
// until the batcher closes or it has been idle for workerIdle.
func (b *batcher) worker(batch []*op) {
	defer b.wg.Done()
	var idle *time.Timer
	for {
		if len(batch) < b.cfg.BatchSize {
			batch = b.gather(batch)
		}
		if batch = claim(batch); len(batch) > 0 {
			b.exec(batch)
		}
		clear(batch) // the calls are answered: drop them
		b.mu.Lock()
		b.inflight--
		b.spare = append(b.spare, batch[:0])
		batch = nil
		if !b.closed {
			batch = b.nextLocked(false)
			b.dispatchLocked(false) // slots still free
		}
		if batch == nil {
			if b.closed {
				b.mu.Unlock()
				return
			}
			b.idle++
			b.mu.Unlock()
			if batch = b.wait(&idle); batch == nil {
				return
			}
			continue
		}
		b.mu.Unlock()
	}
}

// wait returns the next batch handed to this idle worker, or nil when the
// batcher closes or when it has been idle for idleFor (the worker then
// leaves; a later batch starts a new one).
func (b *batcher) wait(idle **time.Timer) []*op {
	if *idle == nil {
		*idle = time.NewTimer(b.idleFor)
	} else {
		(*idle).Reset(b.idleFor)
	}
	select {
	case batch, ok := <-b.work:
		(*idle).Stop()
		if !ok {
			return nil
		}
		return batch
	case <-(*idle).C:
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.idle > 0 {
		b.idle-- // no batch is meant for this worker: leave
		return nil
	}
	// Every waiting worker, this one included, has a batch in work (or work
	// is closed): take this one's.
	batch, ok := <-b.work
	if !ok {
		return nil
	}
	return batch
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
		o.finish()
	}
	b.pending = nil
	if b.armed && b.timer.Stop() {
		b.armed = false
		b.wg.Done()
	}
	close(b.work) // idle workers return; busy ones see closed
	b.mu.Unlock()
	b.wg.Wait()
}
