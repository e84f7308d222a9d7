package admission

import (
	"context"
	"crypto/sha1"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

//go:embed script.lua
var scriptSource string

// ScriptSource returns the admission script's Lua source.
func ScriptSource() string { return scriptSource }

// ScriptSHA returns the SHA-1 digest EVALSHA calls the script by.
func ScriptSHA() string {
	sum := sha1.Sum([]byte(scriptSource))
	return hex.EncodeToString(sum[:])
}

// RedisConfig configures a RedisStore and its auto-batchers. On Redis
// Cluster the store runs one batcher per master (see RedisStore), and
// BatchSize, BatchDelay, MaxPipelines and MaxPending apply to each of them:
// a gateway talking to three masters may have three times MaxPipelines
// pipelines in flight and three times MaxPending calls waiting.
type RedisConfig struct {
	// BatchSize is the most store calls sent in one pipeline.
	BatchSize int
	// BatchDelay is how long a call may wait for companions when pipelines
	// are already in flight and the batch is not full; 0 sends as soon as a
	// pipeline slot is free. A call never waits when nothing is in flight.
	BatchDelay time.Duration
	// MaxPipelines is the most pipelines in flight at once (per Cluster
	// master); more calls wait for one to return, and are batched meanwhile.
	MaxPipelines int
	// MaxPending is the most calls waiting to be sent (per Cluster master);
	// beyond it calls fail at once with ErrOverloaded (the fail modes
	// decide), so a slow Redis cannot pile up unbounded work.
	MaxPending int
	// PipelineTimeout bounds one pipeline round trip; it protects the batcher
	// when Redis stops answering. Callers give up earlier, at their own
	// deadline. go-redis applies it to the connection only when the client
	// has ContextTimeoutEnabled; otherwise the client's ReadTimeout (5 s by
	// default) bounds a round trip, and NewRedisStore logs a warning when
	// that is longer.
	PipelineTimeout time.Duration
	// StateForm is how buckets and windows are written: StateBinary (the
	// default) or StateText. Both are always read.
	StateForm string
}

// The forms of counter state in Redis (RedisConfig.StateForm).
const (
	// StateBinary writes a bucket or a window as 25 bytes (a tag and three
	// numbers), which costs the script ~1 µs less per rule than text.
	StateBinary = "binary"
	// StateText writes decimal text ("tokens:stamp:expiry"), the only form
	// builds before StateBinary read. Keep it while such gateways share the
	// Redis, then switch (package doc, "Counter state").
	StateText = "text"
)

// DefaultRedisConfig returns batches of up to 16 calls, 4 pipelines in
// flight, no added delay, 4096 pending calls, a 1 s pipeline timeout and
// binary counter state.
func DefaultRedisConfig() RedisConfig {
	return RedisConfig{
		BatchSize:       16,
		BatchDelay:      0,
		MaxPipelines:    4,
		MaxPending:      4096,
		PipelineTimeout: time.Second,
		StateForm:       StateBinary,
	}
}

// Validate says what is wrong with c, or returns nil.
func (c RedisConfig) Validate() error {
	var errs []error
	if c.BatchSize < 1 || c.BatchSize > 1024 {
		errs = append(errs, fmt.Errorf("BatchSize must be in [1, 1024], got %d", c.BatchSize))
	}
	if c.BatchDelay < 0 || c.BatchDelay > 10*time.Millisecond {
		errs = append(errs, fmt.Errorf("BatchDelay must be in [0, 10ms], got %s", c.BatchDelay))
	}
	if c.MaxPipelines < 1 {
		errs = append(errs, fmt.Errorf("MaxPipelines must be at least 1, got %d", c.MaxPipelines))
	}
	if c.MaxPending < c.BatchSize {
		errs = append(errs, fmt.Errorf("MaxPending must be at least BatchSize (%d), got %d", c.BatchSize, c.MaxPending))
	}
	if c.PipelineTimeout <= 0 {
		errs = append(errs, fmt.Errorf("PipelineTimeout must be positive, got %s", c.PipelineTimeout))
	}
	if c.StateForm != StateBinary && c.StateForm != StateText {
		errs = append(errs, fmt.Errorf("StateForm must be %q or %q, got %q", StateBinary, StateText, c.StateForm))
	}
	if len(errs) > 0 {
		return fmt.Errorf("redis store config: %w", errors.Join(errs...))
	}
	return nil
}

// RedisStore runs the admission script on Redis, standalone or Cluster
// (any redis.UniversalClient). Concurrent calls are batched into pipelines by
// a small auto-batcher, so a busy gateway pays one round trip per batch
// rather than per decision. It owns no connection: the caller creates and
// closes the client. Script calls are never retried by go-redis, whatever
// the client's MaxRetries (see onceCmd): a call whose outcome is unknown
// fails, and the rules' fail modes decide.
//
// On a *redis.ClusterClient each master is a shard of its own (Store.shard,
// clusterRoute): its calls go through a batcher of their own, so a master
// that stops answering holds only its own pipelines (a go-redis Cluster
// pipeline returns when every node it went to has answered), and the
// engine opens only that master's circuit breaker. A call that fails on its
// connection (a dead or unreachable node) makes the client reload its slot
// map, so that a replica promoted in the node's place is used as soon as
// the cluster has promoted it. Any other client (standalone, Sentinel,
// Ring) is one shard, with one batcher.
type RedisStore struct {
	client redis.UniversalClient
	sha    string
	shaArg any // sha, boxed once: a string put in an interface is an allocation
	cfg    RedisConfig
	log    *zap.Logger
	route  *clusterRoute // nil unless the client is a *redis.ClusterClient
	timers sync.Pool     // of stopped *time.Timer, for call timeouts
	cmds   sync.Pool     // of *[]any: EVALSHA argument lists, reused once parsed
	bufs   sync.Pool     // of *pipelineBuf: a pipeline's calls, reused once parsed
	pipes  sync.Pool     // of redis.Pipeliner after Exec (which empties them): reused
	dones  sync.Pool     // of op.done channels that were received from: empty
	pause  time.Duration // before a resend of a call refused for a passing state; see resend

	// batchers[i] batches the calls of shard i (Store.shard); each is made
	// on first use (see batcher).
	batchers [maxShards]atomic.Pointer[batcher]
	bmu      sync.Mutex // makes batchers; guards closed
	closed   bool

	// reuse is set when commands may be reused (see reusable): not for a
	// Cluster client. evals[n] holds reusable commands of n arguments,
	// replies[n] those whose reply is packed (see zeroCopy).
	reuse   bool
	evals   [maxReusedArgs + 1]sync.Pool
	replies [maxReusedArgs + 1]sync.Pool
	// replyBufs holds reply buffers (*[]byte) for the packed replies of
	// calls whose command is not reused.
	replyBufs sync.Pool

	deadline struct { // the pipelines' shared deadline; see pipelineCtx
		sync.Mutex
		ctx    context.Context
		cancel context.CancelFunc
		at     time.Time
	}
}

var _ Store = (*RedisStore)(nil)

// RedisOption sets an optional dependency of a RedisStore.
type RedisOption func(*RedisStore)

// WithRedisLogger sets the store's logger; the default discards everything.
func WithRedisLogger(l *zap.Logger) RedisOption {
	return func(s *RedisStore) { s.log = l.Named("redis") }
}

// NewRedisStore returns a store on client. It does not contact Redis: the
// script is loaded by the first call that finds it missing (EVALSHA, then
// EVAL on NOSCRIPT), or ahead of time by Load.
func NewRedisStore(client redis.UniversalClient, cfg RedisConfig, opts ...RedisOption) (*RedisStore, error) {
	if client == nil {
		return nil, errors.New("redis store: nil client")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	s := &RedisStore{client: client, sha: ScriptSHA(), cfg: cfg, log: zap.NewNop(), pause: resendPause}
	s.shaArg = s.sha
	cc, cluster := client.(*redis.ClusterClient)
	s.reuse = !cluster
	if cluster {
		s.route = newClusterRoute(cc)
	}
	for _, o := range opts {
		o(s)
	}
	if s.route != nil {
		s.route.log = s.log
	}
	s.warnUnboundedPipelines()
	s.timers.New = func() any {
		t := time.NewTimer(time.Hour)
		t.Stop()
		return t
	}
	return s, nil
}

// warnUnboundedPipelines logs a warning when the client does not apply a
// pipeline's deadline to its connection (ContextTimeoutEnabled unset) and
// its ReadTimeout is longer than PipelineTimeout: a Redis that stops
// answering then holds each pipeline, and its slot in the batcher, for the
// ReadTimeout.
func (s *RedisStore) warnUnboundedPipelines() {
	var ctxTimeout bool
	var read time.Duration
	switch c := s.client.(type) {
	case *redis.Client:
		o := c.Options()
		ctxTimeout, read = o.ContextTimeoutEnabled, o.ReadTimeout
	case *redis.ClusterClient:
		o := c.Options()
		ctxTimeout, read = o.ContextTimeoutEnabled, o.ReadTimeout
	default:
		return
	}
	if ctxTimeout || (read > 0 && read <= s.cfg.PipelineTimeout) {
		return
	}
	bound := "no bound (ReadTimeout is off)"
	if read > 0 {
		bound = read.String()
	}
	s.log.Warn("the Redis client does not apply PipelineTimeout to its connections (ContextTimeoutEnabled is off): a Redis that stops answering holds each pipeline for the client's ReadTimeout; set ContextTimeoutEnabled",
		zap.Duration("pipeline_timeout", s.cfg.PipelineTimeout), zap.String("read_timeout", bound))
}

// Load loads the script into every master (SCRIPT LOAD), so the first
// decisions need no reload.
func (s *RedisStore) Load(ctx context.Context) error {
	load := func(ctx context.Context, c *redis.Client) error {
		return c.ScriptLoad(ctx, scriptSource).Err()
	}
	var err error
	switch c := s.client.(type) {
	case *redis.ClusterClient:
		err = c.ForEachMaster(ctx, load)
	default:
		err = s.client.ScriptLoad(ctx, scriptSource).Err()
	}
	if err != nil {
		return fmt.Errorf("redis store: load script: %w", err)
	}
	return nil
}

// Close fails the calls still waiting to be sent with ErrClosed and waits for
// the pipelines in flight. It does not close the client.
func (s *RedisStore) Close() error {
	s.bmu.Lock()
	s.closed = true
	s.bmu.Unlock()
	var wg sync.WaitGroup
	for i := range s.batchers {
		if b := s.batchers[i].Load(); b != nil {
			wg.Add(1)
			go func() { // each may wait for a pipeline: all at once
				defer wg.Done()
				b.close()
			}()
		}
	}
	wg.Wait()
	s.deadline.Lock()
	if s.deadline.cancel != nil {
		s.deadline.cancel()
	}
	s.deadline.Unlock()
	return nil
}

// pipelineCtx returns the context a pipeline starting now runs under: it
// ends between PipelineTimeout minus reuse and PipelineTimeout from now.
// Pipelines starting within reuse of each other share one context, which
// saves a context and a timer per pipeline (at moderate rates that is
// nearly one per decision). A replaced context is left to end at its
// deadline, when its own timer releases it.
func (s *RedisStore) pipelineCtx() context.Context {
	reuse := min(10*time.Millisecond, s.cfg.PipelineTimeout/10)
	now := time.Now()
	d := &s.deadline
	d.Lock()
	defer d.Unlock()
	if d.ctx == nil || now.Sub(d.at) >= reuse {
		d.ctx, d.cancel = context.WithDeadline(context.Background(), now.Add(s.cfg.PipelineTimeout))
		d.at = now
	}
	return d.ctx
}

// shard returns the index of key's master on Redis Cluster (clusterRoute),
// else 0.
func (s *RedisStore) shard(key string) int {
	if s.route == nil {
		return 0
	}
	return s.route.shard(key)
}

// batcher returns shard i's batcher, making it on first use; nil once the
// store is closed.
func (s *RedisStore) batcher(i int) *batcher {
	if b := s.batchers[i%maxShards].Load(); b != nil {
		return b
	}
	s.bmu.Lock()
	defer s.bmu.Unlock()
	b := s.batchers[i%maxShards].Load()
	if b == nil && !s.closed {
		b = newBatcher(s.cfg, s.exec)
		s.batchers[i%maxShards].Store(b)
	}
	return b
}

func (s *RedisStore) run(ctx context.Context, o *op) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("redis store: %w: %w", err, errDropped)
	}
	b := s.batcher(int(o.shard))
	if b == nil {
		return ErrClosed
	}
	done, _ := s.dones.Get().(chan struct{})
	if done == nil {
		done = make(chan struct{}, 1)
	}
	o.done = done
	atomic.StoreInt32(&o.state, opQueued) // a refund is a copy of its decide, taken
	if atomic.LoadInt32(&o.moving) != 0 { // and its decide may have waited out a TRYAGAIN
		atomic.StoreInt32(&o.moving, 0)
	}
	if err := b.submit(o); err != nil {
		s.dones.Put(done) // never queued, so never signalled: still empty
		return err
	}
	var expired <-chan time.Time
	if o.timeout > 0 {
		t := s.timers.Get().(*time.Timer)
		t.Reset(o.timeout)
		defer func() {
			t.Stop() // no stale tick can be received after Stop (Go 1.23 timers)
			s.timers.Put(t)
		}()
		expired = t.C
	}
	// When the caller stops waiting, the batcher still holds o and will
	// finish it (into done, which is then dropped); the caller must not read
	// it. A call the batcher has not taken yet is abandoned: it is dropped
	// unsent, and the error says so (Unsent).
	select {
	case <-done:
		s.dones.Put(done)
		return o.err
	case <-ctx.Done():
		if o.abandon() {
			return fmt.Errorf("redis store: %w: %w", ctx.Err(), errDropped)
		}
		return ctx.Err()
	case <-expired:
		if o.abandon() {
			return fmt.Errorf("redis store: no answer within %s: %w: %w", o.timeout, context.DeadlineExceeded, errDropped)
		}
		if atomic.LoadInt32(&o.moving) != 0 {
			return fmt.Errorf("redis store: no answer within %s: %w: %w", o.timeout, context.DeadlineExceeded, errSlotMoving)
		}
		return fmt.Errorf("redis store: no answer within %s: %w", o.timeout, context.DeadlineExceeded)
	}
}

// exec sends one batch as one pipeline of EVALSHA calls, repeats the calls
// that met NOSCRIPT with EVAL (which loads the script), and fills the
// results.
func (s *RedisStore) exec(batch []*op) {
	ctx := s.pipelineCtx()
	buf, _ := s.bufs.Get().(*pipelineBuf)
	if buf == nil {
		buf = new(pipelineBuf)
	}
	calls := slices.Grow(buf.calls[:0], len(batch))[:len(batch)]
	cmds := slices.Grow(buf.cmds[:0], len(batch))
	pipe := s.pipeline()
	defer s.pipes.Put(pipe)
	for i, o := range batch {
		c := &calls[i]
		if c.buf, _ = s.cmds.Get().(*[]any); c.buf == nil {
			c.buf = new([]any)
		}
		c.args = append((*c.buf)[:0], "evalsha", s.shaArg, len(o.keys))
		for i := range o.keys {
			// A pointer into o, not the string: see op.appendArgs (a
			// Cluster client reads the first key's slot through it too).
			c.args = append(c.args, &o.keys[i])
		}
		c.args = o.appendArgs(c.args, s.cfg.StateForm == StateText, true)
		if packedReply(o.code) {
			c.zc, c.re, c.rbuf = s.zeroCopy(ctx, c.args)
		} else {
			c.cmd, c.re = s.command(ctx, c.args)
		}
		cmds = append(cmds, c.cmder())
	}
	// Queued at once: the pipeline's list is then allocated once, at its
	// size, rather than grown call by call (Exec leaves it nil).
	_ = pipe.BatchProcess(ctx, cmds...)
	_, _ = pipe.Exec(ctx) // each command carries its own error
	if s.route != nil && !s.route.ready.Load() {
		s.route.prime(ctx, cmds)
	}
	refused := false
	for i, o := range batch {
		if refusalOf(calls[i].err()) == notRefused {
			s.settle(o, &calls[i])
		} else {
			refused = true
		}
	}
	if refused {
		s.resend(ctx, batch, calls)
	}
	clear(calls)
	clear(cmds)
	buf.calls, buf.cmds = calls[:0], cmds[:0]
	s.bufs.Put(buf)
}

// maxResends is how many times a call Redis refused unrun is sent again:
// three attempts in all, go-redis's own default (Options.MaxRetries).
const maxResends = 2

// resendPause is the pause before the first resend of a call refused for a
// passing state (TRYAGAIN, LOADING, CLUSTERDOWN, MASTERDOWN), doubled for
// the next; go-redis's retries wait 8 ms and more (MinRetryBackoff).
const resendPause = 10 * time.Millisecond

// A refusal is how Redis refused a call before running any of it.
type refusal int

const (
	notRefused refusal = iota // answered, or failed in a way the script may have run
	refusedNow                // worth sending again at once
	refusedFor                // refused for a passing state: sent again after a pause
)

// refusalOf classifies a call's error. Sending a refused call again cannot
// debit twice, because nothing of it ran:
//   - NOSCRIPT: the node lost its script cache (a restart, a failover,
//     SCRIPT FLUSH); the call goes again as EVAL, which loads the script.
//   - READONLY: the node is a replica now (a failover demoted it). A
//     replica refuses every write, so the script's first write failed and
//     none came before it. go-redis closed the connection (the pipeline's
//     first reply was the error), so the call goes out on a new one, which
//     a Sentinel client, or a DNS name that follows the primary, points at
//     the new primary.
//   - TRYAGAIN (a Redis Cluster slot half moved: some of the call's keys
//     left for another node), LOADING (a restarted node reading its data),
//     CLUSTERDOWN and MASTERDOWN: refused before the command ran, until a
//     state passes.
//   - A packed reply longer than the buffer it was to be read into
//     (zeroCopy; go-redis drains it, so the connection stays in step). The
//     script ran, but only a replay answers more than the call's own rules
//     and no id (the earlier decision's id, the numbers of a record written
//     under a policy with more rules), and a replay changes nothing, so the
//     call goes again as EVAL, whose reply is read as a string.
//
// Any other error stands: the script may have run, and the rules' fail
// modes decide (see onceCmd).
func refusalOf(err error) refusal {
	switch {
	case err == nil:
		return notRefused
	case isNoScript(err), isReadOnly(err), isShortBuffer(err):
		return refusedNow
	case redis.HasErrorPrefix(err, "TRYAGAIN"), redis.HasErrorPrefix(err, "LOADING"),
		redis.HasErrorPrefix(err, "CLUSTERDOWN"), redis.HasErrorPrefix(err, "MASTERDOWN"):
		return refusedFor
	}
	return notRefused
}

// resend sends again, as EVAL with the script's source, the calls of batch
// Redis refused before running them (refusalOf), up to maxResends times
// within the pipeline's deadline, pausing first (s.pause, doubled each time)
// when one was refused for a passing state. The calls that were answered
// are settled already, so a pause delays only the refused ones; each
// refused call is settled once answered, or with its refusal when the
// resends or the deadline run out.
func (s *RedisStore) resend(ctx context.Context, batch []*op, calls []pipelined) {
	var again []int
	pause := s.pause
	for round := 0; ; round++ {
		again = again[:0]
		var wait bool
		var first error
		for i := range calls {
			c := &calls[i]
			if c.buf == nil {
				continue // settled
			}
			err := c.err()
			r := refusalOf(err)
			if r == notRefused || round == maxResends || ctx.Err() != nil {
				s.settle(batch[i], c)
				continue
			}
			if r == refusedFor {
				wait = true
				if redis.HasErrorPrefix(err, "TRYAGAIN") {
					atomic.StoreInt32(&batch[i].moving, 1) // see op.moving
				}
			}
			if first == nil {
				first = err
			}
			again = append(again, i)
		}
		if len(again) == 0 {
			return
		}
		switch {
		case isNoScript(first):
			s.log.Debug("reloading script", zap.Int("calls", len(again)))
		case isShortBuffer(first):
			s.log.Debug("a replay's reply was longer than its buffer; asking again for it as a string", zap.Int("calls", len(again)))
		default:
			s.log.Info("Redis refused calls before running them; sending them again", zap.Int("calls", len(again)), zap.Int("attempt", round+2), zap.Error(first))
		}
		if wait {
			t := time.NewTimer(pause)
			select {
			case <-ctx.Done():
				t.Stop()
				continue // settles them with their refusals
			case <-t.C:
			}
			pause *= 2
		}
		pipe := s.client.Pipeline()
		for _, i := range again {
			// Sent again now: a caller that gives up from here waited
			// for a node, not for a slot to move (op.moving).
			atomic.StoreInt32(&batch[i].moving, 0)
			c := &calls[i]
			c.args[0], c.args[1] = "eval", scriptSource
			c.cmd, c.zc = evalCmd(ctx, c.args), nil // reads its reply as a string
			_ = pipe.Process(ctx, c.cmder())
		}
		_, _ = pipe.Exec(ctx)
	}
}

// settle parses c's reply into o, gives c's argument list and reused
// command back, and finishes o. c.buf is nil afterwards.
func (s *RedisStore) settle(o *op, c *pipelined) {
	o.err = parseReply(c, o)
	if o.err != nil && s.route != nil && connLevel(c.err()) {
		s.route.reload() // its node may be gone: see clusterRoute.reload
	}
	// Drop the references (pointers into o among them) before o is
	// finished and may be reused, and before the list is.
	clear(c.args)
	*c.buf = c.args[:0]
	s.cmds.Put(c.buf)
	c.buf = nil
	if r := c.re; r != nil {
		clear(r.args)
		if r.zc != nil {
			r.zc.SetVal(0)
			r.zc.SetErr(nil)
			s.replies[len(r.args)].Put(r)
		} else {
			r.cmd.SetVal(nil)
			r.cmd.SetErr(nil)
			s.evals[len(r.args)].Put(r)
		}
	}
	if c.rbuf != nil {
		s.replyBufs.Put(c.rbuf)
	}
	c.cmd, c.zc, c.re, c.rbuf = nil, nil, nil, nil
	o.finish()
}

// onceCmd is a script call that go-redis must not retry. A pipeline that
// fails after it was written (EOF, a reset, a read timeout) may have run in
// Redis, and go-redis sends a failed pipeline again on a new connection
// (Options.MaxRetries, 3 by default): a decision would be debited twice, a
// refund given back twice, a pool's tokens taken twice. Not retried, the
// calls fail, and the rules' fail modes decide. Embedding the command keeps
// every other method of go-redis's Cmder; the value holds one pointer, so
// putting it in the list allocates nothing.
type onceCmd struct{ *redis.Cmd }

// NoRetry tells go-redis not to retry the pipeline that carries the call.
func (onceCmd) NoRetry() bool { return true }

// pipeline returns an empty pipeline of the client, a reused one when the
// pool has one (Exec leaves a pipeline empty and ready for more commands).
func (s *RedisStore) pipeline() redis.Pipeliner {
	if p, ok := s.pipes.Get().(redis.Pipeliner); ok {
		return p
	}
	return s.client.Pipeline()
}

// pipelineBuf holds a pipeline's calls and their commands between uses.
type pipelineBuf struct {
	calls []pipelined
	cmds  []redis.Cmder
}

// pipelined is one call of a pipeline: its command and its argument list,
// which goes back to RedisStore.cmds once the reply is parsed, and the
// reused command, which goes back to RedisStore.evals or .replies.
type pipelined struct {
	cmd  *redis.Cmd               // the call, unless zc is
	zc   *redis.ZeroCopyStringCmd // the call of a decide or a refund (zeroCopy)
	args []any
	buf  *[]any
	re   *reusable
	rbuf *[]byte // zc's reply buffer when zc is not reused (RedisStore.replyBufs)
}

// err is the call's error.
func (c *pipelined) err() error {
	if c.zc != nil {
		return c.zc.Err()
	}
	return c.cmd.Err()
}

// cmder is the call as the pipeline sends it; go-redis retries neither
// (see onceCmd; ZeroCopyStringCmd refuses retries of its own).
func (c *pipelined) cmder() redis.Cmder {
	if c.zc != nil {
		return c.zc
	}
	return onceCmd{c.cmd}
}

// maxReusedArgs is the longest argument list of a reused command: a
// decision of up to eight rules (3 + 1 + 8 keys + 8 arguments), and more.
const maxReusedArgs = 24

// reusable is an EVALSHA command kept, with its argument list, for the next
// call with as many arguments. The Cmd was the largest allocation of a
// decision (~120 of ~280 bytes for one rule). go-redis keeps the list it is
// given (NewCmd(ctx, args...) does not copy it) and a command's result is
// set with SetVal and SetErr, so a command is reused by writing the next
// call's arguments into its list and clearing its result. Not with a
// Cluster client, which memoizes a command's slot in it.
type reusable struct {
	cmd  *redis.Cmd
	zc   *redis.ZeroCopyStringCmd // instead of cmd, in RedisStore.replies
	args []any
}

// command returns the command for an EVALSHA call of args: a reused one of
// as many arguments when the store reuses commands (with args copied into
// it, so the caller may reuse args), else a new one on args.
func (s *RedisStore) command(ctx context.Context, args []any) (*redis.Cmd, *reusable) {
	n := len(args)
	if !s.reuse || n > maxReusedArgs {
		return evalCmd(ctx, args), nil
	}
	r, _ := s.evals[n].Get().(*reusable)
	if r == nil {
		r = &reusable{args: make([]any, n)}
		copy(r.args, args)
		// A command's context is not read after it is made (only Clone
		// and MONITOR do); each pipeline runs under its own.
		r.cmd = evalCmd(context.Background(), r.args)
		return r.cmd, r
	}
	copy(r.args, args)
	return r.cmd, r
}

// packedReply reports whether the script answers an operation with a
// packed string (decision_reply): a decide or a refund.
func packedReply(code byte) bool { return code == opDecide || code == opRefund }

// maxReplyID is the room for a decision id in a packed reply's buffer (the
// earlier decision's, on a replay): Engine.newID makes ids of ~32 bytes. A
// replay whose reply does not fit goes again (refusalOf).
const maxReplyID = 64

// replyLen is the room a packed reply to a call of args takes at most: the
// head, an id, and 2 + 4 numbers per rule as doubles, with a rule per key
// (KEYS come after the name, the sha and their count; ARGV holds 8 values).
func replyLen(args []any) int {
	rules := max(len(args)-3-8, 1)
	return 3 + maxReplyID + 8*(2+4*rules)
}

// zeroCopy returns the command for a call of args whose reply is packed: a
// ZeroCopyStringCmd, which reads the reply into a buffer of its own rather
// than into a new string boxed in an interface (~48 of the ~180 bytes a
// decision allocated at moderate rates, a quarter of the garbage that sets
// how often the gateway collects: allotbench's paced tail gathers next to
// the collector's cycles). A reused one when the store reuses commands
// (its buffer with it), else a new one on a pooled buffer, returned as buf
// to be given back once the reply is parsed. The reply is valid until
// then: parseDecision copies what outlives it.
func (s *RedisStore) zeroCopy(ctx context.Context, args []any) (zc *redis.ZeroCopyStringCmd, r *reusable, buf *[]byte) {
	n := len(args)
	if !s.reuse || n > maxReusedArgs {
		need := replyLen(args)
		if buf, _ = s.replyBufs.Get().(*[]byte); buf == nil || len(*buf) < need {
			b := make([]byte, need)
			buf = &b
		}
		zc = redis.NewZeroCopyStringCmd(ctx, *buf, args...)
		routeByFirstKey(zc, args)
		return zc, nil, buf
	}
	if r, _ = s.replies[n].Get().(*reusable); r == nil {
		r = &reusable{args: make([]any, n)}
		r.zc = redis.NewZeroCopyStringCmd(context.Background(), make([]byte, replyLen(args)), r.args...)
		routeByFirstKey(r.zc, args)
	}
	copy(r.args, args)
	return r.zc, r, nil
}

// evalCmd is EVAL or EVALSHA (args[0]) with args laid out as go-redis's
// Eval lays them out: name, script or sha, key count, keys, ARGV. Building
// the list here rather than calling EvalSha saves a copy of it per call.
func evalCmd(ctx context.Context, args []any) *redis.Cmd {
	c := redis.NewCmd(ctx, args...)
	routeByFirstKey(c, args)
	return c
}

// routeByFirstKey tells go-redis that the slot of c, a script call of
// args, is its first key's, when it has keys (a Cluster client routes it
// there).
func routeByFirstKey(c interface{ SetFirstKeyPos(int8) }, args []any) {
	if n, _ := args[2].(int); n > 0 {
		c.SetFirstKeyPos(3)
	}
}

// isShortBuffer reports whether err is go-redis's refusal of a reply
// longer than a ZeroCopyStringCmd's buffer.
func isShortBuffer(err error) bool {
	return err != nil && strings.HasPrefix(err.Error(), "redis: buffer too small")
}

func isNoScript(err error) bool {
	return err != nil && redis.HasErrorPrefix(err, "NOSCRIPT")
}

func isReadOnly(err error) bool {
	return err != nil && redis.HasErrorPrefix(err, "READONLY")
}

// parseReply fills o from the script's reply to c: a packed string for a
// decision or a refund (decision_reply in script.lua), an array of
// integers for the other operations.
func parseReply(c *pipelined, o *op) error {
	if c.zc != nil {
		if err := c.zc.Err(); err != nil {
			return err
		}
		return parseDecision(c.zc.Bytes(), o)
	}
	if packedReply(o.code) {
		s, err := c.cmd.Text()
		if err != nil {
			return err
		}
		return parseDecision(s, o)
	}
	vals, err := c.cmd.Slice()
	if err != nil {
		return err
	}
	out := slices.Grow(o.out[:0], len(vals)) // a reused op keeps its capacity
	for i, v := range vals {
		n, ok := v.(int64)
		if !ok {
			return fmt.Errorf("redis store: reply[%d] is %T, want an integer", i, v)
		}
		out = append(out, n)
	}
	o.out = out
	return nil
}

// parseDecision decodes a packed decision (decision_reply in script.lua):
// the numbers' width (1 byte: 4 or 8), the id's length (2 bytes, little
// endian), the id (the earlier decision's on a replay, else empty: o's own),
// then integers as little-endian int32s or doubles. From a string the id
// shares the reply's memory, from a buffer it is copied (the buffer is
// reused); nothing else is allocated when o.out has room.
func parseDecision[R string | []byte](s R, o *op) error {
	if len(s) < 3 {
		return fmt.Errorf("redis store: decision reply of %d bytes", len(s))
	}
	width := int(s[0])
	if width != 4 && width != 8 {
		return fmt.Errorf("redis store: decision reply with %d-byte numbers", width)
	}
	idLen := int(s[1]) | int(s[2])<<8
	nums := len(s) - 3 - idLen
	if nums < 0 || nums%width != 0 {
		return fmt.Errorf("redis store: decision reply of %d bytes with a %d-byte id and %d-byte numbers", len(s), idLen, width)
	}
	out := slices.Grow(o.out[:0], nums/width)
	for i := 3 + idLen; i < len(s); i += width {
		if width == 4 {
			out = append(out, int64(int32(uint32(s[i])|uint32(s[i+1])<<8|uint32(s[i+2])<<16|uint32(s[i+3])<<24)))
			continue
		}
		var bits uint64
		for j := 7; j >= 0; j-- {
			bits = bits<<8 | uint64(s[i+j])
		}
		f := math.Float64frombits(bits)
		if f != math.Trunc(f) || math.Abs(f) > 1<<53 { // also NaN and infinities
			return fmt.Errorf("redis store: decision reply number %d is %v, want an integer", len(out), f)
		}
		out = append(out, int64(f))
	}
	o.outID = o.id
	if idLen > 0 {
		o.outID = string(s[3 : 3+idLen])
	}
	o.out = out
	return nil
}
