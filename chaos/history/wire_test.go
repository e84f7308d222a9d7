package history

import (
	"bufio"
	"encoding/json"
	"net"
	"testing"
	"time"
)

// TestWireSendDoesNotWaitForTheReader: a reader that stops reading (the
// suite's process stalled) does not block the sender, however much it
// sends; once the reader reads again every message arrives, in order. On
// a synchronous pipe the unread bytes have nowhere to go but the Wire's
// queue: a Wire that wrote from Send would block after its buffer.
func TestWireSendDoesNotWaitForTheReader(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	w := NewWire(a)
	const n = 20000 // ~1 MB of JSON lines
	sent := make(chan error, 1)
	go func() {
		for i := range n {
			if err := w.Send(Message{Command: &Command{Seq: int64(i), Op: "x"}}); err != nil {
				sent <- err
				return
			}
		}
		sent <- nil
	}()
	select {
	case err := <-sent:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Send blocked on a reader that does not read")
	}
	got := make(chan error, 1)
	go func() {
		dec := json.NewDecoder(bufio.NewReader(b))
		for i := range n {
			var m Message
			if err := dec.Decode(&m); err != nil {
				got <- err
				return
			}
			if m.Command == nil || m.Command.Seq != int64(i) {
				t.Errorf("message %d: %+v", i, m.Command)
				got <- nil
				return
			}
		}
		got <- nil
	}()
	w.Close() // writes the rest
	if err := <-got; err != nil {
		t.Fatal(err)
	}
}

// TestWireKeepsTheFirstWriteError: after the connection fails, Send
// returns the error and drops the message.
func TestWireKeepsTheFirstWriteError(t *testing.T) {
	a, b := net.Pipe()
	b.Close()
	w := NewWire(a)
	defer w.Close()
	if err := w.Send(Message{Hello: "eu"}); err != nil {
		t.Fatalf("first Send: %v (it only queues)", err)
	}
	w.Flush()
	if err := w.Send(Message{Hello: "eu"}); err == nil {
		t.Fatal("Send after a failed write returned nil")
	}
}
