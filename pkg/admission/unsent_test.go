package admission_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/allot-dev/allot/pkg/admission"
)

// TestUnsent: only errors that prove a store call never left the engine
// count as unsent; a timeout leaves the outcome unknown (the call may have
// been sent). A caller that gave up before its call was sent is unsent: the
// batcher drops such a call (TestAbandonedCallsAreNotSent).
func TestUnsent(t *testing.T) {
	// A port nobody listens on: the connection is refused.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	t.Cleanup(func() { c.Close() })
	st, err := admission.NewRedisStore(c, admission.DefaultRedisConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	cfg := admission.DefaultConfig()
	cfg.Namespace = namespace()
	e, err := admission.New(cfg, st, northstar(t), 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()

	_, refused := e.DepositChunk(ctx, "p-tenant-atlas", "g-1", 10, time.Second)
	_, badGrant := e.DepositChunk(ctx, "p-tenant-atlas", "", 10, time.Second)
	_, unknown := e.DepositChunk(ctx, "no-such-quota", "g-1", 10, time.Second)
	gone, stop := context.WithCancel(ctx)
	stop()
	_, canceled := e.DepositChunk(gone, "p-tenant-atlas", "g-2", 10, time.Second)
	tests := []struct {
		name string
		err  error
		want bool
	}{
		{"connection refused", refused, true},
		{"bad grant", badGrant, true},
		{"unknown quota", unknown, true},
		{"closed engine", fmt.Errorf("deposit: %w", admission.ErrClosed), true},
		{"caller gave up before the call", canceled, true},
		{"timeout", fmt.Errorf("%w: %w", admission.ErrUnavailable, context.DeadlineExceeded), false},
		{"reply error", errors.New("ERR something"), false},
		{"no error", nil, false},
	}
	for _, tt := range tests {
		if tt.name != "no error" && tt.err == nil {
			t.Fatalf("%s: no error from a call that must fail", tt.name)
		}
		if got := admission.Unsent(tt.err); got != tt.want {
			t.Errorf("%s: Unsent(%v) = %v, want %v", tt.name, tt.err, got, tt.want)
		}
	}
}
