package agent

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Redis deployment kinds a RedisConn reaches.
const (
	// RedisStandalone is one server (or a proxy in front of several) at the
	// one address.
	RedisStandalone = "standalone"
	// RedisCluster is a Redis Cluster; the addresses are seed nodes, and one
	// is enough (the client learns the slot map from it). Every key of one
	// tenant shares a hash tag, so each decision is one call on one node.
	RedisCluster = "cluster"
	// RedisSentinel is a primary watched by Sentinels; the addresses are the
	// Sentinels', and the client follows the primary across failovers.
	// Sentinel fails over asynchronously: debits the old primary
	// acknowledged can be lost, so run the allocator with
	// -store-async-failover and the stated bound accounts for them.
	RedisSentinel = "sentinel"
)

// RedisConn says how the agent reaches its region's Redis. It is the
// connection only; Config.Store configures the batching over it.
type RedisConn struct {
	// Mode is RedisStandalone, RedisCluster or RedisSentinel.
	Mode string
	// Addrs are host:port addresses: the server's (standalone, exactly
	// one), seed nodes (cluster) or Sentinels (sentinel).
	Addrs []string
	// MasterName is the name the Sentinels monitor the primary under
	// (sentinel only).
	MasterName string
	// Username and Password authenticate to the Redis nodes (an ACL user,
	// or only a password for requirepass).
	Username, Password string
	// SentinelPassword authenticates to Sentinels that require a password
	// (sentinel only; empty: the Sentinels are sent no credentials).
	SentinelPassword string
	// TLS turns on TLS to every node; CAFile, when set, is a PEM bundle of
	// the roots the nodes' certificates must chain to (default: the
	// system's), and ServerName overrides the name checked in them.
	TLS        bool
	CAFile     string
	ServerName string
	// CertFile and KeyFile, both or neither, are the PEM certificate and
	// key the agent presents to nodes that authenticate clients (Redis's
	// default with TLS: tls-auth-clients yes). They are read again at each
	// new connection, so a rotated pair is used without a restart; a pair
	// that cannot be read then leaves the last good one in use.
	CertFile, KeyFile string
	// PoolSize is the most connections per node.
	PoolSize int
	// DialTimeout bounds one connection attempt.
	DialTimeout time.Duration
}

// DefaultRedisConn is a standalone Redis on the local default port.
func DefaultRedisConn() RedisConn {
	return RedisConn{
		Mode:        RedisStandalone,
		Addrs:       []string{"127.0.0.1:6379"},
		PoolSize:    64,
		DialTimeout: 2 * time.Second,
	}
}

// Validate reports every field that is wrong, naming it.
func (c RedisConn) Validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	switch c.Mode {
	case RedisStandalone:
		if len(c.Addrs) != 1 {
			bad("Addrs: a standalone Redis has exactly one address, got %d (use Mode %q for seed nodes of a Redis Cluster)", len(c.Addrs), RedisCluster)
		}
	case RedisCluster, RedisSentinel:
		if len(c.Addrs) == 0 {
			bad("Addrs: %s mode needs at least one address", c.Mode)
		}
	default:
		bad("Mode must be %s, %s or %s, got %q", RedisStandalone, RedisCluster, RedisSentinel, c.Mode)
	}
	for i, a := range c.Addrs {
		if _, port, err := net.SplitHostPort(a); err != nil || port == "" {
			bad("Addrs[%d] %q is not host:port", i, a)
		}
	}
	if c.Mode == RedisSentinel && c.MasterName == "" {
		bad("MasterName: sentinel mode needs the name the Sentinels monitor the primary under")
	}
	if c.Mode != RedisSentinel && (c.MasterName != "" || c.SentinelPassword != "") {
		bad("MasterName and SentinelPassword apply to sentinel mode only, not %s", c.Mode)
	}
	if !c.TLS && (c.CAFile != "" || c.ServerName != "" || c.CertFile != "" || c.KeyFile != "") {
		bad("CAFile, ServerName, CertFile and KeyFile need TLS")
	}
	switch {
	case c.CertFile != "" && c.KeyFile == "":
		bad("KeyFile: CertFile needs its key")
	case c.CertFile == "" && c.KeyFile != "":
		bad("CertFile: KeyFile needs its certificate")
	}
	if c.PoolSize < 1 || c.PoolSize > 10000 {
		bad("PoolSize must be in [1, 10000], got %d", c.PoolSize)
	}
	if c.DialTimeout <= 0 || c.DialTimeout > time.Minute {
		bad("DialTimeout must be in (0, 1m], got %s", c.DialTimeout)
	}
	return errors.Join(errs...)
}

// Client returns a client for the configured deployment (the caller closes
// it). It does not connect: the agent's first calls do, and fail over to the
// rules' fail modes while Redis is unreachable.
func (c RedisConn) Client() (redis.UniversalClient, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	o := &redis.UniversalOptions{
		Addrs:            c.Addrs,
		Username:         c.Username,
		Password:         c.Password,
		SentinelPassword: c.SentinelPassword,
		PoolSize:         c.PoolSize,
		DialTimeout:      c.DialTimeout,
		// The store's pipelines carry a deadline (PipelineTimeout); go-redis
		// applies it to the connection only with this set, else a Redis that
		// stops answering holds each pipeline for ReadTimeout (5 s).
		ContextTimeoutEnabled: true,
	}
	if c.TLS {
		t := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: c.ServerName}
		if c.CAFile != "" {
			pem, err := os.ReadFile(c.CAFile)
			if err != nil {
				return nil, fmt.Errorf("CAFile: %w", err)
			}
			t.RootCAs = x509.NewCertPool()
			if !t.RootCAs.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("CAFile %s: no PEM certificate in it", c.CAFile)
			}
		}
		if c.CertFile != "" {
			cc, err := newClientCert(c.CertFile, c.KeyFile)
			if err != nil {
				return nil, err
			}
			t.GetClientCertificate = cc.get
		}
		o.TLSConfig = t
	}
	switch c.Mode {
	case RedisCluster:
		return redis.NewClusterClient(o.Cluster()), nil
	case RedisSentinel:
		o.MasterName = c.MasterName
		return redis.NewFailoverClient(o.Failover()), nil
	default:
		return redis.NewClient(o.Simple()), nil
	}
}

// clientCert is the certificate a TLS client presents, read from its files
// at each handshake (connections are few and long-lived) so that a rotated
// pair takes effect on the next connection.
type clientCert struct {
	certFile, keyFile string
	mu                sync.Mutex
	last              *tls.Certificate
}

// newClientCert reads the pair once: a bad pair is a configuration error at
// start, not a handshake failure later.
func newClientCert(certFile, keyFile string) (*clientCert, error) {
	pair, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("CertFile and KeyFile: %w", err)
	}
	return &clientCert{certFile: certFile, keyFile: keyFile, last: &pair}, nil
}

// get is tls.Config.GetClientCertificate: the pair as the files hold it
// now, or the last good one while they cannot be read (a rotation halfway
// through writing them).
func (c *clientCert) get(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if pair, err := tls.LoadX509KeyPair(c.certFile, c.keyFile); err == nil {
		c.last = &pair
	}
	return c.last, nil
}
