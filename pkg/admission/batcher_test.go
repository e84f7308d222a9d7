package admission

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestBatcherGroupsConcurrentCalls: while a pipeline is in flight, calls
// accumulate and go out together; at most MaxPipelines run at once; close
// fails pending calls and waits for the rest.
func TestBatcherGroupsConcurrentCalls(t *testing.T) {
	var (
		inflight, peak atomic.Int64
		mu             sync.Mutex
		sizes          []int
		gate           = make(chan struct{})
	)
	cfg := DefaultRedisConfig()
	cfg.MaxPipelines = 2
	cfg.BatchSize = 8
	b := newBatcher(cfg, func(batch []*op) {
		n := inflight.Add(1)
		for {
			p := peak.Load()
			if n <= p || peak.CompareAndSwap(p, n) {
				break
			}
		}
		<-gate
		mu.Lock()
		sizes = append(sizes, len(batch))
		mu.Unlock()
		inflight.Add(-1)
		for _, o := range batch {
			o.out = []int64{1}
			o.finish()
		}
	})
	var wg sync.WaitGroup
	ops := make([]*op, 40)
	for i := range ops {
		ops[i] = &op{done: make(chan struct{}, 1)}
		if err := b.submit(ops[i]); err != nil {
			t.Fatal(err)
		}
	}
	close(gate)
	for _, o := range ops {
		wg.Add(1)
		go func(o *op) {
			defer wg.Done()
			<-o.done
		}(o)
	}
	wg.Wait()
	b.close()
	if peak.Load() > 2 {
		t.Fatalf("%d pipelines at once, limit 2", peak.Load())
	}
	total := 0
	for _, s := range sizes {
		if s > 8 {
			t.Fatalf("batch of %d, limit 8", s)
		}
		total += s
	}
	// The first two calls went out alone (nothing in flight); the other 38
	// waited and were batched by 8.
	if total != 40 || len(sizes) > 2+5 {
		t.Fatalf("batch sizes %v: want 40 calls in at most 7 pipelines", sizes)
	}
	if err := b.submit(&op{done: make(chan struct{}, 1)}); !errors.Is(err, ErrClosed) {
		t.Fatalf("submit after close: %v", err)
	}
}

func TestBatcherOverloadAndClose(t *testing.T) {
	cfg := DefaultRedisConfig()
	cfg.MaxPipelines = 1
	cfg.BatchSize = 1
	cfg.MaxPending = 2
	cfg.BatchDelay = time.Millisecond
	gate := make(chan struct{})
	b := newBatcher(cfg, func(batch []*op) {
		<-gate
		for _, o := range batch {
			o.finish()
		}
	})
	first := &op{done: make(chan struct{}, 1)}
	if err := b.submit(first); err != nil { // in flight, blocked
		t.Fatal(err)
	}
	p1, p2 := &op{done: make(chan struct{}, 1)}, &op{done: make(chan struct{}, 1)}
	if err := b.submit(p1); err != nil {
		t.Fatal(err)
	}
	if err := b.submit(p2); err != nil {
		t.Fatal(err)
	}
	if err := b.submit(&op{done: make(chan struct{}, 1)}); !errors.Is(err, ErrOverloaded) {
		t.Fatalf("third pending call: %v, want ErrOverloaded", err)
	}
	go func() { close(gate) }()
	b.close()
	<-first.done
	for _, o := range []*op{p1, p2} {
		select {
		case <-o.done:
		default:
			t.Fatal("a pending call was left waiting after close")
		}
	}
}

// TestRedisStoreRunRespectsContext: a caller whose context ends stops
// waiting even when the pipeline does not return.
func TestRedisStoreRunRespectsContext(t *testing.T) {
	gate := make(chan struct{})
	s := &RedisStore{cfg: DefaultRedisConfig()}
	s.batchers[0].Store(newBatcher(s.cfg, func(batch []*op) {
		<-gate
		for _, o := range batch {
			o.finish()
		}
	}))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if err := s.run(ctx, &op{}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("run: %v, want the deadline", err)
	}
	s.timers.New = func() any { return time.NewTimer(time.Hour) }
	if err := s.run(context.Background(), &op{timeout: 20 * time.Millisecond}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("run with a timeout: %v, want DeadlineExceeded", err)
	}
	close(gate)
	s.Close()
}

// TestBatcherWorkersAreReusedAndLeaveWhenIdle: batches reuse at most
// MaxPipelines worker goroutines (a goroutine per pipeline used to regrow
// its stack every time); a worker idle for idleFor leaves, and the next
// batch starts a new one; close returns with workers idle or gone.
func TestBatcherWorkersAreReusedAndLeaveWhenIdle(t *testing.T) {
	cfg := DefaultRedisConfig()
	cfg.MaxPipelines = 4
	b := newBatcher(cfg, func(batch []*op) {
		for _, o := range batch {
			o.out = []int64{1}
			o.finish()
		}
	})
	b.idleFor = 50 * time.Millisecond
	call := func() {
		t.Helper()
		o := &op{done: make(chan struct{}, 1)}
		if err := b.submit(o); err != nil {
			t.Fatal(err)
		}
		<-o.done
	}
	started := func() int {
		b.mu.Lock()
		defer b.mu.Unlock()
		return b.started
	}
	for range 200 {
		call()
	}
	// A call can come back before its worker is idle again, so the next one
	// may start a second worker; never more than MaxPipelines.
	before := started()
	if before < 1 || before > cfg.MaxPipelines {
		t.Fatalf("200 sequential calls started %d workers, want 1 to %d (reused)", before, cfg.MaxPipelines)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		b.mu.Lock()
		idle := b.idle
		b.mu.Unlock()
		if idle == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d workers still idle 5 s after the last batch, want 0 after %s", idle, b.idleFor)
		}
		time.Sleep(10 * time.Millisecond)
	}
	call()
	if n := started(); n != before+1 {
		t.Fatalf("a call after the workers left started %d workers in all, want %d", n, before+1)
	}
	// Concurrent calls: never more workers than MaxPipelines at once.
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() {
			for range 50 {
				o := &op{done: make(chan struct{}, 1)}
				if err := b.submit(o); err != nil {
					t.Error(err)
					return
				}
				<-o.done
			}
		})
	}
	wg.Wait()
	// exec answers a batch's callers before its worker counts the batch
	// done, so the last caller can be back a moment before that.
	for settle := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		b.mu.Lock()
		inflight, idle := b.inflight, b.idle
		b.mu.Unlock()
		if inflight == 0 && idle <= cfg.MaxPipelines {
			break
		}
		if time.Now().After(settle) {
			t.Errorf("5 s after the storm: %d in flight, %d idle workers (max %d)", inflight, idle, cfg.MaxPipelines)
			break
		}
	}
	done := make(chan struct{})
	go func() { b.close(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("close did not return with idle workers")
	}
	if err := b.submit(&op{done: make(chan struct{}, 1)}); !errors.Is(err, ErrClosed) {
		t.Fatalf("submit after close: %v, want ErrClosed", err)
	}
}

// TestBatcherGathersReadyCalls: a worker given a partial batch yields once
// and takes the calls submitted meanwhile into the same pipeline; while it
// gathers, those calls start no pipeline of their own although slots are
// free, and calls beyond a full batch still go out at once.
func TestBatcherGathersReadyCalls(t *testing.T) {
	cfg := DefaultRedisConfig()
	cfg.MaxPipelines, cfg.BatchSize = 4, 4
	var (
		mu    sync.Mutex
		sizes []int
	)
	b := newBatcher(cfg, func(batch []*op) {
		mu.Lock()
		sizes = append(sizes, len(batch))
		mu.Unlock()
		for _, o := range batch {
			o.finish()
		}
	})
	defer b.close()
	yielded, resume := make(chan struct{}), make(chan struct{})
	defer close(resume) // before close: a failed check must not leave the gatherer waiting
	var yields atomic.Int32
	b.yield = func() { // the first gatherer waits for the test; others go on
		if yields.Add(1) == 1 {
			yielded <- struct{}{}
			<-resume
		}
	}
	ops := make([]*op, 7)
	for i := range ops {
		ops[i] = &op{done: make(chan struct{}, 1)}
	}
	submit := func(o *op) {
		t.Helper()
		if err := b.submit(o); err != nil {
			t.Fatal(err)
		}
	}
	submit(ops[0])
	<-yielded // the first call's worker gathers
	for _, o := range ops[1:3] {
		submit(o)
	}
	b.mu.Lock()
	pending, inflight := len(b.pending), b.inflight
	b.mu.Unlock()
	if pending != 2 || inflight != 1 {
		t.Fatalf("while gathering: %d pending, %d in flight; want 2 waiting for the gatherer, 1 in flight", pending, inflight)
	}
	// Four more: one full batch's worth is waiting, so a full batch goes to
	// a pipeline of its own (and gathers nothing: it is full).
	for _, o := range ops[3:] {
		submit(o)
	}
	resume <- struct{}{}
	for _, o := range ops {
		<-o.done
	}
	mu.Lock()
	defer mu.Unlock()
	// The full batch [1..4] and the gathered one [0, 5, 6].
	if len(sizes) != 2 || sizes[0]+sizes[1] != 7 || max(sizes[0], sizes[1]) != 4 {
		t.Fatalf("pipelines carried %v calls; want a full batch of 4 and the gathered 3", sizes)
	}
}

// TestBatcherDropsAbandonedCalls: a call whose caller gave up while it
// waited to be sent is dropped, never sent, and finished with an error
// Unsent recognises, both when it is still pending and when a worker has
// taken it into a batch but not yet sent it; a call the batcher has taken
// to send can no longer be abandoned (its outcome is unknown).
func TestBatcherDropsAbandonedCalls(t *testing.T) {
	newOp := func() *op { return &op{done: make(chan struct{}, 1)} }
	t.Run("pending", func(t *testing.T) {
		cfg := DefaultRedisConfig()
		cfg.MaxPipelines, cfg.BatchSize = 1, 2
		gate := make(chan struct{})
		var (
			mu   sync.Mutex
			sent []*op
		)
		b := newBatcher(cfg, func(batch []*op) {
			<-gate
			mu.Lock()
			sent = append(sent, batch...)
			mu.Unlock()
			for _, o := range batch {
				o.finish()
			}
		})
		first := newOp()
		if err := b.submit(first); err != nil {
			t.Fatal(err)
		}
		for atomic.LoadInt32(&first.state) != opTaken { // its worker takes it to send
			time.Sleep(time.Millisecond)
		}
		if first.abandon() {
			t.Fatal("a call taken to be sent was abandoned")
		}
		gone, kept1, kept2 := newOp(), newOp(), newOp()
		for _, o := range []*op{gone, kept1, kept2} {
			if err := b.submit(o); err != nil {
				t.Fatal(err)
			}
		}
		if !gone.abandon() {
			t.Fatal("a pending call could not be abandoned")
		}
		close(gate)
		for _, o := range []*op{first, gone, kept1, kept2} {
			<-o.done
		}
		b.close()
		mu.Lock()
		defer mu.Unlock()
		if len(sent) != 3 || slices.Contains(sent, gone) {
			t.Fatalf("sent %d calls (the abandoned one among them: %v); want the 3 others", len(sent), slices.Contains(sent, gone))
		}
		if !Unsent(gone.err) || Unsent(first.err) {
			t.Fatalf("abandoned call: Unsent(%v) = %v; sent call: Unsent(%v) = %v", gone.err, Unsent(gone.err), first.err, Unsent(first.err))
		}
	})
	t.Run("taken, not yet sent", func(t *testing.T) {
		var execs atomic.Int32
		b := newBatcher(DefaultRedisConfig(), func(batch []*op) {
			execs.Add(1)
			for _, o := range batch {
				o.finish()
			}
		})
		o := newOp()
		// Its worker holds it in a partial batch and yields: the caller
		// gives up then.
		b.yield = func() {
			if !o.abandon() {
				t.Error("a call taken into a batch but not sent could not be abandoned")
			}
		}
		if err := b.submit(o); err != nil {
			t.Fatal(err)
		}
		<-o.done
		b.close()
		if execs.Load() != 0 || !Unsent(o.err) {
			t.Fatalf("%d pipelines sent, call error %v; want none sent and the call dropped unsent", execs.Load(), o.err)
		}
	})
}
