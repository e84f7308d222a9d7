package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// leanH2 is a load generator for unary RPCs over cleartext HTTP/2, as h2load
// or Envoy's own gRPC client drive a server: the header block and the body of
// every request are prepared once, the workers multiplex their calls on a
// few connections, one goroutine per connection reads the responses, and the
// requests written while a flush is pending leave in one write. It measures
// the agent's HTTP/2 servers (the Connect handler on h2c, grpc-go's for
// Envoy's RLS) without the CPU of Go's RPC clients, which on this machine
// share the cores with the server they load.
type leanH2 struct {
	addr   string
	grpc   bool     // gRPC: 5-byte message prefix, status in trailers; else Connect unary
	block  []byte   // the HPACK block of every request
	bodies [][]byte // per key: the request's DATA payload
	check  func(w int, msg []byte) error

	dial  sync.Mutex               // serialises dialling and close
	conns []atomic.Pointer[h2Conn] // worker w uses conns[w%len]; nil until dialled
	calls []*h2Call                // per worker, reused
}

// newLeanH2 prepares requests for path on addr: msgs are the marshalled
// request messages, check judges one response message for worker w.
func newLeanH2(addr, path string, grpc bool, msgs [][]byte, workers, conns int, check func(w int, msg []byte) error) *leanH2 {
	fields := []hpack.HeaderField{
		{Name: ":method", Value: "POST"},
		{Name: ":scheme", Value: "http"},
		{Name: ":authority", Value: addr},
		{Name: ":path", Value: path},
	}
	if grpc {
		fields = append(fields, hpack.HeaderField{Name: "content-type", Value: "application/grpc"}, hpack.HeaderField{Name: "te", Value: "trailers"})
	} else {
		fields = append(fields, hpack.HeaderField{Name: "content-type", Value: "application/proto"}, hpack.HeaderField{Name: "connect-protocol-version", Value: "1"})
	}
	// Fields marked sensitive are never indexed, so the encoder's dynamic
	// table stays empty and the same block is valid on every stream.
	var block bytes.Buffer
	enc := hpack.NewEncoder(&block)
	for _, f := range fields {
		f.Sensitive = true
		_ = enc.WriteField(f) // writes to a bytes.Buffer cannot fail
	}
	l := &leanH2{addr: addr, grpc: grpc, block: block.Bytes(), bodies: make([][]byte, len(msgs)), check: check,
		conns: make([]atomic.Pointer[h2Conn], conns), calls: make([]*h2Call, workers)}
	for i, m := range msgs {
		if grpc {
			b := make([]byte, 5, 5+len(m))
			binary.BigEndian.PutUint32(b[1:], uint32(len(m)))
			m = append(b, m...)
		}
		l.bodies[i] = m
	}
	for w := range l.calls {
		l.calls[w] = &h2Call{done: make(chan struct{}, 1)}
	}
	return l
}

// close closes every connection; the mode has finished.
func (l *leanH2) close() {
	l.dial.Lock()
	defer l.dial.Unlock()
	for i := range l.conns {
		if c := l.conns[i].Swap(nil); c != nil {
			c.close(errors.New("lean HTTP/2 client closed"))
		}
	}
}

// conn returns the live connection worker w uses, dialling it when needed.
// A call takes no lock unless the connection must be dialled.
func (l *leanH2) conn(ctx context.Context, w int) (*h2Conn, error) {
	slot := &l.conns[w%len(l.conns)]
	if c := slot.Load(); c != nil && !c.failed() {
		return c, nil
	}
	l.dial.Lock()
	defer l.dial.Unlock()
	if c := slot.Load(); c != nil && !c.failed() {
		return c, nil // another worker dialled it meanwhile
	}
	c, err := dialH2(ctx, l.addr)
	if err != nil {
		return nil, err
	}
	slot.Store(c)
	return c, nil
}

// target returns the Target of the mode: worker w sends key i's request
// and checks the response.
func (l *leanH2) target() Target {
	return func(ctx context.Context, w int, i uint64) error {
		c, err := l.conn(ctx, w)
		if err != nil {
			return err
		}
		call := l.calls[w]
		if err := c.roundTrip(ctx, call, l.block, l.bodies[keyOf(w, i, len(l.bodies))]); err != nil {
			return err
		}
		return l.judge(w, call)
	}
}

var errLeanH2 = errors.New("lean HTTP/2 client: malformed response")

// judge turns a finished call's status and body into the check's verdict.
func (l *leanH2) judge(w int, call *h2Call) error {
	if call.status != "200" {
		return fmt.Errorf("status %s: %s", call.status, call.body)
	}
	if !l.grpc {
		return l.check(w, call.body)
	}
	if call.grpcStatus != "0" {
		return fmt.Errorf("grpc-status %s: %s", call.grpcStatus, call.grpcMessage)
	}
	b := call.body
	if len(b) < 5 || b[0] != 0 || int(binary.BigEndian.Uint32(b[1:5])) != len(b)-5 {
		return fmt.Errorf("%w: not one uncompressed gRPC message (%d bytes)", errLeanH2, len(b))
	}
	return l.check(w, b[5:])
}

// h2Call is one worker's call in flight; a worker reuses its own.
type h2Call struct {
	done        chan struct{} // receives once the call finished
	status      string        // :status
	grpcStatus  string
	grpcMessage string
	body        []byte
	err         error
}

// h2Conn is one HTTP/2 connection shared by the workers.
type h2Conn struct {
	nc net.Conn
	fr *http2.Framer

	wmu     sync.Mutex // guards the framer's writes, bw, nextID and sendWin
	bw      *bufio.Writer
	nextID  uint32
	sendWin int64 // connection-level bytes of DATA the server accepts
	winUp   *sync.Cond
	flush   chan struct{} // asks the flusher to flush bw

	pmu     sync.Mutex // guards pending and err
	pending map[uint32]*h2Call
	err     error
	dead    chan struct{} // closed when the connection failed
}

// Flow control: the server may send this much before it waits for our
// WINDOW_UPDATE (per stream and for the connection); responses are small.
const (
	h2RecvWindow = 1 << 24
	h2MaxStream  = 1<<31 - 1
)

func dialH2(ctx context.Context, addr string) (*h2Conn, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	c := &h2Conn{nc: nc, bw: bufio.NewWriterSize(nc, 32<<10), nextID: 1, sendWin: 65535,
		flush: make(chan struct{}, 1), pending: map[uint32]*h2Call{}, dead: make(chan struct{})}
	c.winUp = sync.NewCond(&c.wmu)
	c.fr = http2.NewFramer(c.bw, bufio.NewReaderSize(nc, 32<<10))
	c.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	if _, err := c.bw.WriteString(http2.ClientPreface); err != nil {
		nc.Close()
		return nil, err
	}
	err = c.fr.WriteSettings(http2.Setting{ID: http2.SettingEnablePush, Val: 0},
		http2.Setting{ID: http2.SettingInitialWindowSize, Val: h2RecvWindow})
	if err == nil {
		err = c.fr.WriteWindowUpdate(0, h2RecvWindow)
	}
	if err == nil {
		err = c.bw.Flush()
	}
	if err != nil {
		nc.Close()
		return nil, err
	}
	go c.readLoop()
	go c.flushLoop()
	return c, nil
}

func (c *h2Conn) failed() bool {
	select {
	case <-c.dead:
		return true
	default:
		return false
	}
}

// close fails the connection and every call on it with err (once).
func (c *h2Conn) close(err error) {
	c.pmu.Lock()
	if c.err != nil {
		c.pmu.Unlock()
		return
	}
	c.err = err
	for id, call := range c.pending {
		call.err = err
		call.done <- struct{}{}
		delete(c.pending, id)
	}
	close(c.dead)
	c.pmu.Unlock()
	c.nc.Close()
	c.wmu.Lock()
	c.winUp.Broadcast()
	c.wmu.Unlock()
}

// roundTrip sends one request on a new stream and waits for its response.
func (c *h2Conn) roundTrip(ctx context.Context, call *h2Call, block, body []byte) error {
	call.status, call.grpcStatus, call.grpcMessage, call.body, call.err = "", "", "", call.body[:0], nil
	id, err := c.send(call, block, body)
	if err != nil {
		return err
	}
	select {
	case <-call.done:
		return call.err
	case <-ctx.Done():
		c.pmu.Lock()
		mine := c.pending[id] == call
		delete(c.pending, id)
		c.pmu.Unlock()
		if !mine {
			<-call.done // it finished meanwhile: drain it for the next call
		}
		return ctx.Err()
	}
}

// send writes the request's frames; the flusher sends them with whatever
// other workers wrote meanwhile.
func (c *h2Conn) send(call *h2Call, block, body []byte) (uint32, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	for c.sendWin < int64(len(body)) && !c.failed() {
		if err := c.bw.Flush(); err != nil {
			return 0, err
		}
		c.winUp.Wait()
	}
	if c.failed() || c.nextID > h2MaxStream-2 {
		return 0, fmt.Errorf("lean HTTP/2 client: connection unusable (%v)", c.cause())
	}
	id := c.nextID
	c.nextID += 2
	c.pmu.Lock()
	c.pending[id] = call
	c.pmu.Unlock()
	err := c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: block, EndHeaders: true})
	if err == nil {
		err = c.fr.WriteData(id, true, body)
	}
	if err != nil {
		c.pmu.Lock()
		delete(c.pending, id)
		c.pmu.Unlock()
		go c.close(err) // it takes wmu, which this call holds
		return 0, err
	}
	c.sendWin -= int64(len(body))
	select {
	case c.flush <- struct{}{}:
	default: // a flush is already due
	}
	return id, nil
}

func (c *h2Conn) cause() error {
	c.pmu.Lock()
	defer c.pmu.Unlock()
	if c.err == nil && c.nextID > h2MaxStream-2 {
		return errors.New("stream ids used up")
	}
	return c.err
}

func (c *h2Conn) flushLoop() {
	for {
		select {
		case <-c.dead:
			return
		case <-c.flush:
		}
		c.wmu.Lock()
		err := c.bw.Flush()
		c.wmu.Unlock()
		if err != nil {
			c.close(err)
			return
		}
	}
}

// write runs one control frame write and asks for a flush.
func (c *h2Conn) write(f func() error) {
	c.wmu.Lock()
	err := f()
	c.wmu.Unlock()
	if err != nil {
		c.close(err)
		return
	}
	select {
	case c.flush <- struct{}{}:
	default:
	}
}

// finish completes stream id's call, if a worker still waits for it.
func (c *h2Conn) finish(id uint32, err error) {
	c.pmu.Lock()
	call := c.pending[id]
	delete(c.pending, id)
	c.pmu.Unlock()
	if call != nil {
		call.err = err
		call.done <- struct{}{}
	}
}

// update applies f to stream id's call while it is pending. The call's
// fields change only under pmu until it finishes, so a worker that stopped
// waiting (and deleted it) can reuse the call at once.
func (c *h2Conn) update(id uint32, f func(*h2Call)) {
	c.pmu.Lock()
	defer c.pmu.Unlock()
	if call := c.pending[id]; call != nil {
		f(call)
	}
}

// readLoop reads frames until the connection fails: responses go to their
// calls, the server's settings and pings are acknowledged, window updates
// let more requests go, and received data is credited back.
func (c *h2Conn) readLoop() {
	var unacked int64 // DATA bytes received since the last connection WINDOW_UPDATE
	for {
		f, err := c.fr.ReadFrame()
		if err != nil {
			c.close(err)
			return
		}
		switch f := f.(type) {
		case *http2.MetaHeadersFrame:
			c.update(f.StreamID, func(call *h2Call) {
				for _, hf := range f.Fields {
					switch hf.Name {
					case ":status":
						call.status = hf.Value
					case "grpc-status":
						call.grpcStatus = hf.Value
					case "grpc-message":
						call.grpcMessage = hf.Value
					}
				}
			})
			if f.StreamEnded() {
				c.finish(f.StreamID, nil)
			}
		case *http2.DataFrame:
			c.update(f.StreamID, func(call *h2Call) { call.body = append(call.body, f.Data()...) })
			if unacked += int64(f.Length); unacked >= h2RecvWindow/2 {
				n := uint32(unacked)
				unacked = 0
				c.write(func() error { return c.fr.WriteWindowUpdate(0, n) })
			}
			if f.StreamEnded() {
				c.finish(f.StreamID, nil)
			}
		case *http2.RSTStreamFrame:
			c.finish(f.StreamID, fmt.Errorf("lean HTTP/2 client: stream reset (%v)", f.ErrCode))
		case *http2.SettingsFrame:
			if !f.IsAck() {
				c.write(c.fr.WriteSettingsAck)
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				data := f.Data
				c.write(func() error { return c.fr.WritePing(true, data) })
			}
		case *http2.WindowUpdateFrame:
			if f.StreamID == 0 {
				c.wmu.Lock()
				c.sendWin += int64(f.Increment)
				c.winUp.Broadcast()
				c.wmu.Unlock()
			}
		case *http2.GoAwayFrame:
			c.close(fmt.Errorf("lean HTTP/2 client: server went away (%v)", f.ErrCode))
			return
		}
	}
}
