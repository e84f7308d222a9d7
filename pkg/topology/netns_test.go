package topology

import (
	"context"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"
)

// labOrSkip builds a lab with a prefix and subnet of its own (not the chaos
// suite's), or skips without root; in CI it fails instead.
func labOrSkip(t *testing.T, ctx context.Context) *Lab {
	t.Helper()
	if err := NetnsSupport(ctx); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("network namespaces are required in CI: %v", err)
		}
		t.Skipf("skipping: %v", err)
	}
	l, err := NewLab(ctx, LabConfig{Prefix: "allott-", Subnet: "10.78.0", LockWait: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func leftovers(t *testing.T, ctx context.Context, prefix string) []string {
	t.Helper()
	var found []string
	for _, args := range [][]string{{"netns", "list"}, {"-o", "link", "show"}} {
		out, err := run(ctx, "ip", args...)
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(out), "\n") {
			if strings.Contains(line, prefix) {
				found = append(found, strings.TrimSpace(line))
			}
		}
	}
	return found
}

func TestLabPartitionAndSweep(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	l := labOrSkip(t, ctx)
	a, err := l.AddHost(ctx, "a", 11)
	if err != nil {
		t.Fatal(err)
	}
	b, err := l.AddHost(ctx, "b", 12)
	if err != nil {
		t.Fatal(err)
	}

	// A listener inside a, a dial from inside b.
	ln, err := a.Listen("tcp", a.IP+":7777")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = io.WriteString(c, "hi")
			c.Close()
		}
	}()
	dial := func() error {
		dctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		defer cancel()
		c, err := b.DialContext(dctx, nil, "tcp", a.IP+":7777")
		if err != nil {
			return err
		}
		defer c.Close()
		_, err = io.ReadAll(c)
		return err
	}
	if err := dial(); err != nil {
		t.Fatalf("b cannot reach a: %v", err)
	}
	if _, err := net.DialTimeout("tcp", a.IP+":7777", 500*time.Millisecond); err != nil {
		t.Fatalf("the root namespace cannot reach a over the bridge: %v", err)
	}
	// A partition is a DROP rule inside b.
	if err := b.IPTables(ctx, "-I", "OUTPUT", "-d", a.IP, "-j", "DROP"); err != nil {
		t.Fatal(err)
	}
	if err := dial(); err == nil {
		t.Fatal("b reached a through a DROP rule")
	}
	if err := b.IPTables(ctx, "-D", "OUTPUT", "-d", a.IP, "-j", "DROP"); err != nil {
		t.Fatal(err)
	}
	if err := dial(); err != nil {
		t.Fatalf("b cannot reach a after the heal: %v", err)
	}

	// A crashed run: a process left inside a, the lab never closed. The
	// next lab with the same prefix sweeps it all away.
	p, err := a.StartProcess("sleeper", "sleep", []string{"60"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	l.unlock() // what a crash does to the lock (the kernel drops it)
	l2, err := NewLab(ctx, LabConfig{Prefix: "allott-", Subnet: "10.78.0", LockWait: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.Done():
	case <-time.After(5 * time.Second):
		t.Error("the sweep left the process of the crashed run running")
		p.Kill()
	}
	for _, x := range leftovers(t, ctx, "allott-") {
		if !strings.Contains(x, "allott-br") { // l2's own bridge
			t.Errorf("left over after the sweep: %s", x)
		}
	}
	if err := l2.Close(); err != nil {
		t.Fatal(err)
	}
	if got := leftovers(t, ctx, "allott-"); len(got) > 0 {
		t.Errorf("left over after Close: %v", got)
	}
}
