package checkclient

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// fakeAgent answers CheckBatch with answer, recording each batch's checks.
// These tests cover the client's protocol; the agent's own answers are
// tested against a real agent and Redis in pkg/agent.
type fakeAgent struct {
	allotv1connect.UnimplementedAdmissionServiceHandler
	answer func(ctx context.Context, checks []*allotv1.CheckRequest, send func(...*allotv1.CheckOutcome) error) error

	mu      sync.Mutex
	batches [][]string // request ids per batch
}

func (f *fakeAgent) CheckBatch(ctx context.Context, req *connect.Request[allotv1.CheckBatchRequest], stream *connect.ServerStream[allotv1.CheckBatchResponse]) error {
	var ids []string
	for _, c := range req.Msg.GetChecks() {
		ids = append(ids, c.GetRequestId())
	}
	f.mu.Lock()
	f.batches = append(f.batches, ids)
	f.mu.Unlock()
	return f.answer(ctx, req.Msg.GetChecks(), func(os ...*allotv1.CheckOutcome) error {
		return stream.Send(&allotv1.CheckBatchResponse{Outcomes: os})
	})
}

func (f *fakeAgent) seen() [][]string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([][]string(nil), f.batches...)
}

// allowAll answers every check at once, naming its request id as the rule.
func allowAll(_ context.Context, checks []*allotv1.CheckRequest, send func(...*allotv1.CheckOutcome) error) error {
	var os []*allotv1.CheckOutcome
	for i, c := range checks {
		os = append(os, &allotv1.CheckOutcome{Index: uint32(i), Response: &allotv1.CheckResponse{Allowed: true, Rule: c.GetRequestId()}})
	}
	return send(os...)
}

// start serves f over cleartext HTTP/2 and returns a client of it.
func start(t *testing.T, f *fakeAgent, cfg Config, opts ...connect.HandlerOption) *Client {
	t.Helper()
	return startWith(t, f, cfg, opts, nil)
}

// startWith is start with the options of f's handler and of the client.
func startWith(t *testing.T, f *fakeAgent, cfg Config, hopts []connect.HandlerOption, copts []connect.ClientOption) *Client {
	t.Helper()
	mux := http.NewServeMux()
	mux.Handle(allotv1connect.NewAdmissionServiceHandler(f, hopts...))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	hc := &http.Client{Transport: &http.Transport{Protocols: &p}}
	c, err := New(allotv1connect.NewAdmissionServiceClient(hc, srv.URL, copts...), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.Close()
		hc.CloseIdleConnections()
		srv.Close()
	})
	return c
}

type result struct {
	id   string
	resp *allotv1.CheckResponse
	err  error
}

// checkAsync starts a Check for request id id and reports it on out.
func checkAsync(ctx context.Context, c *Client, id string, out chan<- result) {
	go func() {
		resp, err := c.Check(ctx, connect.NewRequest(&allotv1.CheckRequest{RequestId: id}))
		r := result{id: id, err: err}
		if resp != nil {
			r.resp = resp.Msg
		}
		out <- r
	}()
}

// waitPending waits until n calls wait to be sent.
func waitPending(t *testing.T, c *Client, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c.mu.Lock()
		got := len(c.pending)
		c.mu.Unlock()
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d calls pending, want %d", got, n)
		}
		time.Sleep(time.Millisecond)
	}
}

// queueBehindFirst runs a client with one slot (MaxInFlight 1, a long
// SlotHold, and maxBatch) against f: its first call, "first", is held by
// the agent until ids have all queued behind it, then answered by
// allowAll, and the queued calls are answered by f.answer. It returns the
// channel every call's result arrives on, "first" included. hopts and
// copts are the options of f's handler and of the client.
func queueBehindFirst(t *testing.T, f *fakeAgent, maxBatch int, hopts []connect.HandlerOption, copts []connect.ClientOption, ids ...string) <-chan result {
	t.Helper()
	gate := make(chan struct{})
	rest := f.answer
	f.answer = func(ctx context.Context, checks []*allotv1.CheckRequest, send func(...*allotv1.CheckOutcome) error) error {
		if checks[0].GetRequestId() == "first" {
			<-gate
			return allowAll(ctx, checks, send)
		}
		return rest(ctx, checks, send)
	}
	c := startWith(t, f, Config{MaxInFlight: 1, MaxBatch: maxBatch, SlotHold: time.Minute}, hopts, copts)
	out := make(chan result, 1+len(ids))
	checkAsync(context.Background(), c, "first", out)
	for len(f.seen()) == 0 {
		time.Sleep(time.Millisecond)
	}
	for _, id := range ids {
		checkAsync(context.Background(), c, id, out)
	}
	waitPending(t, c, len(ids))
	close(gate)
	return out
}

// letters returns n request ids, "a", "b", ...
func letters(n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = string(rune('a' + i))
	}
	return ids
}

// TestCallsThatWaitGoTogether: a lone call goes at once; the calls that
// arrive while the only slot is taken go in one batch when it frees, and
// each caller gets its own answer.
func TestCallsThatWaitGoTogether(t *testing.T) {
	f := &fakeAgent{answer: allowAll}
	out := queueBehindFirst(t, f, 0, nil, nil, letters(10)...)
	for range 11 {
		r := <-out
		if r.err != nil || !r.resp.GetAllowed() || r.resp.GetRule() != r.id {
			t.Fatalf("call %s: %v %v, want its own answer", r.id, r.resp, r.err)
		}
	}
	if b := f.seen(); len(b) != 2 || len(b[0]) != 1 || len(b[1]) != 10 {
		t.Fatalf("batches %v, want [first] then the 10 that waited", b)
	}
}

// TestMaxBatchSplitsWaitingCalls: at most MaxBatch checks go per call.
func TestMaxBatchSplitsWaitingCalls(t *testing.T) {
	f := &fakeAgent{answer: allowAll}
	out := queueBehindFirst(t, f, 4, nil, nil, letters(10)...)
	for range 11 {
		if r := <-out; r.err != nil || r.resp.GetRule() != r.id {
			t.Fatalf("call %s: %v %v", r.id, r.resp, r.err)
		}
	}
	var sizes []int
	for _, b := range f.seen() {
		sizes = append(sizes, len(b))
	}
	if len(sizes) != 4 || sizes[0] != 1 || sizes[1] != 4 || sizes[2] != 4 || sizes[3] != 2 {
		t.Fatalf("batch sizes %v, want [1 4 4 2]", sizes)
	}
}

// TestSlowBatchFreesItsSlot: a batch whose checks all wait stops holding
// its slot after SlotHold, so a later call is answered meanwhile.
func TestSlowBatchFreesItsSlot(t *testing.T) {
	release := make(chan struct{})
	f := &fakeAgent{answer: func(ctx context.Context, checks []*allotv1.CheckRequest, send func(...*allotv1.CheckOutcome) error) error {
		if checks[0].GetRequestId() == "slow" {
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return allowAll(ctx, checks, send)
	}}
	c := start(t, f, Config{MaxInFlight: 1, SlotHold: 20 * time.Millisecond})
	slow := make(chan result, 1)
	checkAsync(context.Background(), c, "slow", slow)
	for len(f.seen()) == 0 {
		time.Sleep(time.Millisecond)
	}
	fast := make(chan result, 1)
	checkAsync(context.Background(), c, "fast", fast)
	select {
	case r := <-fast:
		if r.err != nil || r.resp.GetRule() != "fast" {
			t.Fatalf("fast call: %v %v", r.resp, r.err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a call waited behind a batch that holds no answer")
	}
	select {
	case r := <-slow:
		t.Fatalf("slow call answered before its check was: %v %v", r.resp, r.err)
	default:
	}
	close(release)
	if r := <-slow; r.err != nil || r.resp.GetRule() != "slow" {
		t.Fatalf("slow call: %v %v", r.resp, r.err)
	}
}

// TestOutcomesBecomeCheckErrors: a check's error outcome is the Connect
// error Check would give; a check the agent never answered fails Internal;
// indexes out of range or answered twice are ignored.
func TestOutcomesBecomeCheckErrors(t *testing.T) {
	f := &fakeAgent{answer: func(_ context.Context, checks []*allotv1.CheckRequest, send func(...*allotv1.CheckOutcome) error) error {
		var os []*allotv1.CheckOutcome
		for i, c := range checks {
			switch c.GetRequestId() {
			case "bad":
				os = append(os, &allotv1.CheckOutcome{Index: uint32(i), Error: &allotv1.CheckError{Code: "invalid_argument", Message: "cost: must not be negative"}})
			case "odd":
				os = append(os, &allotv1.CheckOutcome{Index: uint32(i), Error: &allotv1.CheckError{Code: "no_such_code", Message: "?"}})
			case "twice":
				os = append(os, &allotv1.CheckOutcome{Index: uint32(i), Response: &allotv1.CheckResponse{Allowed: true, Rule: "twice"}},
					&allotv1.CheckOutcome{Index: uint32(i), Response: &allotv1.CheckResponse{Allowed: false, Rule: "again"}})
			case "empty":
				os = append(os, &allotv1.CheckOutcome{Index: uint32(i)})
			}
		}
		os = append(os, &allotv1.CheckOutcome{Index: 99, Response: &allotv1.CheckResponse{}})
		return send(os...)
	}}
	out := queueBehindFirst(t, f, 0, nil, nil, "bad", "odd", "twice", "empty", "unanswered")
	got := map[string]result{}
	for range 6 {
		r := <-out
		got[r.id] = r
	}
	want := map[string]struct {
		code connect.Code
		msg  string
	}{
		"bad":        {connect.CodeInvalidArgument, "cost: must not be negative"},
		"odd":        {connect.CodeUnknown, "?"},
		"empty":      {connect.CodeInternal, "neither a response nor an error"},
		"unanswered": {connect.CodeInternal, "answered 4 of 5 checks"},
	}
	for id, w := range want {
		if err := got[id].err; connect.CodeOf(err) != w.code || !strings.Contains(err.Error(), w.msg) {
			t.Errorf("%s: %v, want %s containing %q", id, err, w.code, w.msg)
		}
	}
	if r := got["twice"]; r.err != nil || !r.resp.GetAllowed() || r.resp.GetRule() != "twice" {
		t.Errorf("twice: %v %v, want its first answer", r.resp, r.err)
	}
}

// TestOversizedCheckFailsAlone: when the agent refuses a batch's body (or
// the client's own send limit keeps it from going), the client sends each
// half on its own, so only the oversized check fails (ResourceExhausted)
// and its neighbours are decided.
func TestOversizedCheckFailsAlone(t *testing.T) {
	tests := []struct {
		name  string
		hopts []connect.HandlerOption
		copts []connect.ClientOption
	}{
		{"the agent's read limit", []connect.HandlerOption{connect.WithReadMaxBytes(4096)}, nil},
		{"the client's send limit", nil, []connect.ClientOption{connect.WithSendMaxBytes(4096)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := &fakeAgent{answer: allowAll}
			out := queueBehindFirst(t, f, 0, tt.hopts, tt.copts, "a", "b", strings.Repeat("x", 8192), "c", "d")
			for range 6 {
				r := <-out
				if len(r.id) > 100 {
					if connect.CodeOf(r.err) != connect.CodeResourceExhausted {
						t.Errorf("oversized check: %v, want ResourceExhausted", r.err)
					}
					continue
				}
				if r.err != nil || r.resp.GetRule() != r.id {
					t.Errorf("call %s beside the oversized one: %v %v, want decided", r.id, r.resp, r.err)
				}
			}
		})
	}
}

// TestAnswerOverTheClientsReadLimitIsNotResent: an answer the client's own
// read limit refuses (connect.WithReadMaxBytes) fails the batch's calls:
// the agent decided (and debited) its checks before answering, so sending
// them again, split or not, would charge them again. Only the agent's
// refusal of a batch's body is split and resent (TestOversizedCheckFailsAlone).
func TestAnswerOverTheClientsReadLimitIsNotResent(t *testing.T) {
	f := &fakeAgent{answer: allowAll}
	ids := letters(11)
	// One outcome fits in 64 bytes; the answer to the queued batch does not.
	out := queueBehindFirst(t, f, 0, nil, []connect.ClientOption{connect.WithReadMaxBytes(64)}, ids...)
	for range 1 + len(ids) {
		r := <-out
		switch {
		case r.id == "first":
			if r.err != nil {
				t.Errorf("first: %v, want its answer (under the read limit)", r.err)
			}
		case connect.CodeOf(r.err) != connect.CodeResourceExhausted:
			t.Errorf("call %s: %v %v, want ResourceExhausted (its answer was over the read limit)", r.id, r.resp, r.err)
		}
	}
	decided := 0
	for _, b := range f.seen() {
		decided += len(b)
	}
	if callers := 1 + len(ids); decided > callers {
		t.Fatalf("the agent decided %d checks for %d callers (batches %v), want each at most once", decided, callers, f.seen())
	}
}

// TestCallerDeadlineAndClose: a caller whose context ends gets its code at
// once though its batch is still out; after Close every call is refused.
func TestCallerDeadlineAndClose(t *testing.T) {
	release := make(chan struct{})
	f := &fakeAgent{answer: func(ctx context.Context, checks []*allotv1.CheckRequest, send func(...*allotv1.CheckOutcome) error) error {
		select {
		case <-release:
		case <-ctx.Done():
			return ctx.Err()
		}
		return allowAll(ctx, checks, send)
	}}
	c := start(t, f, Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err := c.Check(ctx, connect.NewRequest(&allotv1.CheckRequest{RequestId: "late"}))
	if connect.CodeOf(err) != connect.CodeDeadlineExceeded {
		t.Fatalf("caller past its deadline: %v, want DeadlineExceeded", err)
	}
	cctx, ccancel := context.WithCancel(context.Background())
	ccancel()
	if _, err := c.Check(cctx, connect.NewRequest(&allotv1.CheckRequest{})); connect.CodeOf(err) != connect.CodeCanceled {
		t.Fatalf("canceled caller: %v, want Canceled", err)
	}
	if _, err := c.Check(context.Background(), nil); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("nil request: %v, want InvalidArgument", err)
	}
	close(release)
	c.Close()
	_, err = c.Check(context.Background(), connect.NewRequest(&allotv1.CheckRequest{}))
	if connect.CodeOf(err) != connect.CodeUnavailable || !errors.Is(err, ErrClosed) {
		t.Fatalf("after Close: %v, want Unavailable wrapping ErrClosed", err)
	}
}

// TestCloseCutsOffBatchesInFlight: Close cancels a batch the agent never
// answers, fails its caller with ErrClosed and returns at once, its sender
// goroutines gone; it does not wait for the batch's Timeout.
func TestCloseCutsOffBatchesInFlight(t *testing.T) {
	entered := make(chan struct{}, 1)
	release := make(chan struct{})
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
		select {
		case entered <- struct{}{}:
		default:
		}
		<-release // never answers while the test runs
	}))
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(release) }) // runs first: srv.Close waits for the handler
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	hc := &http.Client{Transport: &http.Transport{Protocols: &p}}
	t.Cleanup(hc.CloseIdleConnections)
	c, err := New(allotv1connect.NewAdmissionServiceClient(hc, srv.URL), Config{Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	out := make(chan result, 1)
	checkAsync(context.Background(), c, "stuck", out)
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the batch never reached the server")
	}

	start := time.Now()
	c.Close()
	if took := time.Since(start); took > time.Second {
		t.Errorf("Close took %s with a batch in flight, want it cut off at once", took)
	}
	select {
	case r := <-out:
		if connect.CodeOf(r.err) != connect.CodeUnavailable || !errors.Is(r.err, ErrClosed) {
			t.Errorf("check in flight at Close: %v %v, want Unavailable wrapping ErrClosed", r.resp, r.err)
		}
	case <-time.After(time.Second):
		t.Fatal("the check in flight at Close did not return")
	}
	buf := make([]byte, 1<<20)
	if stacks := string(buf[:runtime.Stack(buf, true)]); strings.Contains(stacks, "checkclient.(*Client)") {
		t.Errorf("goroutines of the client still run after Close:\n%s", stacks)
	}
}

func TestConfig(t *testing.T) {
	if _, err := New(nil, Config{}); err == nil {
		t.Fatal("New(nil) succeeded")
	}
	api := allotv1connect.NewAdmissionServiceClient(http.DefaultClient, "http://127.0.0.1:1")
	c, err := New(api, Config{})
	if err != nil {
		t.Fatal(err)
	}
	if c.cfg.MaxBatch != 64 || c.cfg.MaxInFlight != 2 || c.cfg.SlotHold != 5*time.Millisecond || c.cfg.Timeout != 10*time.Second {
		t.Fatalf("defaults %+v", c.cfg)
	}
	for _, tt := range []struct {
		cfg  Config
		want string
	}{
		{Config{MaxBatch: 1025}, "MaxBatch"},
		{Config{MaxInFlight: -1}, "MaxInFlight"},
		{Config{SlotHold: -time.Second}, "SlotHold"},
		{Config{Timeout: -time.Second}, "Timeout"},
	} {
		if _, err := New(api, tt.cfg); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("New(%+v): %v, want an error naming %s", tt.cfg, err, tt.want)
		}
	}
}

// TestProtocols: CheckBatch's answers stream over the Connect protocol on
// HTTP/1.1 and HTTP/2 and over gRPC, so the client works on each.
func TestProtocols(t *testing.T) {
	f := &fakeAgent{answer: allowAll}
	mux := http.NewServeMux()
	mux.Handle(allotv1connect.NewAdmissionServiceHandler(f))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	defer srv.Close()
	h1 := &http.Client{Transport: &http.Transport{}}
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	h2 := &http.Client{Transport: &http.Transport{Protocols: &p}}
	defer h1.CloseIdleConnections()
	defer h2.CloseIdleConnections()
	for name, api := range map[string]allotv1connect.AdmissionServiceClient{
		"connect over HTTP/1.1": allotv1connect.NewAdmissionServiceClient(h1, srv.URL),
		"connect over HTTP/2":   allotv1connect.NewAdmissionServiceClient(h2, srv.URL),
		"gRPC":                  allotv1connect.NewAdmissionServiceClient(h2, srv.URL, connect.WithGRPC()),
	} {
		c, err := New(api, Config{})
		if err != nil {
			t.Fatal(err)
		}
		resp, err := c.Check(context.Background(), connect.NewRequest(&allotv1.CheckRequest{RequestId: "r1"}))
		c.Close()
		if err != nil || resp.Msg.GetRule() != "r1" {
			t.Errorf("%s: %v %v", name, resp, err)
		}
	}
}
