package history

import (
	"bufio"
	"encoding/json"
	"io"
	"sync"
	"time"
)

// Wire writes Messages as JSON lines to a region process's control
// connection, buffered and flushed every 20 ms (and by Flush and Close), so
// thousands of events a second cost a few writes. It is safe for concurrent
// use; after the first write error it drops everything and Send returns
// that error.
type Wire struct {
	mu   sync.Mutex
	w    *bufio.Writer
	enc  *json.Encoder
	err  error
	stop chan struct{}
	done chan struct{}
}

// NewWire starts a Wire on w; Close stops its flusher.
func NewWire(w io.Writer) *Wire {
	wr := &Wire{w: bufio.NewWriterSize(w, 64<<10), stop: make(chan struct{}), done: make(chan struct{})}
	wr.enc = json.NewEncoder(wr.w)
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

// Send buffers m.
func (w *Wire) Send(m Message) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.err == nil {
		w.err = w.enc.Encode(m)
	}
	return w.err
}

// Flush writes what is buffered.
func (w *Wire) Flush() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.err == nil {
		w.err = w.w.Flush()
	}
}

// Close stops the flusher and flushes once more. Call it once.
func (w *Wire) Close() {
	close(w.stop)
	<-w.done
	w.Flush()
}
