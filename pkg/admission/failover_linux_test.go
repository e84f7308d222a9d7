//go:build linux

package admission_test

import (
	"context"
	"errors"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/admission"
)

// clusterNode is a cluster-enabled redis-server this file starts itself:
// redistest's clusters have no replicas.
type clusterNode struct {
	addr string
	cmd  *exec.Cmd
	done chan struct{}
}

// startClusterNode starts a cluster-enabled redis-server on a free port
// (with its bus port free too) and stops it when t ends; the process dies
// with the test binary (Pdeathsig).
func startClusterNode(t *testing.T, bin string) *clusterNode {
	t.Helper()
	for attempt := 0; attempt < 5; attempt++ {
		port, err := freeClusterPort()
		if err != nil {
			t.Fatal(err)
		}
		dir := t.TempDir()
		n := &clusterNode{addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), done: make(chan struct{})}
		n.cmd = exec.Command(bin, "--bind", "127.0.0.1", "--port", strconv.Itoa(port), "--dir", dir,
			"--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", filepath.Join(dir, "redis.log"),
			"--cluster-enabled", "yes", "--cluster-config-file", filepath.Join(dir, "nodes.conf"),
			"--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no",
			"--repl-diskless-sync-delay", "0") // a replica syncs at once, not after 5 s
		n.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := n.cmd.Start(); err != nil {
			t.Fatal(err)
		}
		go func() {
			_ = n.cmd.Wait()
			close(n.done)
		}()
		t.Cleanup(n.kill)
		if n.waitPing() {
			return n
		}
		n.kill() // most likely the port was taken meanwhile
	}
	t.Fatal("could not start a cluster node")
	return nil
}

func freeClusterPort() (int, error) {
	for i := 0; i < 50; i++ {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		port := ln.Addr().(*net.TCPAddr).Port
		bus, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port+10000)))
		_ = ln.Close()
		if err == nil {
			_ = bus.Close()
			return port, nil
		}
	}
	return 0, errors.New("no free port pair for a cluster node")
}

func (n *clusterNode) waitPing() bool {
	c := redis.NewClient(&redis.Options{Addr: n.addr, MaxRetries: -1})
	defer c.Close()
	for i := 0; i < 200; i++ {
		select {
		case <-n.done:
			return false
		default:
		}
		if c.Ping(context.Background()).Err() == nil {
			return true
		}
		time.Sleep(25 * time.Millisecond)
	}
	return false
}

func (n *clusterNode) kill() {
	_ = n.cmd.Process.Kill()
	<-n.done
}

func (n *clusterNode) do(args ...any) (any, error) {
	c := redis.NewClient(&redis.Options{Addr: n.addr, MaxRetries: -1})
	defer c.Close()
	return c.Do(context.Background(), args...).Result()
}

func (n *clusterNode) text(t *testing.T, args ...any) string {
	t.Helper()
	v, err := n.do(args...)
	if err != nil {
		t.Fatalf("%v on %s: %v", args, n.addr, err)
	}
	s, _ := v.(string)
	return s
}

// waitFor polls cond every 20 ms until it holds, failing t after d.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s", what, d)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestFailoverIsFollowedWithinSeconds: a master dies (SIGKILL) and its
// replica takes over (CLUSTER FAILOVER TAKEOVER). The dead master's
// tenants are decided by the store again within a second or two of the
// promotion: their failed calls made the client reload its slot map. The
// store used to leave the slot map alone on connection errors, and
// go-redis reloads it on a MOVED, which a dead node never sends, or once a
// minute (ClusterStateReloadInterval): a minute of fail-mode decisions.
func TestFailoverIsFollowedWithinSeconds(t *testing.T) {
	redistest.Require(t, shared.err)
	bin, cli, err := redistest.Lookup()
	redistest.Require(t, err)
	ctx := context.Background()
	var nodes []*clusterNode
	for i := 0; i < 4; i++ {
		nodes = append(nodes, startClusterNode(t, bin))
	}
	masters, replica := nodes[:3], nodes[3]
	args := []string{"--cluster", "create"}
	for _, n := range masters {
		args = append(args, n.addr)
	}
	if out, err := exec.Command(cli, append(args, "--cluster-replicas", "0", "--cluster-yes")...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	victim := masters[1]
	victimID := victim.text(t, "CLUSTER", "MYID")
	host, port, _ := net.SplitHostPort(victim.addr)
	replica.text(t, "CLUSTER", "MEET", host, port)
	waitFor(t, 10*time.Second, "the replica meets the cluster", func() bool {
		return strings.Count(replica.text(t, "CLUSTER", "NODES"), "\n") >= 4 &&
			strings.Contains(replica.text(t, "CLUSTER", "NODES"), victimID)
	})
	waitFor(t, 10*time.Second, "the replica replicates the victim", func() bool {
		_, err := replica.do("CLUSTER", "REPLICATE", victimID)
		return err == nil
	})
	waitFor(t, 15*time.Second, "the replica in sync, known to every node, and the cluster ok", func() bool {
		if !strings.Contains(replica.text(t, "INFO", "replication"), "master_link_status:up") {
			return false
		}
		for _, n := range nodes {
			// A master that does not know the replica as the victim's
			// would ignore its takeover.
			if !strings.Contains(n.text(t, "CLUSTER", "INFO"), "cluster_state:ok") ||
				!strings.Contains(n.text(t, "CLUSTER", "NODES"), " slave "+victimID) && n != replica {
				return false
			}
		}
		return true
	})

	addrs := make([]string, len(masters))
	for i, n := range masters {
		addrs[i] = n.addr
	}
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, ContextTimeoutEnabled: true})
	t.Cleanup(func() { client.Close() })
	st, err := admission.NewRedisStore(client, admission.DefaultRedisConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	cfg := admission.DefaultConfig()
	cfg.Namespace = namespace()
	e, err := admission.New(cfg, st, parse(t, shardPolicy), 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	by := tenantsByMaster(t, client, len(masters), 2)
	var tenants []string
	for _, ts := range by {
		tenants = append(tenants, ts...)
	}
	for _, tn := range tenants {
		if d, _ := e.Decide(ctx, tenantReq(tn)); d == nil || d.Source != admission.SourceStore {
			t.Fatalf("warm-up decision of %s not made by the store: %+v", tn, d)
		}
	}

	// Load on every tenant; the first store decision for the victim's
	// tenants after the promotion is recorded.
	var (
		mu         sync.Mutex
		promotedAt time.Time
		back       time.Time // the first store decision of a victim's tenant started after promotedAt
		stop       = make(chan struct{})
		wg         sync.WaitGroup
	)
	victims := map[string]bool{}
	for _, tn := range by[victim.addr] {
		victims[tn] = true
	}
	for _, tn := range tenants {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				start := time.Now()
				d, err := e.Decide(ctx, tenantReq(tn))
				if err != nil {
					t.Error(err)
					return
				}
				if victims[tn] && d.Source == admission.SourceStore {
					mu.Lock()
					if !promotedAt.IsZero() && start.After(promotedAt) && back.IsZero() {
						back = time.Now()
					}
					mu.Unlock()
				}
				time.Sleep(2 * time.Millisecond)
			}
		}()
	}
	defer func() {
		close(stop)
		wg.Wait()
	}()
	time.Sleep(200 * time.Millisecond)
	victim.kill()
	time.Sleep(300 * time.Millisecond) // the store meets the dead master
	replica.text(t, "CLUSTER", "FAILOVER", "TAKEOVER")
	waitFor(t, 5*time.Second, "the replica promoted", func() bool {
		return strings.Contains(replica.text(t, "INFO", "replication"), "role:master")
	})
	mu.Lock()
	promotedAt = time.Now()
	mu.Unlock()

	const within = 5 * time.Second // go-redis's own reload would come after a minute
	deadline := promotedAt.Add(within)
	for {
		mu.Lock()
		b := back
		mu.Unlock()
		if !b.IsZero() {
			t.Logf("the dead master's tenants were decided by the store again %s after the promotion", b.Sub(promotedAt).Round(time.Millisecond))
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the dead master's tenants were not decided by the store within %s of the promotion", within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
