package history

import (
	"bytes"
	"encoding/json"
	"io"
	"sync"
	"time"
)

// Wire writes Messages as JSON lines to a region process's control
// connection. Send only queues: a writer goroutine writes what is queued
// every 20 ms (and Flush and Close do at once), so thousands of events a
// second cost a few writes, and a suite that reads late (its process
// stalled) never blocks the process that sends: the load generators keep
// their pace and their events wait in memory, in order. It is safe for
// concurrent use; after the first write error it drops everything and
// Send returns that error.
type Wire struct {
	out io.Writer

	mu      sync.Mutex // guards pending and err
	pending *bytes.Buffer
	err     error

	wmu   sync.Mutex    // held while writing: one batch at a time, in queue order
	spare *bytes.Buffer // the batch buffer written last, reused; guarded by wmu

	stop chan struct{}
	done chan struct{}
}

// NewWire starts a Wire on w; Close stops its writer.
func NewWire(w io.Writer) *Wire {
	wr := &Wire{out: w, pending: new(bytes.Buffer), spare: new(bytes.Buffer), stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(wr.done)
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-wr.stop:
				return
			case <-t.C:
				wr.Flush()
			}
		}
	}()
	return wr
}

// Send queues m; it does not wait for the connection. m is encoded before
// the lock is taken, so concurrent senders wait only for the append.
func (w *Wire) Send(m Message) error {
	b, err := json.Marshal(m)
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.err == nil {
		w.err = err
	}
	if w.err == nil {
		w.pending.Write(b)
		w.pending.WriteByte('\n')
	}
	return w.err
}

// Flush writes everything queued before it was called, and returns once
// written.
func (w *Wire) Flush() {
	w.wmu.Lock()
	defer w.wmu.Unlock()
	w.mu.Lock()
	batch := w.pending
	w.pending, w.spare = w.spare, nil
	failed := w.err != nil
	w.mu.Unlock()
	var err error
	if !failed && batch.Len() > 0 {
		_, err = w.out.Write(batch.Bytes())
	}
	batch.Reset()
	w.spare = batch
	if err != nil {
		w.mu.Lock()
		if w.err == nil {
			w.err = err
		}
		w.mu.Unlock()
	}
}

// Close stops the writer and flushes once more. Call it once.
func (w *Wire) Close() {
	close(w.stop)
	<-w.done
	w.Flush()
}
