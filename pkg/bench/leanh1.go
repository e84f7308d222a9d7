package bench

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"time"

	"google.golang.org/protobuf/proto"

	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// leanH1 is a load generator for Check over Connect's unary protocol on
// HTTP/1.1 keep-alive connections, one per worker, as wrk would drive it:
// each request's bytes are prepared once, and a call is one write and the
// reads of its response. It measures the agent's Connect server without
// the CPU of Go's HTTP client (connect-go on net/http), which on this
// machine shares the cores with the server it loads.
//
// Worker w alone uses conns[w] while a mode runs, and close runs after it,
// so the calls take no lock.
type leanH1 struct {
	addr  string
	reqs  [][]byte    // the whole HTTP request per key
	conns []*leanConn // per worker; nil until dialled
}

// leanConn is one worker's connection and the buffers its calls reuse.
type leanConn struct {
	c        net.Conn
	r        *bufio.Reader
	deadline time.Time // set on c: the run's, changed only between runs
	msg      allotv1.CheckResponse
	buf      []byte
}

// newLeanH1 prepares the HTTP request of every check for workers
// connections to addr.
func newLeanH1(addr string, checks []*allotv1.CheckRequest, workers int) (*leanH1, error) {
	l := &leanH1{addr: addr, reqs: make([][]byte, len(checks)), conns: make([]*leanConn, workers)}
	for i, c := range checks {
		body, err := proto.Marshal(c)
		if err != nil {
			return nil, err
		}
		var b bytes.Buffer
		fmt.Fprintf(&b, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/proto\r\nConnect-Protocol-Version: 1\r\nContent-Length: %d\r\n\r\n",
			allotv1connect.AdmissionServiceCheckProcedure, addr, len(body))
		b.Write(body)
		l.reqs[i] = b.Bytes()
	}
	return l, nil
}

// close closes every worker's connection; the mode has finished.
func (l *leanH1) close() {
	for i, c := range l.conns {
		if c != nil {
			c.c.Close()
			l.conns[i] = nil
		}
	}
}

// conn returns worker w's connection, dialling it when needed.
func (l *leanH1) conn(ctx context.Context, w int) (*leanConn, error) {
	if c := l.conns[w]; c != nil {
		return c, nil
	}
	var d net.Dialer
	nc, err := d.DialContext(ctx, "tcp", l.addr)
	if err != nil {
		return nil, err
	}
	c := &leanConn{c: nc, r: bufio.NewReaderSize(nc, 4096)}
	l.conns[w] = c
	return c, nil
}

// drop closes worker w's connection after a failed call.
func (l *leanH1) drop(w int) {
	if c := l.conns[w]; c != nil {
		c.c.Close()
		l.conns[w] = nil
	}
}

// target returns the Target of the mode: worker w sends key i's request
// on its connection and checks that it was allowed.
func (l *leanH1) target() Target {
	return func(ctx context.Context, w int, i uint64) error {
		c, err := l.conn(ctx, w)
		if err != nil {
			return err
		}
		if dl, _ := ctx.Deadline(); !dl.Equal(c.deadline) {
			if err := c.c.SetDeadline(dl); err != nil {
				l.drop(w)
				return err
			}
			c.deadline = dl
		}
		if err := c.call(l.reqs[keyOf(w, i, len(l.reqs))]); err != nil {
			l.drop(w)
			return err
		}
		if !c.msg.Allowed {
			return refusal(&c.msg)
		}
		return nil
	}
}

var errLeanResponse = errors.New("lean HTTP/1.1 client: malformed response")

// call writes req and reads one response into c.msg.
func (c *leanConn) call(req []byte) error {
	if _, err := c.c.Write(req); err != nil {
		return err
	}
	line, err := c.r.ReadSlice('\n')
	if err != nil {
		return err
	}
	if len(line) < 12 || !bytes.HasPrefix(line, []byte("HTTP/1.1 ")) {
		return errLeanResponse
	}
	status := string(line[9:12])
	length := -1
	for {
		h, err := c.r.ReadSlice('\n')
		if err != nil {
			return err
		}
		h = bytes.TrimRight(h, "\r\n")
		if len(h) == 0 {
			break
		}
		if k, v, ok := bytes.Cut(h, []byte(":")); ok && bytes.EqualFold(k, []byte("Content-Length")) {
			n, err := strconv.Atoi(string(bytes.TrimSpace(v)))
			if err != nil {
				return errLeanResponse
			}
			length = n
		}
	}
	if length < 0 {
		return fmt.Errorf("%w: no Content-Length (status %s)", errLeanResponse, status)
	}
	if cap(c.buf) < length {
		c.buf = make([]byte, length)
	}
	body := c.buf[:length]
	if _, err := io.ReadFull(c.r, body); err != nil {
		return err
	}
	if status != "200" {
		return fmt.Errorf("status %s: %s", status, body)
	}
	c.msg.Reset()
	return proto.Unmarshal(body, &c.msg)
}
