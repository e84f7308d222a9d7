package allocator

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"go.uber.org/zap"
)

func validConfig() Config {
	c := DefaultConfig()
	c.NodeID, c.RaftAddr, c.APIAddr = "a1", "127.0.0.1:7001", "127.0.0.1:8001"
	return c
}

// TestConfigValidateNamesFields checks that each bad setting is reported on
// its own, by name and value, and that every error is an ErrConfig.
func TestConfigValidateNamesFields(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(*Config)
		want   []string
	}{
		{"election timeout", func(c *Config) { c.ElectionTimeout = -time.Second },
			[]string{"ElectionTimeout must be positive, got -1s"}},
		{"heartbeat timeout", func(c *Config) { c.HeartbeatTimeout, c.LeaderLeaseTimeout = 0, time.Millisecond },
			[]string{"HeartbeatTimeout must be positive, got 0s"}},
		{"leader lease timeout", func(c *Config) { c.LeaderLeaseTimeout = -2 * time.Millisecond },
			[]string{"LeaderLeaseTimeout must be positive, got -2ms"}},
		{"two timeouts", func(c *Config) { c.ElectionTimeout, c.LeaderLeaseTimeout = 0, -time.Second },
			[]string{"ElectionTimeout must be positive, got 0s", "LeaderLeaseTimeout must be positive, got -1s"}},
		{"watch limits", func(c *Config) { c.MaxWatchStreams, c.WatchSendTimeout = 0, -time.Second },
			[]string{"MaxWatchStreams must be positive, got 0", "WatchSendTimeout must be positive, got -1s"}},
		{"drift", func(c *Config) { c.MaxDriftPPM = -5 },
			[]string{"MaxDriftPPM must not be negative, got -5"}},
		{"gateways", func(c *Config) { c.GatewaysPerRegion = 0 },
			[]string{"GatewaysPerRegion must be at least 1, got 0"}},
		{"every bound assumption", func(c *Config) {
			c.LeaseMargin, c.MaxDriftPPM, c.MaxOneWayDelay = -time.Millisecond, -1, -2*time.Millisecond
			c.MaxLeaderSkew, c.StoreReplicationLag = -3*time.Millisecond, -time.Second
		}, []string{
			"LeaseMargin must not be negative, got -1ms", "MaxDriftPPM must not be negative, got -1",
			"MaxOneWayDelay must not be negative, got -2ms", "MaxLeaderSkew must not be negative, got -3ms",
			"StoreReplicationLag must not be negative, got -1s",
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := validConfig()
			tt.mutate(&c)
			err := c.Validate()
			if !errors.Is(err, ErrConfig) {
				t.Fatalf("Validate() = %v, want an ErrConfig", err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("%q does not say %q", err.Error(), w)
				}
			}
			if n := strings.Count(err.Error(), "\n") + 1; n != len(tt.want) {
				t.Errorf("%d errors in %q, want %d", n, err.Error(), len(tt.want))
			}
		})
	}
	if err := validConfig().Validate(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
}

// TestConfigValidatePeersNeedBootstrap checks that initial members given
// without Bootstrap are refused rather than silently ignored.
func TestConfigValidatePeersNeedBootstrap(t *testing.T) {
	c := validConfig()
	c.Peers = []Peer{{ID: "a1", RaftAddr: c.RaftAddr, APIAddr: c.APIAddr}, {ID: "a2", RaftAddr: "127.0.0.1:7002", APIAddr: "127.0.0.1:8002"}}
	err := c.Validate()
	if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "Bootstrap") {
		t.Fatalf("Validate() = %v, want an ErrConfig naming Bootstrap", err)
	}
	c.Bootstrap = true
	if err := c.Validate(); err != nil {
		t.Fatalf("with Bootstrap: %v", err)
	}
}

// TestRunRejectsBootstrapWithJoin checks that a node is not both the founder
// of a new cluster and a joiner of an existing one.
func TestRunRejectsBootstrapWithJoin(t *testing.T) {
	c := validConfig()
	c.RaftAddr, c.APIAddr, c.DataDir = "127.0.0.1:0", "127.0.0.1:0", t.TempDir()
	c.Bootstrap = true
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	err := Run(ctx, c, RunOptions{Join: "127.0.0.1:8002"}, zap.NewNop())
	if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "Join") || !strings.Contains(err.Error(), "Bootstrap") {
		t.Fatalf("Run() = %v, want an ErrConfig naming Join and Bootstrap", err)
	}
}

// TestParsePeerChecksAddresses: a -peer with an address other nodes cannot
// dial is refused at start-up, as AddMember refuses it later.
func TestParsePeerChecksAddresses(t *testing.T) {
	if p, err := ParsePeer("a1=127.0.0.1:7001=127.0.0.1:8001"); err != nil || p.RaftAddr != "127.0.0.1:7001" || p.APIAddr != "127.0.0.1:8001" {
		t.Fatalf("a good peer: %+v, %v", p, err)
	}
	for _, bad := range []string{"a1=not an addr=127.0.0.1:8001", "a1=127.0.0.1:7001=host", "a1=0.0.0.0:7001=127.0.0.1:8001", "a1=127.0.0.1:0=127.0.0.1:8001"} {
		if _, err := ParsePeer(bad); err == nil {
			t.Errorf("ParsePeer(%q) accepted", bad)
		}
	}
}

// TestRaftConfigCapsAppendEntries: a grouped Acquire entry may be several
// MB, and a follower catching up gets up to MaxAppendEntries of them in one
// message; 512 could make that GBs.
func TestRaftConfigCapsAppendEntries(t *testing.T) {
	rc := raftConfig(validConfig(), zap.NewNop())
	if rc.MaxAppendEntries != 64 {
		t.Errorf("MaxAppendEntries = %d, want 64", rc.MaxAppendEntries)
	}
	if err := raft.ValidateConfig(rc); err != nil {
		t.Fatal(err)
	}
}

// TestRunEndsOpenWatches stops a node while a WatchPolicy stream is open:
// the graceful shutdown ends the stream and Run returns nil at once. It
// used to wait for the watch until ShutdownGrace ran out and return
// "context deadline exceeded", so the command exited 1 on every SIGTERM
// while agents were connected.
func TestRunEndsOpenWatches(t *testing.T) {
	api, raftAddr := closedAddr(t), closedAddr(t)
	cfg := fastConfig("w1", api)
	cfg.RaftAddr, cfg.DataDir, cfg.Bootstrap = raftAddr, t.TempDir(), true
	cfg.Peers = []Peer{{ID: "w1", RaftAddr: raftAddr, APIAddr: api}}
	const grace = 30 * time.Second
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg, RunOptions{ShutdownGrace: grace}, zap.NewNop()) }()

	publishTest(t, []string{api}, clusterPolicy, 1) // the client retries until the node leads
	c, err := NewClient([]string{api})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	wctx, wcancel := context.WithTimeout(context.Background(), time.Minute)
	defer wcancel()
	stream, err := c.Operator().WatchPolicy(wctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	if !stream.Receive() {
		t.Fatalf("watch: %v", stream.Err())
	}

	start := time.Now()
	stop()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run() = %v after %s, want nil", err, time.Since(start))
		}
		t.Logf("Run returned after %s", time.Since(start).Round(time.Millisecond))
	case <-time.After(grace / 2):
		wcancel() // let Run finish before the test ends
		<-done
		t.Fatalf("Run did not return within %s of the stop with a watch open (grace %s)", grace/2, grace)
	}
	if stream.Receive() {
		t.Errorf("the stream delivered version %d after the shutdown", stream.Msg().GetPolicy().GetVersion())
	}
}
