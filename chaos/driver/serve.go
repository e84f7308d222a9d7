package driver

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/pkg/allocator"
)

// Serve runs a driver process: it reads its Config from configPath, dials
// the suite's control socket ctlPath, says hello, streams events, and obeys
// commands until the suite says stop (or ctx ends, or the suite goes away).
func Serve(ctx context.Context, configPath, ctlPath string) error {
	b, err := os.ReadFile(configPath)
	if err != nil {
		return err
	}
	var cfg Config
	if err := json.Unmarshal(b, &cfg); err != nil {
		return fmt.Errorf("config %s: %w", configPath, err)
	}
	conn, err := net.Dial("unix", ctlPath)
	if err != nil {
		return err
	}
	defer conn.Close()
	out := newWire(conn)
	defer out.close()
	if err := out.send(history.Message{Hello: cfg.Region}); err != nil {
		return err
	}
	client, err := allocator.NewClient(cfg.Endpoints, allocator.WithHTTPClient(NewHTTPClient()),
		allocator.WithAttempts(4), allocator.WithBackoff(50*time.Millisecond))
	if err != nil {
		return err
	}
	d, err := New(cfg, history.TrueClock{Offset: cfg.ClockOffset}, client, func(ev history.Event) {
		_ = out.send(history.Message{Event: &ev})
	})
	if err != nil {
		return err
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	runErr := make(chan error, 1)
	go func() { runErr <- d.Run(runCtx) }()

	dec := json.NewDecoder(bufio.NewReader(conn))
	for {
		var m history.Message
		if err := dec.Decode(&m); err != nil {
			cancel() // the suite is gone: stop at once
			return errors.Join(<-runErr, fmt.Errorf("control socket: %w", err))
		}
		if m.Command == nil {
			continue
		}
		c := m.Command
		var cerr error
		cctx, ccancel := context.WithTimeout(ctx, 30*time.Second)
		switch c.Op {
		case history.OpDemand:
			cerr = d.SetDemand(cctx, c.Quota, c.Rate)
		case history.OpSkew:
			d.SetSkew(time.Duration(c.Skew))
		case history.OpStorm:
			cerr = d.Storm(cctx, c.N)
		case history.OpStop:
			cerr = d.Stop(cctx)
		default:
			cerr = fmt.Errorf("unknown op %q", c.Op)
		}
		ccancel()
		ack := &history.Ack{Seq: c.Seq}
		if cerr != nil {
			ack.Err = cerr.Error()
		}
		if c.Op == history.OpStop {
			cancel()
			err := <-runErr
			out.flush()
			_ = out.send(history.Message{Ack: ack})
			out.flush()
			return err
		}
		if err := out.send(history.Message{Ack: ack}); err != nil {
			return err
		}
	}
}

// wire writes JSON lines, buffered and flushed every 20ms.
type wire struct {
	mu   sync.Mutex
	w    *bufio.Writer
	enc  *json.Encoder
	err  error
	stop chan struct{}
	done chan struct{}
}

func newWire(c net.Conn) *wire {
	w := &wire{w: bufio.NewWriterSize(c, 64<<10), stop: make(chan struct{}), done: make(chan struct{})}
	w.enc = json.NewEncoder(w.w)
	go func() {
		defer close(w.done)
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-w.stop:
				return
			case <-t.C:
				w.flush()
			}
		}
	}()
	return w
}

func (w *wire) send(m history.Message) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.err == nil {
		w.err = w.enc.Encode(m)
	}
	return w.err
}

func (w *wire) flush() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.err == nil {
		w.err = w.w.Flush()
	}
}

func (w *wire) close() {
	close(w.stop)
	<-w.done
	w.flush()
}
