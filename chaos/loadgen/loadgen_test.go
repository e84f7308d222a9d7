package loadgen

import (
	"context"
	"errors"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/allot-dev/allot/chaos/history"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// fakeAgent answers by tenant: "ok" allowed, "limited" 429, "down" 503;
// "flaky" fails the first attempt of every request id, then allows as a
// replay (the store decided the first attempt; its answer was lost);
// "fallback" allows as a fail mode's decision (degraded).
type fakeAgent struct {
	allotv1connect.UnimplementedAdmissionServiceHandler
	mu   sync.Mutex
	seen map[string]int
}

func (f *fakeAgent) Check(_ context.Context, req *connect.Request[allotv1.CheckRequest]) (*connect.Response[allotv1.CheckResponse], error) {
	f.mu.Lock()
	f.seen[req.Msg.GetRequestId()]++
	n := f.seen[req.Msg.GetRequestId()]
	f.mu.Unlock()
	resp := &allotv1.CheckResponse{}
	switch req.Msg.GetEntries()[0].GetValue() {
	case "ok":
		resp.Allowed = true
	case "down":
		resp.Unavailable = true
	case "fallback":
		resp.Allowed, resp.Degraded = true, true
	case "flaky":
		if n == 1 {
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("restarting"))
		}
		resp.Allowed, resp.Replayed = true, true
	}
	return connect.NewResponse(resp), nil
}

type sink struct {
	mu  sync.Mutex
	evs []history.Event
}

func (s *sink) emit(e history.Event) {
	s.mu.Lock()
	s.evs = append(s.evs, e)
	s.mu.Unlock()
}

type clock struct{}

func (clock) Now() int64 { return time.Now().UnixNano() }

func TestGenerator(t *testing.T) {
	fa := &fakeAgent{seen: map[string]int{}}
	_, h := allotv1connect.NewAdmissionServiceHandler(fa)
	srv := httptest.NewServer(h)
	defer srv.Close()
	client := allotv1connect.NewAdmissionServiceClient(srv.Client(), srv.URL)
	out := &sink{}
	cfg := Config{Region: "eu", Agent: "unused", RetryFor: 2 * time.Second, Quotas: []QuotaConfig{
		{Name: "ok", WindowMs: 3000, Rate: 100, Chunk: 40},
		{Name: "limited", WindowMs: 3000, Rate: 100},
		{Name: "down", WindowMs: 3000, Rate: 100},
		{Name: "flaky", WindowMs: 3000, Rate: 100},
		{Name: "fallback", WindowMs: 3000, Rate: 100},
	}}
	g, err := New(cfg, clock{}, client, out.emit)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- g.Run(context.Background()) }()
	time.Sleep(300 * time.Millisecond)
	g.Storm(2) // 2 x 40/4 = 20 extra "ok" requests (2 for each quota without a chunk)
	time.Sleep(100 * time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := g.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	got := map[string]map[string]int{}
	for _, e := range out.evs {
		if got[e.Quota] == nil {
			got[e.Quota] = map[string]int{}
		}
		got[e.Quota][string(e.Kind)+"/"+e.Reason]++
		if e.Region != "eu" || e.Tokens != 1 || e.Call == 0 || e.At < e.Call {
			t.Fatalf("event %s: want region eu, 1 token, called before answered", e)
		}
	}
	for quota, want := range map[string]string{"ok": "admit/", "limited": "deny/" + history.ReasonLimited, "down": "deny/" + history.ReasonUnavailable, "flaky": "admit/", "fallback": "admit/"} {
		if len(got[quota]) != 1 || got[quota][want] < 10 {
			t.Errorf("quota %s: decisions %v, want only %s (at least 10 in 0.4 s at 100/s)", quota, got[quota], want)
		}
	}
	if n := got["ok"]["admit/"] - got["limited"]["deny/"+history.ReasonLimited]; n < 15 {
		t.Errorf("the storm added %d requests to quota ok, want about 20", n)
	}
	fa.mu.Lock()
	defer fa.mu.Unlock()
	var twice int
	for _, n := range fa.seen {
		if n == 2 {
			twice++
		}
	}
	for _, e := range out.evs {
		if e.Kind == history.KindAdmit && (e.Replayed != (e.Quota == "flaky") || e.Degraded != (e.Quota == "fallback")) {
			t.Errorf("admission of %s recorded with replayed %t, degraded %t: want the agent's flags", e.Quota, e.Replayed, e.Degraded)
			break
		}
	}
	if twice != got["flaky"]["admit/"] {
		t.Errorf("%d request ids sent twice, want each of the %d flaky ones (retried with the same id, recorded once)", twice, got["flaky"]["admit/"])
	}
	if shed, none := g.Counts(); shed != 0 || none != 0 {
		t.Errorf("shed %d, never answered %d: want 0", shed, none)
	}
}
