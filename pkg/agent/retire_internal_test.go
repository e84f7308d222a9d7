package agent

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/allot-dev/allot/internal/testclock"
	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/policy"
)

// TestRetiredEnginesAreClosedAfterTheGrace: each adoption of a record from
// an allocator whose history differs replaces the engine; the replaced one
// stays open for the calls that loaded it (it still decides), and is closed
// at the first replacement retireGrace or more later, so repeated adoptions
// do not keep every engine, and its in-process state, until the agent
// stops. They used to be closed only by release.
func TestRetiredEnginesAreClosedAfterTheGrace(t *testing.T) {
	doc, err := policy.Parse([]byte(poolPolicy))
	if err != nil {
		t.Fatal(err)
	}
	st, err := admission.NewMemoryStore(admission.DefaultMemoryConfig(), nil)
	if err != nil {
		t.Fatal(err)
	}
	clock := testclock.New(time.Now())
	cfg := DefaultConfig()
	cfg.Region = "eu"
	a, err := New(cfg, nil, WithStore(st), WithPolicy(doc, 1), WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.release() })
	// decides reports whether eng still decides (false: closed).
	decides := func(eng *admission.Engine) bool {
		t.Helper()
		_, err := eng.Decide(context.Background(), &admission.Request{Descriptors: []policy.Entry{{Key: "tenant", Value: "z"}}})
		if err != nil && !errors.Is(err, admission.ErrClosed) {
			t.Fatal(err)
		}
		return err == nil
	}
	var replaced []*admission.Engine
	adopt := func() {
		t.Helper()
		replaced = append(replaced, a.engine.Load())
		if err := a.install(doc, 1, "digest-of-another-history", true); err != nil {
			t.Fatal(err)
		}
	}
	adopt()
	clock.Advance(retireGrace / 2)
	adopt()
	if !decides(replaced[0]) || !decides(replaced[1]) {
		t.Fatal("an engine replaced less than retireGrace ago was closed")
	}
	clock.Advance(retireGrace / 2)
	adopt()
	if decides(replaced[0]) {
		t.Fatal("the engine replaced retireGrace ago is still open after the next replacement")
	}
	if !decides(replaced[1]) || !decides(replaced[2]) || !decides(a.engine.Load()) {
		t.Fatal("an engine replaced less than retireGrace ago, or the one in force, was closed")
	}
	a.applyMu.Lock()
	n := len(a.retired)
	a.applyMu.Unlock()
	if n != 2 {
		t.Fatalf("%d engines kept retired, want the 2 of the last retireGrace", n)
	}
}

// TestPoolFallbackMarginFollowsTheLeaseMargin: an agent whose lease margin
// is larger than its engine's pool fallback margin raises the latter to it
// (the bound's assumption); a larger pool fallback margin stays.
func TestPoolFallbackMarginFollowsTheLeaseMargin(t *testing.T) {
	doc, err := policy.Parse([]byte(poolPolicy))
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct{ lease, pool, want time.Duration }{
		{lease: 400 * time.Millisecond, pool: 250 * time.Millisecond, want: 400 * time.Millisecond},
		{lease: 100 * time.Millisecond, pool: 250 * time.Millisecond, want: 250 * time.Millisecond},
	} {
		st, err := admission.NewMemoryStore(admission.DefaultMemoryConfig(), nil)
		if err != nil {
			t.Fatal(err)
		}
		cfg := DefaultConfig()
		cfg.Region = "eu"
		cfg.Lease.Margin, cfg.Engine.PoolFallbackMargin = tt.lease, tt.pool
		a, err := New(cfg, nil, WithStore(st), WithPolicy(doc, 1))
		if err != nil {
			t.Fatal(err)
		}
		got := a.cfg.Engine.PoolFallbackMargin
		_ = a.release()
		if got != tt.want {
			t.Errorf("lease margin %s, pool fallback margin %s: the engine's is %s, want %s", tt.lease, tt.pool, got, tt.want)
		}
	}
}
