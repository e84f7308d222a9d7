package admission

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// clusterRoute maps a key to the shard of a RedisStore on Redis Cluster:
// the master that owns the key's slot, as the client's slot map says now.
// Each master address gets a small index of its own, in order of first
// use, 1 to maxShards-1 (0 is for keys routed before the client has a slot
// map); beyond maxShards-1 addresses (failovers and restarts that change
// addresses accumulate them, since an index is never given back) a new
// address shares an index by hashing, with the batcher and the breaker of
// whichever address had it.
//
// The store sends each shard's calls through a batcher of its own, and the
// engine keeps a circuit breaker per shard: a master that stops answering
// then holds only its own pipelines, and opens only its own breaker.
type clusterRoute struct {
	c   *redis.ClusterClient
	log *zap.Logger
	// ready is set once the client holds a slot map (see prime): before
	// that, MasterForKey would load it on the caller's path, over the
	// network, so shard answers 0 without asking.
	ready atomic.Bool
	// nodes maps the client's node clients to their indices; it is
	// replaced, never changed, so that shard reads it without a lock.
	nodes atomic.Pointer[map[*redis.Client]int]
	// lastReload is when (Unix ns) a reload of the slot map was last asked
	// for; see reload.
	lastReload atomic.Int64

	mu    sync.Mutex
	addrs map[string]int // the dense indices given out, by address; under mu
}

func newClusterRoute(c *redis.ClusterClient) *clusterRoute {
	r := &clusterRoute{c: c, log: zap.NewNop(), addrs: make(map[string]int)}
	m := make(map[*redis.Client]int)
	r.nodes.Store(&m)
	return r
}

// shard returns the index of the master that owns key's slot. Once the
// client holds a slot map, MasterForKey reads it from memory (measured:
// ~60 ns, no allocation; a slot map older than the client's
// ClusterStateReloadInterval is reloaded in the background, not here).
func (r *clusterRoute) shard(key string) int {
	if !r.ready.Load() {
		return 0
	}
	m, err := r.c.MasterForKey(context.Background(), key)
	if err != nil {
		return 0
	}
	if i, ok := (*r.nodes.Load())[m]; ok {
		return i
	}
	return r.add(m)
}

// add gives node client m the index of its address, a new one when the
// address is new.
func (r *clusterRoute) add(m *redis.Client) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	old := *r.nodes.Load()
	if i, ok := old[m]; ok {
		return i
	}
	addr := m.Options().Addr
	i, ok := r.addrs[addr]
	switch {
	case ok:
	case len(r.addrs) < maxShards-1:
		i = len(r.addrs) + 1
		r.addrs[addr] = i
		r.log.Info("Redis Cluster master seen: its calls get a batcher and a circuit breaker of their own", zap.String("addr", addr), zap.Int("shard", i))
	default:
		i = 1 + int(fnv32(addr)%(maxShards-1))
		r.log.Warn("Redis Cluster master seen after the shard indices ran out: it shares a batcher and a circuit breaker", zap.String("addr", addr), zap.Int("shard", i))
	}
	next := make(map[*redis.Client]int, len(old)+1)
	// go-redis replaces the client of a node it dropped and meets again:
	// forget the old ones now and then, so the map stays small.
	if len(old) < 4*maxShards {
		for k, v := range old {
			next[k] = v
		}
	}
	next[m] = i
	r.nodes.Store(&next)
	return i
}

// prime marks the route ready once the client holds a slot map: after a
// pipeline in which a call reached a node (answered, or refused by Redis),
// which the client routed by its slot map. Until then every key is routed
// to shard 0, as a store on one server would route it.
func (r *clusterRoute) prime(ctx context.Context, cmds []redis.Cmder) {
	for _, c := range cmds {
		var re redis.Error
		if err := c.Err(); err == nil || errors.As(err, &re) {
			// The client holds a slot map: this does not wait on the
			// network.
			if _, err := r.c.MasterForKey(ctx, "{}"); err == nil {
				r.ready.Store(true)
			}
			return
		}
	}
}

// reloadEvery is the shortest interval between two reloads of the slot
// map the store asks for (reload).
const reloadEvery = 100 * time.Millisecond

// reload asks the client to reload its slot map, after a call failed on
// the connection to its node (a refused dial, a reset, EOF, a timeout):
// the node may be dead, and a replica promoted in its place. go-redis
// reloads only on MOVED (and every ClusterStateReloadInterval, a minute by
// default), and a dead master answers nothing. The client reloads in the
// background, one reload at a time, and collapses the requests that come
// meanwhile into one more reload 200 ms after it (clusterStateHolder.
// LazyReload); the store asks at most every reloadEvery, so a burst of
// failed calls costs a node a few CLUSTER SLOTS a second.
func (r *clusterRoute) reload() {
	now := time.Now().UnixNano()
	last := r.lastReload.Load()
	if now-last < int64(reloadEvery) || !r.lastReload.CompareAndSwap(last, now) {
		return
	}
	r.c.ReloadState(context.Background())
}

// connLevel reports whether err is a failure of the connection to a node
// (a refused or timed-out dial, a reset, EOF, a read or write timeout),
// not an answer of Redis's, nor the store or the client closing.
func connLevel(err error) bool {
	var re redis.Error
	switch {
	case err == nil, errors.As(err, &re), errors.Is(err, context.Canceled), errors.Is(err, redis.ErrClosed):
		return false
	}
	var ne net.Error
	return errors.As(err, &ne) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, context.DeadlineExceeded) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// routingRefusal reports whether err is Redis Cluster refusing a call for
// where its keys live, which says nothing of the node's health: TRYAGAIN
// (its slot half moved, still so after the store's resends; or the caller's
// timeout passing while the call waited for a resend, errSlotMoving) and a
// MOVED or ASK redirect still unresolved when go-redis's redirects ran out.
// The engine's breaker does not count it (the call still fails, and the
// rules' fail modes decide): an ordinary slot migration must not open it.
// CLUSTERDOWN, MASTERDOWN and LOADING do count: the node cannot serve.
func routingRefusal(err error) bool {
	return errors.Is(err, errSlotMoving) || redis.HasErrorPrefix(err, "TRYAGAIN") ||
		redis.HasErrorPrefix(err, "MOVED ") || redis.HasErrorPrefix(err, "ASK ")
}
