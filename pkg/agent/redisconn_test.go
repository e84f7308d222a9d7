package agent_test

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/agent"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

func TestRedisConnValidate(t *testing.T) {
	if err := agent.DefaultRedisConn().Validate(); err != nil {
		t.Fatalf("default: %v", err)
	}
	tests := []struct {
		name string
		edit func(*agent.RedisConn)
		want string
	}{
		{"unknown mode", func(c *agent.RedisConn) { c.Mode = "replicated" }, "Mode must be"},
		{"standalone, two addresses", func(c *agent.RedisConn) { c.Addrs = []string{"a:1", "b:2"} }, "exactly one address"},
		{"cluster, no seeds", func(c *agent.RedisConn) { c.Mode, c.Addrs = agent.RedisCluster, nil }, "Addrs: cluster mode needs"},
		{"no port", func(c *agent.RedisConn) { c.Addrs = []string{"redis.internal"} }, "Addrs[0]"},
		{"sentinel without a name", func(c *agent.RedisConn) { c.Mode = agent.RedisSentinel }, "MasterName"},
		{"name outside sentinel", func(c *agent.RedisConn) { c.MasterName = "allot" }, "sentinel mode only"},
		{"CA without TLS", func(c *agent.RedisConn) { c.CAFile = "/etc/ca.pem" }, "need TLS"},
		{"client certificate without TLS", func(c *agent.RedisConn) { c.CertFile, c.KeyFile = "/etc/c.pem", "/etc/c.key" }, "need TLS"},
		{"certificate without its key", func(c *agent.RedisConn) { c.TLS, c.CertFile = true, "/etc/c.pem" }, "KeyFile: CertFile needs its key"},
		{"key without its certificate", func(c *agent.RedisConn) { c.TLS, c.KeyFile = true, "/etc/c.key" }, "CertFile: KeyFile needs"},
		{"no pool", func(c *agent.RedisConn) { c.PoolSize = 0 }, "PoolSize"},
		{"no dial timeout", func(c *agent.RedisConn) { c.DialTimeout = 0 }, "DialTimeout"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := agent.DefaultRedisConn()
			tc.edit(&c)
			err := c.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Validate() = %v; want an error containing %q", err, tc.want)
			}
			if _, err := c.Client(); err == nil {
				t.Fatal("Client() built a client from a config Validate refuses")
			}
		})
	}
	c := agent.DefaultRedisConn()
	c.TLS, c.CAFile = true, t.TempDir()+"/missing.pem"
	if _, err := c.Client(); err == nil || !strings.Contains(err.Error(), "CAFile") {
		t.Fatalf("missing CA file: %v", err)
	}
	c = agent.DefaultRedisConn()
	c.TLS, c.CertFile, c.KeyFile = true, t.TempDir()+"/missing.pem", t.TempDir()+"/missing.key"
	if _, err := c.Client(); err == nil || !strings.Contains(err.Error(), "CertFile and KeyFile") {
		t.Fatalf("missing client certificate: %v", err)
	}
}

// connAgent runs a standalone agent on apiPolicy over the client conn
// builds. Its decide checks one request of tenant and returns the bucket's
// remaining tokens, failing the test unless the bucket allowed it.
func connAgent(t *testing.T, conn agent.RedisConn) (rdb redis.UniversalClient, decide func(tenant string) int64, try func(tenant string) (*allotv1.CheckResponse, error)) {
	t.Helper()
	rdb, err := conn.Client()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	a := runAgent(t, newAgent(t, testConfig("eu"), rdb, agent.WithPolicy(mustParse(t, apiPolicy), 0))).Agent
	s := serve(t, a)
	try = func(tenant string) (*allotv1.CheckResponse, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		resp, err := s.connect.Check(ctx, connect.NewRequest(&allotv1.CheckRequest{Entries: entries("tenant", tenant, "user", "u1")}))
		if err != nil {
			return nil, err
		}
		return resp.Msg, nil
	}
	decide = func(tenant string) int64 {
		t.Helper()
		r, err := try(tenant)
		if err != nil || !r.Allowed || r.Rule != "bucket" {
			t.Fatalf("check of %s: %+v %v; want allowed by bucket", tenant, r, err)
		}
		return r.Remaining
	}
	return rdb, decide, try
}

// wantRefused fails t unless a PING through conn's client fails with an
// error containing want.
func wantRefused(t *testing.T, conn agent.RedisConn, want string) {
	t.Helper()
	c, err := conn.Client()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.Ping(context.Background()).Err(); err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("ping: %v; want an error containing %q", err, want)
	}
}

// TestRedisConnPassword: a password-protected Redis serves the agent that
// has the password; a client without it is refused by Redis.
func TestRedisConnPassword(t *testing.T) {
	srv := redistest.NewServerWith(t, redistest.ServerOptions{Password: "s3cret"})
	conn := agent.DefaultRedisConn()
	conn.Addrs = []string{srv.Addr()}
	wantRefused(t, conn, "NOAUTH") // without the password
	conn.Password = "s3cret"
	_, decide, _ := connAgent(t, conn)
	for want := int64(99); want >= 97; want-- {
		if got := decide("acme"); got != want {
			t.Fatalf("remaining %d, want %d", got, want)
		}
	}
}

// TestRedisConnCluster: from one seed node the agent decides for tenants
// whose keys live on every master of a 3-master Redis Cluster.
func TestRedisConnCluster(t *testing.T) {
	cl := redistest.NewCluster(t)
	conn := agent.DefaultRedisConn()
	conn.Mode, conn.Addrs = agent.RedisCluster, cl.Addrs()[:1]
	rdb, decide, _ := connAgent(t, conn)
	if _, ok := rdb.(*redis.ClusterClient); !ok {
		t.Fatalf("cluster mode built a %T", rdb)
	}
	for i := 0; i < 30; i++ {
		tenant := "t" + string(rune('a'+i%26)) + string(rune('a'+i/26))
		if got := decide(tenant); got != 99 {
			t.Fatalf("%s: remaining %d, want 99", tenant, got)
		}
		if got := decide(tenant); got != 98 {
			t.Fatalf("%s again: remaining %d, want 98", tenant, got)
		}
	}
	ctx := context.Background()
	for _, n := range cl.Nodes {
		c := n.Client()
		keys, err := c.DBSize(ctx).Result()
		c.Close()
		if err != nil {
			t.Fatal(err)
		}
		if keys == 0 {
			t.Errorf("master %s holds no key: 30 tenants' hash tags should spread over all three", n.Addr())
		}
	}
}

// TestRedisConnSentinelFailover: through a Sentinel the agent finds the
// primary, and after a failover it decides on the promoted replica, where
// the counters replicated before the failover still are.
func TestRedisConnSentinelFailover(t *testing.T) {
	primary := redistest.NewServer(t)
	replica := redistest.NewServerWith(t, redistest.ServerOptions{ReplicaOf: primary.Addr()})
	sentinel := redistest.NewServerWith(t, redistest.ServerOptions{Sentinel: &redistest.SentinelOptions{MasterName: "allot-eu", Primary: primary.Addr()}})
	ctx := context.Background()
	pc := primary.Client()
	defer pc.Close()
	sc := redis.NewSentinelClient(&redis.Options{Addr: sentinel.Addr()})
	defer sc.Close()
	// The Sentinel learns the replica from the primary's INFO.
	waitFor(t, 20*time.Second, "the sentinel to see the replica", func() bool {
		r, err := sc.Replicas(ctx, "allot-eu").Result()
		return err == nil && len(r) == 1
	})

	conn := agent.DefaultRedisConn()
	conn.Mode, conn.Addrs, conn.MasterName = agent.RedisSentinel, []string{sentinel.Addr()}, "allot-eu"
	_, decide, try := connAgent(t, conn)
	for want := int64(99); want >= 95; want-- {
		if got := decide("acme"); got != want {
			t.Fatalf("remaining %d, want %d", got, want)
		}
	}
	// The debits reach the replica before the failover: this test is about
	// following the primary, not about losing acknowledged writes (which an
	// asynchronous failover can; see RedisSentinel).
	if n, err := pc.Wait(ctx, 1, 5*time.Second).Result(); err != nil || n != 1 {
		t.Fatalf("WAIT for the replica: %d %v", n, err)
	}
	if err := sc.Failover(ctx, "allot-eu").Err(); err != nil {
		t.Fatalf("SENTINEL FAILOVER: %v", err)
	}
	waitFor(t, 30*time.Second, "the sentinel to name the replica primary", func() bool {
		a, err := sc.GetMasterAddrByName(ctx, "allot-eu").Result()
		return err == nil && len(a) == 2 && a[0]+":"+a[1] == replica.Addr()
	})
	rc := replica.Client()
	defer rc.Close()
	waitFor(t, 30*time.Second, "the replica to take the primary role", func() bool {
		role, err := rc.Do(ctx, "ROLE").Slice()
		return err == nil && len(role) > 0 && role[0] == "master"
	})
	before, err := rc.DBSize(ctx).Result()
	if err != nil || before == 0 {
		t.Fatalf("the promoted replica holds %d keys (%v); want the replicated counters", before, err)
	}
	// The first calls after the switch may still meet the old primary,
	// now a replica refusing writes: the rule's fail mode answers those and
	// nothing is debited. The agent must come to debit the promoted one.
	var last *allotv1.CheckResponse
	var lastErr error
	for i := 0; i < 100; i++ {
		last, lastErr = try("acme")
		if lastErr == nil && last.Allowed && last.Rule == "bucket" {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if lastErr != nil || last.Rule != "bucket" || last.Remaining != 94 {
		t.Fatalf("after the failover: %+v %v; want allowed by bucket with 94 left (the replicated 95, then one debit)", last, lastErr)
	}
}

// TestRedisConnTLS: a TLS-only Redis serves the agent that trusts its CA;
// without the CA (the system's roots) the handshake is refused.
func TestRedisConnTLS(t *testing.T) {
	srv := redistest.NewServerWith(t, redistest.ServerOptions{TLS: true, Password: "s3cret"})
	conn := agent.DefaultRedisConn()
	conn.Addrs, conn.Password, conn.TLS = []string{srv.Addr()}, "s3cret", true
	wantRefused(t, conn, "certificate") // without the CA
	conn.CAFile = srv.CAFile()
	_, decide, _ := connAgent(t, conn)
	for want := int64(99); want >= 98; want-- {
		if got := decide("acme"); got != want {
			t.Fatalf("remaining %d, want %d", got, want)
		}
	}
}

// TestRedisConnMutualTLS: a Redis that authenticates clients (Redis's
// default with TLS) refuses the agent without a client certificate and
// serves it with one; the pair is read again for each new connection, so a
// rotated pair is what the next connection presents.
func TestRedisConnMutualTLS(t *testing.T) {
	srv := redistest.NewServerWith(t, redistest.ServerOptions{TLS: true, ClientAuth: true})
	conn := agent.DefaultRedisConn()
	conn.Addrs, conn.TLS, conn.CAFile = []string{srv.Addr()}, true, srv.CAFile()
	wantRefused(t, conn, "certificate") // Redis asks for one and gets none
	// The agent's own copy of the pair, which the test rotates.
	dir := t.TempDir()
	conn.CertFile, conn.KeyFile = dir+"/client.pem", dir+"/client.key"
	cert, key := srv.ClientCertFiles()
	for _, f := range [][2]string{{cert, conn.CertFile}, {key, conn.KeyFile}} {
		b, err := os.ReadFile(f[0])
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(f[1], b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	rdb, decide, _ := connAgent(t, conn)
	for want := int64(99); want >= 98; want-- {
		if got := decide("acme"); got != want {
			t.Fatalf("remaining %d, want %d", got, want)
		}
	}
	client, ok := rdb.(*redis.Client)
	if !ok {
		t.Fatalf("client %T, want *redis.Client", rdb)
	}
	// ping pings over a new connection with the agent's TLS config.
	ping := func() error {
		c := redis.NewClient(client.Options())
		defer c.Close()
		return c.Ping(context.Background()).Err()
	}
	// Files that cannot be read (a rotation halfway through) leave the last
	// good pair in use.
	if err := os.WriteFile(conn.KeyFile, []byte("half written"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := ping(); err != nil {
		t.Fatalf("new connection while the key file is unreadable: %v; want the last good pair presented", err)
	}
	// Rotated to a pair the server's CA did not sign: a new connection
	// presents it and is refused, which shows the files are read again.
	other, err := redistest.NewCA("another CA")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := other.IssueClient("stranger", conn.CertFile, conn.KeyFile); err != nil {
		t.Fatal(err)
	}
	if err := ping(); err == nil {
		t.Fatal("a new connection with the rotated, untrusted pair was accepted; want refused")
	}
	// The agent's pooled connections are not torn down by a rotation.
	if got := decide("acme"); got != 97 {
		t.Fatalf("remaining %d after the rotation, want 97", got)
	}
}

// TestRedisPoolMetrics: an agent on Redis serves its client's connection
// pool statistics, and they move with the decisions it makes.
func TestRedisPoolMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	a := runAgent(t, newAgent(t, testConfig("eu"), sharedRedis(t), agent.WithPolicy(mustParse(t, apiPolicy), 0), agent.WithRegisterer(reg))).Agent
	s := serve(t, a)
	// value sums name's series whose labels include want.
	value := func(name string, want map[string]string) (float64, bool) {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		var sum float64
		var found bool
		for _, mf := range mfs {
			if mf.GetName() != name {
				continue
			}
		series:
			for _, m := range mf.GetMetric() {
				have := map[string]string{}
				for _, l := range m.GetLabel() {
					have[l.GetName()] = l.GetValue()
				}
				for k, v := range want {
					if have[k] != v {
						continue series
					}
				}
				found = true
				sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
			}
		}
		return sum, found
	}
	// The store's batched decisions run on the pipeline pool.
	pipeline := map[string]string{"pool": "pipeline"}
	used := func() float64 {
		hits, ok := value("allot_redis_pool_hits_total", pipeline)
		misses, ok2 := value("allot_redis_pool_misses_total", pipeline)
		if !ok || !ok2 {
			t.Fatal("the pipeline pool's hits and misses are not served")
		}
		return hits + misses
	}
	before := used()
	for i := 0; i < 20; i++ {
		check(t, s.connect, &allotv1.CheckRequest{Entries: entries("tenant", "acme", "user", "u1")})
	}
	if after := used(); after < before+1 {
		t.Fatalf("pipeline pool hits+misses %v after 20 decisions, %v before: want more", after, before)
	}
	if total, ok := value("allot_redis_pool_connections", map[string]string{"state": "total"}); !ok || total < 1 {
		t.Fatalf("allot_redis_pool_connections{state=total} = %v (served %v); want at least one open connection", total, ok)
	}
	if _, ok := value("allot_redis_pool_timeouts_total", map[string]string{"pool": "main"}); !ok {
		t.Fatal("allot_redis_pool_timeouts_total{pool=main} not served")
	}
}

// TestRedisConnBoundsPipelines: every kind of client the agent makes
// applies a call's deadline to its connection (ContextTimeoutEnabled), so
// the store's PipelineTimeout bounds a round trip to a Redis that stops
// answering.
func TestRedisConnBoundsPipelines(t *testing.T) {
	for _, edit := range []func(*agent.RedisConn){
		func(c *agent.RedisConn) {},
		func(c *agent.RedisConn) { c.Mode, c.Addrs = agent.RedisCluster, []string{"127.0.0.1:1", "127.0.0.1:2"} },
		func(c *agent.RedisConn) {
			c.Mode, c.Addrs, c.MasterName = agent.RedisSentinel, []string{"127.0.0.1:1"}, "allot"
		},
	} {
		conn := agent.DefaultRedisConn()
		edit(&conn)
		c, err := conn.Client()
		if err != nil {
			t.Fatal(err)
		}
		var on bool
		switch c := c.(type) {
		case *redis.Client:
			on = c.Options().ContextTimeoutEnabled
		case *redis.ClusterClient:
			on = c.Options().ContextTimeoutEnabled
		default:
			t.Errorf("%s: a %T", conn.Mode, c)
		}
		if !on {
			t.Errorf("%s: ContextTimeoutEnabled is off", conn.Mode)
		}
		c.Close()
	}
}
