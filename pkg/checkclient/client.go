// Package checkclient is a Go client of a region agent's AdmissionService
// for gateways that call the agent rather than embed the admission engine.
// It coalesces the Check calls of concurrent callers into CheckBatch calls,
// so a busy gateway pays an RPC's fixed cost (HTTP/2 headers, a stream, a
// handler, a flush on each side) once per batch instead of once per request,
// while each caller still waits only for its own answer:
//
//   - a call is sent at once when no batch is waiting for its first answer,
//     so an idle client adds no latency;
//   - while MaxInFlight batches wait, calls gather and go together (at most
//     MaxBatch) as soon as one of them is answered (or has waited SlotHold);
//   - the agent streams answers back as they are decided, so a check that
//     waits (for a renewal, say) holds back no other caller.
//
// Answers and errors are those of Check: a decision is a response; bad input
// is a *connect.Error with the code and message Check would have given. A
// read limit on api's client (connect.WithReadMaxBytes) must let the agent's
// answers through: the calls of a batch whose answer it refuses fail with
// ResourceExhausted and are not sent again, as the agent may have decided
// (and charged) them already.
package checkclient

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	"github.com/allot-dev/allot/internal/gopool"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// maxBatchChecks mirrors the agent's limit on checks per CheckBatch
// (agent.MaxBatchChecks; not imported, so that a gateway need not link the
// agent).
const maxBatchChecks = 1024

// ErrClosed is the error, in an Unavailable *connect.Error, of a Check
// refused after Close or cut off in flight by it.
var ErrClosed = errors.New("checkclient: closed")

// Config tunes the coalescing; the zero value of a field means its default.
type Config struct {
	// MaxBatch is the most checks per CheckBatch call (default 64, at most
	// 1,024, the agent's limit).
	MaxBatch int
	// MaxInFlight is the most batches sent and not yet answered at all
	// (default 2). A batch stops counting at its first answer, or after
	// SlotHold. Fewer batches in flight make larger batches: on the
	// benchmark machine 1, 2, 4 and 8 gave 45,026, 42,798, 38,720 and 32,949
	// decisions/s with 64 callers (docs/agent-bench.md).
	MaxInFlight int
	// SlotHold is how long an unanswered batch may hold its slot (default
	// 5 ms): a batch whose checks all wait (for a renewal, say) then holds
	// back no later batch.
	SlotHold time.Duration
	// Timeout bounds a batch call when some of its callers have no deadline
	// (default 10 s); otherwise the latest caller deadline bounds it.
	Timeout time.Duration
}

func (c *Config) fill() error {
	if c.MaxBatch == 0 {
		c.MaxBatch = 64
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = 2
	}
	if c.SlotHold == 0 {
		c.SlotHold = 5 * time.Millisecond
	}
	if c.Timeout == 0 {
		c.Timeout = 10 * time.Second
	}
	var errs []error
	if c.MaxBatch < 1 || c.MaxBatch > maxBatchChecks {
		errs = append(errs, fmt.Errorf("MaxBatch must be in [1, %d], got %d", maxBatchChecks, c.MaxBatch))
	}
	if c.MaxInFlight < 1 {
		errs = append(errs, fmt.Errorf("MaxInFlight must be at least 1, got %d", c.MaxInFlight))
	}
	if c.SlotHold < 0 {
		errs = append(errs, fmt.Errorf("SlotHold must not be negative, got %s", c.SlotHold))
	}
	if c.Timeout < 0 {
		errs = append(errs, fmt.Errorf("Timeout must not be negative, got %s", c.Timeout))
	}
	return errors.Join(errs...)
}

// Client coalesces concurrent Check calls; it is safe for concurrent use. It
// is an allotv1connect.AdmissionServiceClient, so it can stand in for the
// client it wraps.
type Client struct {
	api allotv1connect.AdmissionServiceClient
	cfg Config

	ctx    context.Context    // the batch calls' parent
	cancel context.CancelFunc // Close's: cuts off the batches under way

	mu       sync.Mutex
	pending  []*call
	inflight int // batches sent and not yet answered at all
	closed   bool
	wg       sync.WaitGroup // batch calls under way
	senders  *gopool.Pool   // their goroutines, reused (their stacks stay grown)
}

var _ allotv1connect.AdmissionServiceClient = (*Client)(nil)

// call is one caller's check, waiting for its answer.
type call struct {
	ctx  context.Context
	req  *allotv1.CheckRequest
	done chan answer // buffered: an answer never blocks its sender
}

type answer struct {
	resp *allotv1.CheckResponse
	err  error
}

// New returns a client that sends api's CheckBatch calls. api decides the
// transport (HTTP client, protocol, interceptors). CheckBatch streams its
// answers from the server only, which the Connect protocol carries over
// HTTP/1.1 and HTTP/2 and gRPC over HTTP/2; one HTTP/2 connection serves
// every batch best.
func New(api allotv1connect.AdmissionServiceClient, cfg Config) (*Client, error) {
	if api == nil {
		return nil, errors.New("checkclient: api is nil")
	}
	if err := cfg.fill(); err != nil {
		return nil, fmt.Errorf("checkclient: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Client{api: api, cfg: cfg, ctx: ctx, cancel: cancel, senders: gopool.New(250 * time.Millisecond)}, nil
}

// Check decides req.Msg as the agent's Check would, in a CheckBatch call
// shared with concurrent callers. It returns when req is answered or ctx is
// done; a check whose caller gave up may still be decided by the agent, as
// a Check call cut off in flight may be. req's headers are not sent (a
// batch has one set): put them on the client New was given, with an
// interceptor.
func (c *Client) Check(ctx context.Context, req *connect.Request[allotv1.CheckRequest]) (*connect.Response[allotv1.CheckResponse], error) {
	if req == nil || req.Msg == nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("request: missing"))
	}
	if err := ctx.Err(); err != nil {
		return nil, ctxError(err)
	}
	cl := &call{ctx: ctx, req: req.Msg, done: make(chan answer, 1)}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, errClosed()
	}
	c.pending = append(c.pending, cl)
	c.dispatchLocked()
	c.mu.Unlock()
	select {
	case a := <-cl.done:
		if a.err != nil {
			return nil, a.err
		}
		return connect.NewResponse(a.resp), nil
	case <-ctx.Done():
		return nil, ctxError(ctx.Err())
	}
}

// ReleaseSlot calls the agent's ReleaseSlot directly.
func (c *Client) ReleaseSlot(ctx context.Context, req *connect.Request[allotv1.ReleaseSlotRequest]) (*connect.Response[allotv1.ReleaseSlotResponse], error) {
	return c.api.ReleaseSlot(ctx, req)
}

// CheckBatch calls the agent's CheckBatch directly.
func (c *Client) CheckBatch(ctx context.Context, req *connect.Request[allotv1.CheckBatchRequest]) (*connect.ServerStreamForClient[allotv1.CheckBatchResponse], error) {
	return c.api.CheckBatch(ctx, req)
}

// Close fails the calls not yet sent, cuts off the batches under way (their
// callers not yet answered get ErrClosed; the agent may still decide their
// checks) and returns when the client's goroutines have ended.
func (c *Client) Close() {
	c.mu.Lock()
	c.closed = true
	pending := c.pending
	c.pending = nil
	c.mu.Unlock()
	c.cancel()
	for _, cl := range pending {
		cl.done <- answer{err: errClosed()}
	}
	c.wg.Wait()
	c.senders.Close()
}

// errClosed is the error of a call Close refused or cut off.
func errClosed() error { return connect.NewError(connect.CodeUnavailable, ErrClosed) }

// dispatchLocked sends batches while slots are free and calls wait.
func (c *Client) dispatchLocked() {
	for !c.closed && len(c.pending) > 0 && c.inflight < c.cfg.MaxInFlight {
		n := min(len(c.pending), c.cfg.MaxBatch)
		batch := make([]*call, n)
		copy(batch, c.pending)
		rest := copy(c.pending, c.pending[n:])
		clear(c.pending[rest:])
		c.pending = c.pending[:rest]
		c.inflight++
		c.wg.Add(1) // under mu while not closed: before Close's Wait
		c.senders.Go(func() { c.send(batch) })
	}
}

// answered frees the slot of a batch that got its first answer (or ended).
func (c *Client) answered() {
	c.mu.Lock()
	c.inflight--
	c.dispatchLocked()
	c.mu.Unlock()
}

// send makes the CheckBatch call of batch; its slot is free at the first
// answer, after SlotHold, or at the end, whichever comes first.
func (c *Client) send(batch []*call) {
	defer c.wg.Done()
	var freed atomic.Bool
	free := func() {
		if freed.CompareAndSwap(false, true) {
			c.answered()
		}
	}
	defer free()
	hold := time.AfterFunc(c.cfg.SlotHold, free)
	defer hold.Stop()
	c.exchange(batch, free)
}

// exchange makes one CheckBatch call for the live calls of batch, hands each
// its answer, and calls answered at the first answer.
func (c *Client) exchange(batch []*call, answered func()) {
	live := batch[:0]
	reqs := make([]*allotv1.CheckRequest, 0, len(batch))
	deadline, bounded := time.Time{}, true
	for _, cl := range batch {
		if err := cl.ctx.Err(); err != nil {
			cl.done <- answer{err: ctxError(err)}
			continue
		}
		live = append(live, cl)
		reqs = append(reqs, cl.req)
		if d, ok := cl.ctx.Deadline(); !ok {
			bounded = false
		} else if d.After(deadline) {
			deadline = d
		}
	}
	if len(live) == 0 {
		return
	}
	if !bounded {
		deadline = time.Now().Add(c.cfg.Timeout)
	}
	ctx, cancel := context.WithDeadline(c.ctx, deadline)
	defer cancel()

	left := len(live)
	fail := func(err error) {
		for _, cl := range live {
			if cl != nil {
				cl.done <- answer{err: err}
			}
		}
	}
	got := false // an answer came
	stream, err := c.api.CheckBatch(ctx, connect.NewRequest(&allotv1.CheckBatchRequest{Checks: reqs}))
	unsent := err != nil // refused before the stream opened: nothing went out
	if err == nil {
		defer stream.Close()
		for left > 0 && stream.Receive() {
			got = true
			answered()
			for _, o := range stream.Msg().GetOutcomes() {
				i := int(o.GetIndex())
				if i >= len(live) || live[i] == nil {
					continue // out of range or answered twice: ignored, counted below
				}
				live[i].done <- outcomeAnswer(o)
				live[i] = nil
				left--
			}
		}
		if left == 0 {
			return
		}
		err = stream.Err()
	}
	if c.ctx.Err() != nil {
		fail(errClosed())
		return
	}
	if !got && len(live) > 1 && connect.CodeOf(err) == connect.CodeResourceExhausted && (connect.IsWireError(err) || unsent) {
		// The agent refused the batch's body before deciding any of it
		// (or the client's own send limit kept it from going): send each
		// half on its own, so that one oversized check fails alone. A
		// ResourceExhausted of the client's own making once the batch went
		// out is its read limit refusing an answer: the agent may have
		// decided (and debited) every check already, so the calls fail and
		// are not sent again.
		half := len(live) / 2
		c.exchange(live[:half], answered)
		c.exchange(live[half:], answered)
		return
	}
	if err == nil {
		err = connect.NewError(connect.CodeInternal, fmt.Errorf("checkclient: the agent answered %d of %d checks", len(live)-left, len(live)))
	}
	fail(err)
}

// outcomeAnswer is what Check returns for o.
func outcomeAnswer(o *allotv1.CheckOutcome) answer {
	if e := o.GetError(); e != nil {
		var code connect.Code
		if code.UnmarshalText([]byte(e.GetCode())) != nil {
			code = connect.CodeUnknown
		}
		return answer{err: connect.NewError(code, errors.New(e.GetMessage()))}
	}
	if r := o.GetResponse(); r != nil {
		return answer{resp: r}
	}
	return answer{err: connect.NewError(connect.CodeInternal, fmt.Errorf("checkclient: check %d answered with neither a response nor an error", o.GetIndex()))}
}

// ctxError is the error of a caller whose context ended.
func ctxError(err error) error {
	if errors.Is(err, context.DeadlineExceeded) {
		return connect.NewError(connect.CodeDeadlineExceeded, err)
	}
	return connect.NewError(connect.CodeCanceled, err)
}
