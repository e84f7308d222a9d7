package admission_test

import (
	"bytes"
	"context"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/admission"
)

// replyDropper relays connections to Redis, except that on the first
// connection that sends an EVALSHA it drops Redis's answer and closes the
// connection: the script ran, and its caller never hears of it (a
// connection reset after the request left, a proxy or a failover closing
// it). Later connections are relayed whole.
type replyDropper struct {
	ln      net.Listener
	upAddr  string
	dropped atomic.Bool
	conns   atomic.Int32
	wg      sync.WaitGroup
}

func newReplyDropper(t *testing.T, upstream string) *replyDropper {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	d := &replyDropper{ln: ln, upAddr: upstream}
	d.wg.Add(1)
	go d.accept()
	t.Cleanup(func() {
		ln.Close()
		d.wg.Wait()
	})
	return d
}

func (d *replyDropper) accept() {
	defer d.wg.Done()
	for {
		down, err := d.ln.Accept()
		if err != nil {
			return
		}
		d.conns.Add(1)
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			d.serve(down)
		}()
	}
}

func (d *replyDropper) serve(down net.Conn) {
	defer down.Close()
	up, err := net.Dial("tcp", d.upAddr)
	if err != nil {
		return
	}
	defer up.Close()
	var eval atomic.Bool // this connection sent an EVALSHA
	go func() {
		mark := []byte("$7\r\nevalsha\r\n")
		buf := make([]byte, 64<<10)
		var seen []byte // the last bytes sent, so that a mark split across reads is found
		for {
			n, err := down.Read(buf)
			if n > 0 {
				seen = append(seen, bytes.ToLower(buf[:n])...)
				if bytes.Contains(seen, mark) {
					eval.Store(true)
				}
				if len(seen) > len(mark) {
					seen = append(seen[:0], seen[len(seen)-len(mark):]...)
				}
				if _, werr := up.Write(buf[:n]); werr != nil {
					return
				}
			}
			if err != nil {
				up.Close()
				return
			}
		}
	}()
	buf := make([]byte, 64<<10)
	for {
		n, err := up.Read(buf)
		if n > 0 {
			if eval.Load() && d.dropped.CompareAndSwap(false, true) {
				return // the answer to the EVALSHA: dropped, and the connection closed
			}
			if _, werr := down.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// TestLostReplyIsNotRetried: a decision whose reply is lost after the
// script ran must not run again. go-redis retries a pipeline that fails
// with EOF on a new connection (MaxRetries, 3 by default), which would
// debit a decision twice (and give a refund back twice); the store's
// commands refuse retries, so the call fails, the rule's fail mode
// decides, and the counter holds one debit.
func TestLostReplyIsNotRetried(t *testing.T) {
	redistest.Require(t, shared.err)
	ctx := context.Background()
	direct := standaloneClient(t)
	drop := newReplyDropper(t, shared.redis.Addr())
	// go-redis's defaults: MaxRetries 3, as a gateway that does not think of
	// it would have.
	viaProxy := redis.NewClient(&redis.Options{Addr: drop.ln.Addr().String()})
	t.Cleanup(func() { viaProxy.Close() })
	doc := parse(t, `
name: lost-reply
rules:
  - {name: tenant, scope: tenant, match: [{key: tenant}], kind: fixed_window, limit: 10, window: 1h, fail_mode: closed}
`)
	ns := namespace()
	engine := func(c redis.UniversalClient) *admission.Engine {
		st, err := admission.NewRedisStore(c, admission.DefaultRedisConfig())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		if err := st.Load(ctx); err != nil {
			t.Fatal(err)
		}
		cfg := admission.DefaultConfig()
		cfg.Namespace = ns
		cfg.NegativeCacheTTL = 0
		cfg.StoreTimeout = 2 * time.Second
		e, err := admission.New(cfg, st, doc, 1, admission.WithClock(newFakeClock(t0)))
		if err != nil {
			t.Fatal(err)
		}
		admission.UseStoreClock(e)
		t.Cleanup(func() { e.Close() })
		return e
	}
	lossy, sound := engine(viaProxy), engine(direct)
	req := &admission.Request{Descriptors: entries("tenant", "lost")}
	d, err := lossy.Decide(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if !drop.dropped.Load() {
		t.Fatal("the proxy dropped no reply: the test did not run its fault")
	}
	if d.Outcome != admission.Unavailable {
		t.Errorf("decision with its reply lost: %v by %q; want unavailable (fail mode closed)", d.Outcome, d.Rule)
	}
	d, err = sound.Decide(ctx, req)
	if err != nil || !d.Allowed() {
		t.Fatalf("second decision: %+v, %v", d, err)
	}
	if d.Remaining != 8 {
		t.Errorf("after the lost decision and one more, %d of 10 remain; want 8 (the lost one debited once, not again on a retry); the proxy saw %d connections",
			d.Remaining, drop.conns.Load())
	}
}
