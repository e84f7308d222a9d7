package gopool

import (
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestRunsEveryFunctionAndReusesGoroutines: every function runs, none
// waits for another (Go never queues), idle goroutines take later work
// instead of new ones being started, and they leave when idle.
func TestRunsEveryFunctionAndReusesGoroutines(t *testing.T) {
	base := runtime.NumGoroutine()
	p := New(200 * time.Millisecond)

	// 50 functions that block together: each needs a goroutine of its own.
	var started sync.WaitGroup
	started.Add(50)
	release := make(chan struct{})
	var done sync.WaitGroup
	done.Add(50)
	for range 50 {
		p.Go(func() {
			started.Done()
			<-release
			done.Done()
		})
	}
	started.Wait() // fails by timeout if any function waits for another
	close(release)
	done.Wait()

	// Now idle (given a moment to get back to waiting): 50 more, one
	// after another, run on those goroutines.
	time.Sleep(100 * time.Millisecond)
	before := p.started.Load()
	var ran atomic.Int32
	for range 50 {
		var one sync.WaitGroup
		one.Add(1)
		p.Go(func() { ran.Add(1); one.Done() })
		one.Wait()
	}
	if ran.Load() != 50 || before != 50 || p.started.Load() != before {
		t.Fatalf("ran %d of 50 on %d new goroutines (%d for the first 50), want 0 new", ran.Load(), p.started.Load()-before, before)
	}

	deadline := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > base {
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines still running, %d before the pool", runtime.NumGoroutine(), base)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestCloseEndsEveryGoroutine: Close returns once the busy goroutines have
// finished their functions and the idle ones have left, long before the
// idle time.
func TestCloseEndsEveryGoroutine(t *testing.T) {
	base := runtime.NumGoroutine()
	p := New(time.Hour)
	release := make(chan struct{})
	var started sync.WaitGroup
	started.Add(10)
	for range 10 {
		p.Go(func() { started.Done(); <-release })
	}
	started.Wait()
	closed := make(chan struct{})
	go func() { p.Close(); close(closed) }()
	select {
	case <-closed:
		t.Fatal("Close returned while functions were still running")
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	<-closed
	if n := runtime.NumGoroutine(); n > base {
		t.Fatalf("%d goroutines after Close, %d before the pool", n, base)
	}
}

// TestGoAfterCloseRuns: a function handed to a closed pool still runs (on a
// goroutine Close does not wait for) and nothing panics, also when Go
// races Close; Close can be called twice.
func TestGoAfterCloseRuns(t *testing.T) {
	for range 100 {
		p := New(time.Hour)
		var ran sync.WaitGroup
		ran.Add(20)
		go func() {
			for range 10 {
				p.Go(ran.Done)
			}
		}()
		p.Close()
		for range 10 {
			p.Go(ran.Done)
		}
		p.Close()
		ran.Wait() // fails by timeout if a function never runs
	}
}
