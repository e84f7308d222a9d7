package allocator

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/hashicorp/raft"
	"go.uber.org/zap/zaptest"
)

// TestRaftErrorMapping checks the one mapping of Raft's errors: those after
// which another node (or a retry) may succeed are Unavailable with the
// leader hint, a configuration Raft refused is FailedPrecondition with
// Raft's reason, and anything else stays Internal.
func TestRaftErrorMapping(t *testing.T) {
	tc := newTestCluster(t, 1)
	l := tc.leader()
	s := NewServer(l, zaptest.NewLogger(t), NewMetrics(nil))
	tests := []struct {
		name     string
		give     error
		sentinel error
		code     connect.Code
	}{
		{"not leader", raft.ErrNotLeader, ErrNotLeader, connect.CodeUnavailable},
		{"transfer in progress", raft.ErrLeadershipTransferInProgress, ErrNotLeader, connect.CodeUnavailable},
		{"leadership lost", raft.ErrLeadershipLost, ErrUnknownOutcome, connect.CodeUnavailable},
		{"enqueue timeout", raft.ErrEnqueueTimeout, ErrUnknownOutcome, connect.CodeUnavailable},
		{"shutdown", raft.ErrRaftShutdown, ErrUnknownOutcome, connect.CodeUnavailable},
		{"duplicate address", fmt.Errorf("found duplicate address in configuration: %v", "n1"), ErrMembershipRefused, connect.CodeFailedPrecondition},
		{"no voter left", fmt.Errorf("need at least one voter in configuration: %v", "{[]}"), ErrMembershipRefused, connect.CodeFailedPrecondition},
		{"configuration changed", fmt.Errorf("configuration changed since %v (latest is %v)", 3, 5), ErrMembershipRefused, connect.CodeFailedPrecondition},
		{"other", errors.New("disk full"), nil, connect.CodeInternal},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := raftError("op", tt.give)
			if tt.sentinel != nil && !errors.Is(got, tt.sentinel) {
				t.Errorf("raftError(%v) = %v, want %v", tt.give, got, tt.sentinel)
			}
			ce := s.toConnect("Test", got)
			if connect.CodeOf(ce) != tt.code {
				t.Errorf("code %v, want %v (%v)", connect.CodeOf(ce), tt.code, ce)
			}
			if tt.code == connect.CodeUnavailable && LeaderHintOf(ce) != tc.addrs[0] {
				t.Errorf("leader hint %q, want %q", LeaderHintOf(ce), tc.addrs[0])
			}
			if tt.code == connect.CodeFailedPrecondition && !strings.Contains(ce.Error(), tt.give.Error()) {
				t.Errorf("message %q lost Raft's reason %q", ce, tt.give)
			}
		})
	}
	if raftError("op", nil) != nil {
		t.Error("raftError(nil) != nil")
	}
}

// TestRaftErrorMapsMembershipRefusals makes the raft in go.mod refuse
// configuration changes (it has no sentinels for them, raftError matches
// their messages): each is ErrMembershipRefused, FailedPrecondition.
func TestRaftErrorMapsMembershipRefusals(t *testing.T) {
	tc := newTestCluster(t, 1)
	l := tc.leader()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	// n1's own Raft address, under another id.
	if err := l.AddNonvoter(ctx, Peer{ID: "x", RaftAddr: "n1", APIAddr: closedAddr(t)}); !errors.Is(err, ErrMembershipRefused) {
		t.Errorf("a duplicate address: %v, want ErrMembershipRefused", err)
	}
	if err := l.RemoveServer(ctx, "n1"); !errors.Is(err, ErrMembershipRefused) {
		t.Errorf("removing the last voter: %v, want ErrMembershipRefused", err)
	}
	if !l.IsLeader() {
		t.Fatal("n1 lost the leadership")
	}
}

// TestBarrierDuringLeadershipTransfer: a read barrier while the leader
// hands its leadership over is refused by Raft; it must come back as
// ErrNotLeader (Unavailable, retried by clients), not an internal error.
func TestBarrierDuringLeadershipTransfer(t *testing.T) {
	// Raft gives a transfer an election timeout to complete: a long one
	// keeps this transfer (to a node that cannot catch up) under way.
	tc := newTestCluster(t, 3, func(c *Config) { c.ElectionTimeout = 2 * time.Second })
	l := tc.leader()
	target := tc.nodes[(tc.index(l)+1)%3]
	tc.isolate(tc.index(target))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := l.Barrier(ctx); err != nil { // an entry the target lacks
		t.Fatal(err)
	}
	f := l.Raft().LeadershipTransferToServer(raft.ServerID(target.ID()), raft.ServerAddress(target.Config().RaftAddr))
	time.Sleep(100 * time.Millisecond)
	err := l.Barrier(ctx)
	if !errors.Is(err, ErrNotLeader) {
		t.Errorf("Barrier during a leadership transfer: %v, want ErrNotLeader", err)
	}
	s := NewServer(l, zaptest.NewLogger(t), NewMetrics(nil))
	if code := connect.CodeOf(s.toConnect("Test", err)); code != connect.CodeUnavailable {
		t.Errorf("code %v, want Unavailable", code)
	}
	if ferr := f.Error(); ferr == nil {
		t.Log("the transfer completed; the barrier was refused while it was under way")
	}
}
