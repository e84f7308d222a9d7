package allocator

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"

	"github.com/allot-dev/allot/fsm"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// stableLeader returns the leader of tc once it has written its own
// entries (its member table entry), so that its log grows only by the
// calls a test makes.
func stableLeader(t *testing.T, tc *testCluster) *Node {
	t.Helper()
	l := tc.leader()
	deadline := time.Now().Add(5 * time.Second)
	for l.FSM().Members()[l.ID()] == "" {
		if time.Now().After(deadline) {
			t.Fatal("the leader never recorded its API address")
		}
		time.Sleep(10 * time.Millisecond)
	}
	return l
}

// TestRefusedCommandsStayOutOfTheLog sends Acquire, Release and
// PublishPolicy calls that break a bound the state machine enforces on a
// command (a length, a count, a range, a duplicate): each is refused with
// InvalidArgument naming the field, in the state machine's words, and none
// is proposed: the leader's log does not grow. They used to be refused by
// the state machine only, once appended to the log and replicated, with the
// other callers' commands group-committed into the same entry (40 Releases
// of 3 MiB grant ids made entries of up to 102 MB).
func TestRefusedCommandsStayOutOfTheLog(t *testing.T) {
	tc := newTestCluster(t, 1)
	publishTest(t, tc.addrs, templatePolicy, 1)
	l := stableLeader(t, tc)
	hc := NewHTTPClient()
	alloc := allotv1connect.NewAllocatorServiceClient(hc, baseURL(tc.addrs[0]))
	op := allotv1connect.NewOperatorServiceClient(hc, baseURL(tc.addrs[0]))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	big := strings.Repeat("g", 3<<20)
	want := func(q string, tokens int64) []*allotv1.Want {
		return []*allotv1.Want{{Quota: q, Tokens: tokens}}
	}
	acquire := func(m *allotv1.AcquireRequest) func() error {
		return func() error { _, err := alloc.Acquire(ctx, connect.NewRequest(m)); return err }
	}
	release := func(m *allotv1.ReleaseRequest) func() error {
		return func() error { _, err := alloc.Release(ctx, connect.NewRequest(m)); return err }
	}
	publish := func(m *allotv1.PublishPolicyRequest) func() error {
		return func() error { _, err := op.PublishPolicy(ctx, connect.NewRequest(m)); return err }
	}
	pub := func(author, reason string) *allotv1.PublishPolicyRequest {
		return &allotv1.PublishPolicyRequest{Document: []byte(clusterPolicy), Author: author, Reason: reason, ExpectedVersion: 2}
	}
	for _, tt := range []struct {
		name string
		call func() error
		msg  string
	}{
		{"release grant_id", release(&allotv1.ReleaseRequest{Region: "eu", GrantId: big, Tokens: 1, RequestId: "r1"}),
			fmt.Sprintf("release: grant_id: %d bytes, at most %d", len(big), fsm.MaxGrantIDBytes)},
		{"release region", release(&allotv1.ReleaseRequest{Region: big, GrantId: "1-0", Tokens: 1, RequestId: "r2"}),
			fmt.Sprintf("release: region: %d bytes, at most %d", len(big), fsm.MaxRegionBytes)},
		{"release request_id", release(&allotv1.ReleaseRequest{Region: "eu", GrantId: "1-0", Tokens: 1, RequestId: big}),
			fmt.Sprintf("release: request_id: %d bytes, at most %d", len(big), fsm.MaxRequestIDBytes)},
		{"acquire quota", acquire(&allotv1.AcquireRequest{Region: "eu", RequestId: "a1", Wants: want(big, 1)}),
			fmt.Sprintf("acquire: wants[0].quota: %d bytes, at most %d", len(big), fsm.MaxQuotaNameBytes)},
		{"acquire empty quota", acquire(&allotv1.AcquireRequest{Region: "eu", RequestId: "a2", Wants: []*allotv1.Want{{Quota: "atlas", Tokens: 1}, nil}}),
			"acquire: wants[1].quota: must not be empty"},
		{"acquire duplicate quota", acquire(&allotv1.AcquireRequest{Region: "eu", RequestId: "a3",
			Wants: []*allotv1.Want{{Quota: "atlas", Tokens: 1}, {Quota: "standard/t1"}, {Quota: "atlas"}}}),
			`acquire: wants[2].quota "atlas": duplicate of wants[0]`},
		{"acquire negative tokens", acquire(&allotv1.AcquireRequest{Region: "eu", RequestId: "a4", Wants: want("atlas", -1)}),
			"acquire: wants[0].tokens -1"},
		{"acquire tokens over every limit", acquire(&allotv1.AcquireRequest{Region: "eu", RequestId: "a5", Wants: want("atlas", math.MaxInt64)}),
			fmt.Sprintf("acquire: wants[0].tokens %d: must be in [0, %d]", int64(math.MaxInt64), int64(fsm.MaxLimit))},
		{"acquire region", acquire(&allotv1.AcquireRequest{Region: big, RequestId: "a6", Wants: want("atlas", 1)}),
			fmt.Sprintf("acquire: region: %d bytes, at most %d", len(big), fsm.MaxRegionBytes)},
		{"publish author", publish(pub(big, "r")),
			fmt.Sprintf("publish_policy: author: %d bytes, at most %d", len(big), fsm.MaxAuthorBytes)},
		{"publish reason", publish(pub("a", strings.Repeat("r", fsm.MaxReasonBytes+1))),
			fmt.Sprintf("publish_policy: reason: %d bytes, at most %d", fsm.MaxReasonBytes+1, fsm.MaxReasonBytes)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			before := l.Raft().LastIndex()
			err := tt.call()
			if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), tt.msg) {
				t.Errorf("got %.300v; want InvalidArgument saying %q", err, tt.msg)
			}
			if after := l.Raft().LastIndex(); after != before {
				t.Errorf("the refused call was proposed: the leader's log went from %d to %d entries", before, after)
			}
		})
	}
	// The bounds are the state machine's: the longest accepted value still
	// reaches it (and, naming no grant, is refused there as unknown).
	_, err := alloc.Release(ctx, connect.NewRequest(&allotv1.ReleaseRequest{
		Region: strings.Repeat("e", fsm.MaxRegionBytes), GrantId: strings.Repeat("g", fsm.MaxGrantIDBytes), Tokens: 1,
		RequestId: strings.Repeat("r", fsm.MaxRequestIDBytes),
	}))
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("a Release at every bound: %v, want NotFound (unknown grant)", err)
	}
}

// TestErrorsDoNotRepeatLargeInput: a name no quota or member can have is
// refused by its length, not quoted whole in a NotFound (a 3 MiB name made
// a 3 MiB error message), and a policy document's errors quote at most a
// bounded prefix of a scalar, cut at a rune boundary.
func TestErrorsDoNotRepeatLargeInput(t *testing.T) {
	tc := newTestCluster(t, 1)
	publishTest(t, tc.addrs, templatePolicy, 1)
	tc.leader()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	big := strings.Repeat("x", 3<<20)
	for _, proto := range []string{"connect", "grpc"} {
		var opts []connect.ClientOption
		if proto == "grpc" {
			opts = append(opts, connect.WithGRPC())
		}
		op := allotv1connect.NewOperatorServiceClient(NewHTTPClient(), baseURL(tc.addrs[0]), opts...)
		for _, tt := range []struct {
			name string
			call func() error
			code connect.Code
			msg  string
		}{
			{"GetWindow", func() error {
				_, err := op.GetWindow(ctx, connect.NewRequest(&allotv1.GetWindowRequest{Quota: big}))
				return err
			}, connect.CodeInvalidArgument, fmt.Sprintf("quota: %d bytes, at most %d", len(big), fsm.MaxQuotaNameBytes)},
			{"GetBound", func() error {
				_, err := op.GetBound(ctx, connect.NewRequest(&allotv1.GetBoundRequest{Quota: big}))
				return err
			}, connect.CodeInvalidArgument, fmt.Sprintf("quota: %d bytes, at most %d", len(big), fsm.MaxQuotaNameBytes)},
			{"RemoveMember", func() error {
				_, err := op.RemoveMember(ctx, connect.NewRequest(&allotv1.RemoveMemberRequest{Id: big}))
				return err
			}, connect.CodeInvalidArgument, fmt.Sprintf("id: %d bytes, at most %d", len(big), fsm.MaxMemberIDBytes)},
			{"PublishPolicy", func() error {
				doc := "name: a" + strings.Repeat("é", (1<<20-16)/2) + "\n"
				_, err := op.PublishPolicy(ctx, connect.NewRequest(&allotv1.PublishPolicyRequest{Author: "a", Reason: "r", ExpectedVersion: 2, Document: []byte(doc)}))
				return err
			}, connect.CodeInvalidArgument, `name: "aéé`},
			{"GetWindow of a quota of the longest name", func() error {
				_, err := op.GetWindow(ctx, connect.NewRequest(&allotv1.GetWindowRequest{Quota: strings.Repeat("q", fsm.MaxQuotaNameBytes)}))
				return err
			}, connect.CodeNotFound, strings.Repeat("q", fsm.MaxQuotaNameBytes)},
		} {
			err := tt.call()
			var ce *connect.Error
			if !errors.As(err, &ce) || ce.Code() != tt.code || !strings.Contains(ce.Message(), tt.msg) {
				t.Errorf("%s %s: %.300v; want %v saying %q", proto, tt.name, err, tt.code, tt.msg)
				continue
			}
			if n := len(ce.Message()); n > 1024 || !utf8.ValidString(ce.Message()) {
				t.Errorf("%s %s: a message of %d bytes (valid UTF-8: %v): %.300q", proto, tt.name, n, utf8.ValidString(ce.Message()), ce.Message())
			}
		}
	}
}

// TestProposerCapsEntriesByBytes: calls that are valid but large are
// group-committed into entries of at most maxEntryBytes encoded bytes; a
// call that would take a batch past it waits for the next entry, and one
// larger on its own goes alone. The proposer used to weigh a Release as one
// want whatever its bytes, so concurrent large calls were merged into one
// entry of up to fsm.MaxBatch of them.
func TestProposerCapsEntriesByBytes(t *testing.T) {
	var (
		mu      sync.Mutex
		entries [][2]int // commands and encoded bytes of each entry
	)
	apply := func(cmd fsm.Command) (any, error) {
		b, err := fsm.Encode(cmd)
		if err != nil {
			return nil, err
		}
		time.Sleep(20 * time.Millisecond) // a Raft round: calls pile up meanwhile
		n := 1
		var res any = &fsm.ReleaseResult{}
		if cmd.Type == fsm.CmdBatch {
			n = len(cmd.Batch)
			br := &fsm.BatchResult{}
			for range cmd.Batch {
				br.Results = append(br.Results, &fsm.ReleaseResult{})
			}
			res = br
		}
		mu.Lock()
		entries = append(entries, [2]int{n, len(b)})
		mu.Unlock()
		return res, nil
	}
	p := startProposer(apply, 0, 1)
	defer p.close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	// 64 calls of 200 KB (fewer than 6 fit in an entry) and one of 2 MiB;
	// "<" is escaped as \u003c, six bytes for one.
	sizes := make([]int, 64)
	for i := range sizes {
		sizes[i] = 200 << 10
	}
	sizes = append(sizes, 2<<20)
	errs := make([]error, len(sizes))
	var wg sync.WaitGroup
	for i, n := range sizes {
		id := strings.Repeat("g", n)
		if i == 0 {
			id = strings.Repeat("<", n/6)
		}
		wg.Go(func() {
			cmd := fsm.Command{Type: fsm.CmdRelease, Release: &fsm.Release{Region: "eu", GrantID: id, Tokens: 1, RequestID: fmt.Sprint(i)}}
			_, errs[i] = p.propose(ctx, cmd)
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	calls, batched := 0, false
	for _, e := range entries {
		calls += e[0]
		if e[0] > 1 {
			batched = true
			if e[1] > maxEntryBytes {
				t.Errorf("an entry of %d commands is %d bytes, over %d", e[0], e[1], maxEntryBytes)
			}
		}
	}
	if calls != len(sizes) || !batched {
		t.Errorf("%d calls in entries (commands, bytes) %v; want all %d, some batched", calls, entries, len(sizes))
	}
	t.Logf("entries (commands, bytes): %v", entries)
}

// TestEncodedSizeBoundsEncoding: the proposer's estimate of a command's
// bytes is never below what fsm.Encode writes for it in a batch, whatever
// its strings hold (escaped characters, invalid UTF-8) and its numbers.
func TestEncodedSizeBoundsEncoding(t *testing.T) {
	strs := []string{"", "eu", `"\<>&`, "\x00\x01\x1f\b\f\n\r\t", "\u2028\u2029", "é😀", "\xff\xfe\xc3", strings.Repeat("<", 1000)}
	var cmds []fsm.Command
	for i, s := range strs {
		cmds = append(cmds,
			fsm.Command{Type: fsm.CmdRelease, NowUnixMs: math.MinInt64, Release: &fsm.Release{Region: s, GrantID: s, Tokens: math.MinInt64, RequestID: s}},
			fsm.Command{Type: fsm.CmdAcquire, NowUnixMs: math.MinInt64, Acquire: &fsm.Acquire{Region: s, RequestID: s, Wants: []fsm.Want{
				{Quota: s, Tokens: math.MinInt64, DemandPerSecond: -math.MaxFloat64, Next: true},
				{Quota: strs[(i+1)%len(strs)], Tokens: math.MaxInt64, DemandPerSecond: math.SmallestNonzeroFloat64},
			}}})
	}
	for i, c := range cmds { // a lone call is proposed as its own entry
		b, err := fsm.Encode(c)
		if err != nil {
			t.Fatal(err)
		}
		if len(b) > encodedSize(c) {
			t.Errorf("command %d encodes to %d bytes, estimated %d", i, len(b), encodedSize(c))
		}
	}
	for _, n := range []int{2, 3, len(cmds)} {
		batch := fsm.Command{Type: fsm.CmdBatch, NowUnixMs: math.MinInt64, Batch: cmds[:n]}
		b, err := fsm.Encode(batch)
		if err != nil {
			t.Fatal(err)
		}
		est := 0
		for _, c := range cmds[:n] {
			est += encodedSize(c)
		}
		if len(b) > est {
			t.Errorf("a batch of %d commands encodes to %d bytes, estimated %d", n, len(b), est)
		}
	}
}

// watchServer serves node n's API on a listener of its own, whose accepted
// connections send through a 4 KiB socket buffer, and returns its address
// and Server.
func watchServer(t *testing.T, n *Node) (string, *Server, *Metrics) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	m := NewMetrics(nil)
	api := NewServer(n, zap.NewNop(), m)
	srv := HTTPServer(ln.Addr().String(), Mux(api, nil))
	go func() { _ = srv.Serve(smallSendBuffers{ln}) }()
	t.Cleanup(func() { api.Shutdown(); _ = srv.Close() })
	return ln.Addr().String(), api, m
}

type smallSendBuffers struct{ net.Listener }

func (l smallSendBuffers) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetWriteBuffer(4096)
	}
	return c, err
}

// largePolicy returns a valid policy document of about size bytes, of
// random letters, so that it stays large compressed (the server gzips).
func largePolicy(size int) string {
	var b strings.Builder
	b.WriteString("name: large\nregions: [eu]\nrules:\n")
	r := rand.New(rand.NewPCG(1, 2))
	d := make([]byte, 900)
	for i := 0; b.Len() < size; i++ {
		for j := range d {
			d[j] = byte('a' + r.IntN(26))
		}
		fmt.Fprintf(&b, "  - {name: r%d, description: %s, scope: tenant, match: [{key: tenant, value: t%d}], kind: fixed_window, limit: 1, window: 1s}\n", i, d, i)
	}
	return b.String()
}

// TestWatchPolicyStreamCap: a node serves at most MaxWatchStreams
// WatchPolicy streams; one more is refused with ResourceExhausted, and a
// place freed is taken again. The allot_allocator_watch_streams gauge counts
// them. Streams used to be unbounded: 300 clients that never read held
// 300 MB and 600 goroutines.
func TestWatchPolicyStreamCap(t *testing.T) {
	tc := newTestCluster(t, 1, func(c *Config) { c.MaxWatchStreams = 2 })
	publishTest(t, tc.addrs, clusterPolicy, 1)
	addr, api, m := watchServer(t, tc.leader())
	op := allotv1connect.NewOperatorServiceClient(NewHTTPClient(), baseURL(addr))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	open := func(ctx context.Context) (*connect.ServerStreamForClient[allotv1.WatchPolicyResponse], error) {
		s, err := op.WatchPolicy(ctx, connect.NewRequest(&allotv1.WatchPolicyRequest{}))
		if err != nil {
			return nil, err
		}
		if !s.Receive() {
			return nil, s.Err()
		}
		return s, nil
	}
	ctx1, cancel1 := context.WithCancel(ctx)
	defer cancel1()
	s1, err := open(ctx1)
	if err != nil {
		t.Fatal(err)
	}
	defer s1.Close()
	s2, err := open(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if g := testutil.ToFloat64(m.WatchStreams); g != 2 {
		t.Errorf("allot_allocator_watch_streams = %v with two streams open", g)
	}
	_, err = open(ctx)
	if connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "MaxWatchStreams") {
		t.Fatalf("a third stream: %v, want ResourceExhausted naming MaxWatchStreams", err)
	}
	cancel1()
	deadline := time.Now().Add(3 * time.Second)
	for api.watches.Load() > 1 {
		if time.Now().After(deadline) {
			t.Fatal("a closed stream kept its place")
		}
		time.Sleep(10 * time.Millisecond)
	}
	s3, err := open(ctx)
	if err != nil {
		t.Fatalf("a stream after one closed: %v", err)
	}
	defer s3.Close()
	if g := testutil.ToFloat64(m.WatchStreams); g != 2 {
		t.Errorf("allot_allocator_watch_streams = %v with two streams open", g)
	}
}

// TestWatchPolicyClosesStalledStream: a stream whose client does not read
// a version within WatchSendTimeout is closed, over HTTP/2 (flow control
// stops the send) and HTTP/1.1 (the socket's buffers fill), and its place
// and memory are freed. It used to wait for the client forever.
func TestWatchPolicyClosesStalledStream(t *testing.T) {
	tc := newTestCluster(t, 1, func(c *Config) { c.WatchSendTimeout = 200 * time.Millisecond })
	publishTest(t, tc.addrs, largePolicy(600<<10), 1)
	addr, api, m := watchServer(t, tc.leader())
	waitWatches := func(t *testing.T, want int64) {
		t.Helper()
		deadline := time.Now().Add(3 * time.Second)
		for api.watches.Load() != want {
			if time.Now().After(deadline) {
				t.Fatalf("%d streams open after 3 s, want %d (send timeout 200 ms)", api.watches.Load(), want)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}

	t.Run("HTTP/2", func(t *testing.T) {
		hc := NewHTTPClient()
		// The client takes 64 KiB of a stream until the caller reads.
		hc.Transport.(*http.Transport).HTTP2.MaxReceiveBufferPerStream = 64 << 10
		op := allotv1connect.NewOperatorServiceClient(hc, baseURL(addr))
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		s, err := op.WatchPolicy(ctx, connect.NewRequest(&allotv1.WatchPolicyRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		waitWatches(t, 1)
		start := time.Now()
		waitWatches(t, 0) // without reading
		t.Logf("stream closed %s after it was seen open", time.Since(start).Round(time.Millisecond))
		if s.Receive() {
			t.Errorf("the stalled stream delivered version %d", s.Msg().GetPolicy().GetVersion())
		}
	})
	t.Run("HTTP/1.1", func(t *testing.T) {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.(*net.TCPConn).SetReadBuffer(4096)
		fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/connect+proto\r\nConnect-Protocol-Version: 1\r\nContent-Length: 5\r\n\r\n\x00\x00\x00\x00\x00",
			allotv1connect.OperatorServiceWatchPolicyProcedure)
		waitWatches(t, 1)
		waitWatches(t, 0) // without reading
	})
	if g := testutil.ToFloat64(m.WatchStreams); g != 0 {
		t.Errorf("allot_allocator_watch_streams = %v with no stream open", g)
	}
}
