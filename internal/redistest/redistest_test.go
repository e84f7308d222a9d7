package redistest_test

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/allot-dev/allot/internal/redistest"
)

func TestServerStartPauseClose(t *testing.T) {
	s := redistest.NewServer(t)
	c := s.Client()
	defer c.Close()
	ctx := context.Background()
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if got := c.Get(ctx, "k").Val(); got != "v" {
		t.Fatalf("GET k = %q, want v", got)
	}

	if err := s.Pause(); err != nil {
		t.Fatal(err)
	}
	tctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	pc := redis.NewClient(&redis.Options{Addr: s.Addr(), ContextTimeoutEnabled: true, MaxRetries: -1})
	err := pc.Ping(tctx).Err()
	cancel()
	pc.Close()
	if err == nil {
		t.Fatal("PING to a paused server succeeded")
	}
	if err := s.Resume(); err != nil {
		t.Fatal(err)
	}
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING after resume: %v", err)
	}

	addr := s.Addr()
	s.Close()
	s.Close() // idempotent
	if conn, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		conn.Close()
		t.Fatalf("%s still accepts connections after Close", addr)
	}
}

func TestClusterCrossSlot(t *testing.T) {
	cl := redistest.NewCluster(t)
	if len(cl.Nodes) != 3 {
		t.Fatalf("%d nodes, want 3", len(cl.Nodes))
	}
	c := cl.Client()
	defer c.Close()
	ctx := context.Background()
	// Keys sharing a hash tag live in one slot; keys without it are spread.
	for i := 0; i < 30; i++ {
		if err := c.Set(ctx, fmt.Sprintf("k%d", i), i, 0).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.MSet(ctx, "{t:atlas}:a", 1, "{t:atlas}:b", 2).Err(); err != nil {
		t.Fatalf("same-tag MSET: %v", err)
	}
	if err := c.MSet(ctx, "a-key", 1, "b-key", 2).Err(); err == nil {
		t.Fatal("cross-slot MSET succeeded; want CROSSSLOT")
	}
	if err := cl.FlushAll(ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := c.DBSize(ctx).Result(); err == nil && n != 0 {
		t.Fatalf("DBSIZE after FlushAll = %d", n)
	}
}

func TestClosedAddrRefuses(t *testing.T) {
	addr, err := redistest.ClosedAddr()
	if err != nil {
		t.Fatal(err)
	}
	if conn, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		conn.Close()
		t.Fatalf("%s accepted a connection", addr)
	}
}
