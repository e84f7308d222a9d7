// Package redistest starts real Redis servers for tests: a standalone
// redis-server on a free loopback port in a temporary directory, and a real
// three-master Redis Cluster built with `redis-cli --cluster create`. Nothing
// here is a mock: the admission engine's conformance suite runs its Lua script
// on these servers.
//
// # Usage
//
//  1. In a test, call [NewServer] or [NewCluster]; the server is stopped and
//     its directory removed when the test ends. When redis-server is not
//     installed the test is skipped with the reason, or fails when the
//     environment variable CI is set (CI must never skip silently).
//  2. To share one server between the tests of a package, call [StartServer]
//     or [StartCluster] from TestMain and Close it after m.Run; report a
//     missing binary per test with [Require].
//  3. Use [Server.Pause] (SIGSTOP) and [Server.Resume] (SIGCONT) to make a
//     server hang without closing its connections, the failure a timeout and a
//     circuit breaker must handle.
//  4. Use [Cluster.StartMove] to catch a cluster slot halfway through a move
//     between two masters (a command on its keys, some moved and some not,
//     gets TRYAGAIN), and [SlotMove.Finish] to complete it.
//
// The servers run with persistence off and are killed with the test process
// on Linux (Pdeathsig), so a crashed test binary leaves no server behind.
package redistest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// ErrNotInstalled is returned by Lookup, StartServer and StartCluster when
// redis-server or redis-cli is not on PATH.
var ErrNotInstalled = errors.New("redis-server or redis-cli not installed (apt-get install redis-server)")

// startTimeout bounds how long a server or cluster may take to come up.
const startTimeout = 30 * time.Second

// Lookup returns the paths of redis-server and redis-cli, or ErrNotInstalled.
func Lookup() (server, cli string, err error) {
	server, err1 := exec.LookPath("redis-server")
	cli, err2 := exec.LookPath("redis-cli")
	if err1 != nil || err2 != nil {
		return "", "", ErrNotInstalled
	}
	return server, cli, nil
}

// Require skips t (or fails it when the environment variable CI is set) if
// err says Redis is unavailable; any other non-nil err fails t.
func Require(t testing.TB, err error) {
	t.Helper()
	switch {
	case err == nil:
	case errors.Is(err, ErrNotInstalled) && os.Getenv("CI") == "":
		t.Skipf("skipping: %v; set CI=1 to make this a failure", err)
	case errors.Is(err, ErrNotInstalled):
		t.Fatalf("redis: %v; CI is set, so a missing Redis is a failure, not a skip", err)
	default:
		t.Fatalf("redis: %v", err)
	}
}

// Server is one running redis-server process.
type Server struct {
	addr string
	dir  string
	cmd  *exec.Cmd
	done chan struct{}
	log  string
	// password is the server's requirepass, sent by Client.
	password string
	// tls is set when the server serves TLS only.
	tls *tlsFiles

	mu     sync.Mutex
	closed bool
}

// Addr is the server's host:port on 127.0.0.1.
func (s *Server) Addr() string { return s.addr }

// Port is the server's TCP port.
func (s *Server) Port() int {
	_, p, _ := net.SplitHostPort(s.addr)
	n, _ := strconv.Atoi(p)
	return n
}

// Client returns a new client for the server; the caller closes it.
func (s *Server) Client() *redis.Client {
	return redis.NewClient(s.options())
}

// options are the client options that reach the server.
func (s *Server) options() *redis.Options {
	o := &redis.Options{Addr: s.addr, Password: s.password}
	if s.tls != nil {
		o.TLSConfig = s.tls.clientTLS()
	}
	return o
}

// CAFile is the PEM file of the CA that signed a TLS server's certificate
// ("" for a server without TLS).
func (s *Server) CAFile() string {
	if s.tls == nil {
		return ""
	}
	return s.tls.ca
}

// ClientCertFiles are the PEM files of a client certificate (and its key)
// that a TLS server's CA signed ("" for a server without TLS).
func (s *Server) ClientCertFiles() (cert, key string) {
	if s.tls == nil {
		return "", ""
	}
	return s.tls.clientCert, s.tls.clientKey
}

// Pause stops the process with SIGSTOP: connections stay open and commands
// hang, as on an overloaded or partitioned server.
func (s *Server) Pause() error { return s.signal(syscall.SIGSTOP) }

// Resume continues a paused process with SIGCONT.
func (s *Server) Resume() error { return s.signal(syscall.SIGCONT) }

func (s *Server) signal(sig syscall.Signal) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return errors.New("redistest: server closed")
	}
	return s.cmd.Process.Signal(sig)
}

// Close kills the server, waits for it and removes its directory. It is
// idempotent.
func (s *Server) Close() {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.closed = true
	s.mu.Unlock()
	_ = s.cmd.Process.Signal(syscall.SIGCONT) // a paused process must be able to die
	_ = s.cmd.Process.Kill()
	<-s.done
	_ = os.RemoveAll(s.dir)
}

// Log returns the server's log file contents, for failure messages.
func (s *Server) Log() string {
	b, err := os.ReadFile(s.log)
	if err != nil {
		return ""
	}
	return string(b)
}

// options configures one server process.
type options struct {
	cluster bool
	ServerOptions
}

// ServerOptions configures a standalone server of StartServerWith.
type ServerOptions struct {
	// Password is required of clients (requirepass); Client sends it.
	Password string
	// ReplicaOf, a host:port, starts the server as that primary's replica.
	ReplicaOf string
	// TLS serves TLS only, with a certificate for 127.0.0.1 signed by a CA
	// made for this server (its PEM file: Server.CAFile). Clients need not
	// present certificates unless ClientAuth is set.
	TLS bool
	// ClientAuth (with TLS) requires every client to present a certificate
	// the server's CA signed (tls-auth-clients yes, Redis's default with
	// TLS). Client presents one; Server.ClientCertFiles names its files.
	ClientAuth bool
	// Sentinel, when set, starts a Sentinel (redis-server --sentinel)
	// instead of a data server, monitoring the primary it names.
	Sentinel *SentinelOptions
}

// SentinelOptions is what a test Sentinel monitors.
type SentinelOptions struct {
	// MasterName is the name clients ask the Sentinel for.
	MasterName string
	// Primary is the monitored primary's host:port; its password, if any,
	// is PrimaryPassword.
	Primary, PrimaryPassword string
}

// StartServer starts a standalone redis-server on a free loopback port. The
// caller must Close it.
func StartServer(ctx context.Context) (*Server, error) {
	return startServer(ctx, options{})
}

// NewServer starts a standalone redis-server for t and closes it when t ends.
func NewServer(t testing.TB) *Server {
	return NewServerWith(t, ServerOptions{})
}

// StartServerWith starts a server as o says on a free loopback port: a
// password-protected or TLS-only one, a replica, or a Sentinel. The caller
// must Close it.
func StartServerWith(ctx context.Context, o ServerOptions) (*Server, error) {
	return startServer(ctx, options{ServerOptions: o})
}

// NewServerWith starts a server as o says for t and closes it when t ends.
func NewServerWith(t testing.TB, o ServerOptions) *Server {
	t.Helper()
	s, err := StartServerWith(context.Background(), o)
	Require(t, err)
	t.Cleanup(s.Close)
	return s
}

func startServer(ctx context.Context, o options) (*Server, error) {
	bin, _, err := Lookup()
	if err != nil {
		return nil, err
	}
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ { // a free port can be taken before we bind it
		port, err := freePort(o.cluster)
		if err != nil {
			return nil, err
		}
		s, err := spawn(ctx, bin, port, o)
		if err == nil {
			return s, nil
		}
		lastErr = err
	}
	return nil, lastErr
}

func spawn(ctx context.Context, bin string, port int, o options) (*Server, error) {
	dir, err := os.MkdirTemp("", "redistest-")
	if err != nil {
		return nil, err
	}
	s := &Server{
		addr:     net.JoinHostPort("127.0.0.1", strconv.Itoa(port)),
		dir:      dir,
		done:     make(chan struct{}),
		log:      filepath.Join(dir, "redis.log"),
		password: o.Password,
	}
	args, err := s.args(port, o)
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	s.cmd = exec.Command(bin, args...)
	s.cmd.Dir = dir
	s.cmd.SysProcAttr = procAttr()
	if err := s.cmd.Start(); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("start redis-server: %w", err)
	}
	go func() {
		_ = s.cmd.Wait()
		close(s.done)
	}()
	if err := s.waitReady(ctx); err != nil {
		log := s.Log()
		s.Close()
		return nil, fmt.Errorf("redis-server on %s: %w\n%s", s.addr, err, log)
	}
	return s, nil
}

// args are the command-line arguments of s's process as o says; it writes
// a Sentinel's config and the TLS files into s.dir.
func (s *Server) args(port int, o options) ([]string, error) {
	var args []string
	if so := o.Sentinel; so != nil {
		// A Sentinel's monitor list lives in its config file, which it
		// rewrites as it learns the replicas.
		host, p, err := net.SplitHostPort(so.Primary)
		if err != nil {
			return nil, fmt.Errorf("redistest: sentinel primary %q: %w", so.Primary, err)
		}
		conf := fmt.Sprintf("sentinel monitor %s %s %s 1\nsentinel down-after-milliseconds %[1]s 1000\nsentinel failover-timeout %[1]s 5000\n", so.MasterName, host, p)
		if so.PrimaryPassword != "" {
			conf += fmt.Sprintf("sentinel auth-pass %s %s\n", so.MasterName, so.PrimaryPassword)
		}
		path := filepath.Join(s.dir, "sentinel.conf")
		if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
			return nil, err
		}
		args = []string{path, "--sentinel"}
	}
	args = append(args,
		"--bind", "127.0.0.1",
		"--port", strconv.Itoa(port),
		"--dir", s.dir,
		"--save", "",
		"--appendonly", "no",
		"--daemonize", "no",
		"--logfile", s.log,
		"--protected-mode", "yes",
	)
	if o.Password != "" {
		args = append(args, "--requirepass", o.Password)
	}
	if o.ClientAuth && !o.TLS {
		return nil, errors.New("redistest: ClientAuth needs TLS")
	}
	if o.TLS {
		auth := "no"
		if o.ClientAuth {
			auth = "yes"
		}
		var err error
		if s.tls, err = writeTLSFiles(s.dir); err != nil {
			return nil, fmt.Errorf("redistest: TLS files: %w", err)
		}
		args = append(args, "--port", "0", "--tls-port", strconv.Itoa(port),
			"--tls-cert-file", s.tls.cert, "--tls-key-file", s.tls.key,
			"--tls-ca-cert-file", s.tls.ca, "--tls-auth-clients", auth)
	}
	if o.ReplicaOf != "" {
		host, p, err := net.SplitHostPort(o.ReplicaOf)
		if err != nil {
			return nil, fmt.Errorf("redistest: replica of %q: %w", o.ReplicaOf, err)
		}
		args = append(args, "--replicaof", host, p)
	}
	if o.cluster {
		args = append(args,
			"--cluster-enabled", "yes",
			"--cluster-config-file", filepath.Join(s.dir, "nodes.conf"),
			"--cluster-node-timeout", "2000",
		)
	}
	return args, nil
}

// waitReady polls PING until the server answers or startTimeout passes.
func (s *Server) waitReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	o := s.options()
	o.MaxRetries, o.DialTimeout = -1, time.Second
	c := redis.NewClient(o)
	defer c.Close()
	for {
		select {
		case <-s.done:
			return errors.New("exited during start")
		default:
		}
		if err := c.Ping(ctx).Err(); err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-s.done:
			return errors.New("exited during start")
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// freePort returns a loopback port that was free a moment ago; for a cluster
// node its bus port (port + 10000) must be free too.
func freePort(cluster bool) (int, error) {
	for i := 0; i < 50; i++ {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		port := ln.Addr().(*net.TCPAddr).Port
		if !cluster {
			_ = ln.Close()
			return port, nil
		}
		if port+10000 > 65535 {
			_ = ln.Close()
			continue
		}
		bus, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port+10000)))
		_ = ln.Close()
		if err != nil {
			continue
		}
		_ = bus.Close()
		return port, nil
	}
	return 0, errors.New("redistest: no free port pair for a cluster node")
}

// ClosedAddr returns a loopback address on which nothing listens (a port
// that was free a moment ago), for tests of an unreachable store.
func ClosedAddr() (string, error) {
	p, err := freePort(false)
	if err != nil {
		return "", err
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(p)), nil
}

// Cluster is a running Redis Cluster of three masters and no replicas.
type Cluster struct {
	// Nodes are the masters.
	Nodes []*Server
}

// Addrs returns the nodes' addresses.
func (c *Cluster) Addrs() []string {
	a := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		a[i] = n.Addr()
	}
	return a
}

// Client returns a new cluster client; the caller closes it.
func (c *Cluster) Client() *redis.ClusterClient {
	return redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
}

// Close kills every node.
func (c *Cluster) Close() {
	for _, n := range c.Nodes {
		n.Close()
	}
}

// StartCluster starts three cluster-enabled servers, joins them with
// `redis-cli --cluster create` and waits until every node reports
// cluster_state:ok. The caller must Close it.
func StartCluster(ctx context.Context) (*Cluster, error) {
	_, cli, err := Lookup()
	if err != nil {
		return nil, err
	}
	c := &Cluster{}
	for i := 0; i < 3; i++ {
		s, err := startServer(ctx, options{cluster: true})
		if err != nil {
			c.Close()
			return nil, err
		}
		c.Nodes = append(c.Nodes, s)
	}
	args := append([]string{"--cluster", "create"}, c.Addrs()...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	cctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	out, err := exec.CommandContext(cctx, cli, args...).CombinedOutput()
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("redis-cli --cluster create: %w\n%s", err, out)
	}
	if err := c.waitOK(cctx); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// NewCluster starts a cluster for t and closes it when t ends.
func NewCluster(t testing.TB) *Cluster {
	t.Helper()
	c, err := StartCluster(context.Background())
	Require(t, err)
	t.Cleanup(c.Close)
	return c
}

// waitOK polls CLUSTER INFO on every node until all say cluster_state:ok and
// all 16384 slots are assigned.
func (c *Cluster) waitOK(ctx context.Context) error {
	for {
		ok := true
		for _, n := range c.Nodes {
			cl := redis.NewClient(&redis.Options{Addr: n.Addr(), MaxRetries: -1})
			info, err := cl.ClusterInfo(ctx).Result()
			_ = cl.Close()
			if err != nil || !clusterOK(info) {
				ok = false
				break
			}
		}
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("cluster did not reach cluster_state:ok: %w", ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func clusterOK(info string) bool {
	state, slots := false, false
	sc := bufio.NewScanner(strings.NewReader(info))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch line {
		case "cluster_state:ok":
			state = true
		case "cluster_slots_ok:16384":
			slots = true
		}
	}
	return state && slots
}

// FlushAll empties every database of the server.
func (s *Server) FlushAll(ctx context.Context) error {
	c := s.Client()
	defer c.Close()
	return c.FlushAll(ctx).Err()
}

// FlushAll empties every master of the cluster.
func (c *Cluster) FlushAll(ctx context.Context) error {
	for _, n := range c.Nodes {
		if err := n.FlushAll(ctx); err != nil {
			return err
		}
	}
	return nil
}
