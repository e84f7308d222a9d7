package history

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
)

// ServeCommands is the process side of the control socket shared by the
// region driver and the load generator: it runs run in the background,
// reads commands from conn, answers each with handle's error as an Ack on
// out, and on OpStop calls stop, ends run and acknowledges last (after
// every event is flushed). It returns when the suite says stop, ctx ends
// or the suite goes away.
func ServeCommands(ctx context.Context, conn io.Reader, out *Wire, run func(context.Context) error,
	handle func(context.Context, *Command) error, stop func(context.Context) error) error {
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	runErr := make(chan error, 1)
	go func() { runErr <- run(runCtx) }()

	dec := json.NewDecoder(bufio.NewReader(conn))
	for {
		var m Message
		if err := dec.Decode(&m); err != nil {
			cancel() // the suite is gone: stop at once
			return errors.Join(<-runErr, fmt.Errorf("control socket: %w", err))
		}
		if m.Command == nil {
			continue
		}
		c := m.Command
		ack := &Ack{Seq: c.Seq}
		if c.Op == OpStop {
			if err := stop(ctx); err != nil {
				ack.Err = err.Error()
			}
			cancel()
			err := <-runErr
			out.Flush() // the events before the ack
			_ = out.Send(Message{Ack: ack})
			out.Flush()
			return err
		}
		if err := handle(ctx, c); err != nil {
			ack.Err = err.Error()
		}
		if err := out.Send(Message{Ack: ack}); err != nil {
			cancel()
			return errors.Join(<-runErr, err)
		}
	}
}

// ReadConfig reads a process's JSON config file into cfg.
func ReadConfig(path string, cfg any) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, cfg); err != nil {
		return fmt.Errorf("config %s: %w", path, err)
	}
	return nil
}

// DialControl dials the suite's control socket ctlPath and says hello as
// name. The caller closes the wire, then the connection.
func DialControl(ctlPath, name string) (net.Conn, *Wire, error) {
	conn, err := net.Dial("unix", ctlPath)
	if err != nil {
		return nil, nil, err
	}
	out := NewWire(conn)
	if err := out.Send(Message{Hello: name}); err != nil {
		out.Close()
		conn.Close()
		return nil, nil, err
	}
	return conn, out, nil
}
