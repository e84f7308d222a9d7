package chaos

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/allot-dev/allot/chaos/driver"
	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/pkg/lease"
	"github.com/allot-dev/allot/pkg/topology"
)

// ErrNeedsAgent is returned by Region methods the region driver cannot
// honour because they need the real region agent and its Redis
// (AgentRegion): a scenario that gets it is reported as skipped.
var ErrNeedsAgent = errors.New("needs the region agent")

// Region is the region side of the suite: whatever runs inside a region's
// network namespace, leases quotas from the allocators, admits requests
// against them and reports what it did. The suite only talks to regions
// through this interface: AgentRegion (regionagent, redis-server and a load
// generator) and DriverRegion (the chaosregion driver) implement it.
type Region interface {
	// Name is the region as the policy declares it.
	Name() string
	// Start starts the region in env.Host and returns once it runs.
	Start(ctx context.Context, env RegionEnv) error
	// SetDemand sets the offered requests per second of a quota.
	SetDemand(ctx context.Context, quota string, perSecond float64) error
	// SetClockSkew skews the region's clock by skew from true time (an
	// agent region restarts its agent with the skewed clock).
	SetClockSkew(ctx context.Context, skew time.Duration) error
	// Storm makes every quota renew at once: the driver fires n concurrent
	// extra Acquires per quota, an agent region a burst of requests that
	// drains every pool.
	Storm(ctx context.Context, n int) error
	// RestartStore restarts the region's store (Redis), losing its tokens.
	RestartStore(ctx context.Context) error
	// Stop stops the load, hands back held tokens, settles pending
	// requests, delivers its last events and ends the region's processes.
	Stop(ctx context.Context) error
}

// RegionEnv is what the suite gives a region when it starts.
type RegionEnv struct {
	// Host is the region's network namespace.
	Host *topology.Host
	// Allocators are the API addresses of every allocator host. The suite
	// steers connections to them through the region's WAN fault proxies
	// (iptables DNAT in the region's namespace), so the region dials them
	// as they are.
	Allocators []string
	// AllocatorsGRPC are the gRPC addresses (-grpc-addr) of every allocator
	// host, steered through the same WAN proxies' twins; agents lease there.
	AllocatorsGRPC []string
	// Quotas are the loads to offer.
	Quotas []QuotaLoad
	// Clock is the suite's true clock; Record takes every event it stamps.
	Clock  history.TrueClock
	Record func(...history.Event)
	// Margin is the lease margin the allocator's bound assumes.
	Margin time.Duration
	// Dir is a directory of the region's own; Log receives its processes' output.
	Dir string
	Log io.Writer
	// LogDir keeps files worth reading after the run (an agent region's
	// lease journal); it outlives Dir.
	LogDir string
	// Seed seeds the region's randomness.
	Seed uint64
}

// QuotaLoad is the load a region offers for one quota.
type QuotaLoad struct {
	// Quota, its window, chunk, TTL and clamp as the policy states them.
	Quota  string
	Window time.Duration
	Chunk  int64
	TTL    time.Duration
	Clamp  bool
	// Rate is the offered requests per second; FloodRate, when set,
	// alternates with it by window.
	Rate, FloodRate float64
	// Independent and WallDeadline are the broken modes of region drivers
	// (see driver.QuotaConfig); agent regions refuse them.
	Independent  int64
	WallDeadline bool
}

// DriverRegion is a Region run by the chaosregion process (package
// chaos/driver), which talks to the suite over a control socket.
type DriverRegion struct {
	name string
	bin  string
	ctl  *control
	proc *topology.Process
	conn *driverConn
}

var _ Region = (*DriverRegion)(nil)

// newDriverRegion returns a driver region; bin is the chaosregion binary.
func newDriverRegion(name, bin string, ctl *control) *DriverRegion {
	return &DriverRegion{name: name, bin: bin, ctl: ctl}
}

// Name implements Region.
func (d *DriverRegion) Name() string { return d.name }

// Start implements Region: it writes the driver's config, starts
// chaosregion inside the host and waits for its hello.
func (d *DriverRegion) Start(ctx context.Context, env RegionEnv) error {
	cfg := driver.Config{
		Region: d.name, Endpoints: env.Allocators, Margin: env.Margin, ProbeEvery: 8,
		Seed: env.Seed, ClockOffset: env.Clock.Offset,
		// Retry an unanswered request id for a bit more than one window,
		// well inside the allocator's idempotency retention of two.
		RetryFor: 4 * time.Second,
	}
	for _, q := range env.Quotas {
		cfg.Quotas = append(cfg.Quotas, driver.QuotaConfig{
			Name: q.Quota, WindowMs: q.Window.Milliseconds(), Rate: q.Rate, FloodRate: q.FloodRate,
			Independent: q.Independent, WallDeadline: q.WallDeadline, Clamp: q.Clamp,
			// Renew half a TTL ahead: a renewal may take several WAN round
			// trips (a retransmission, a busy leader) before it lands.
			// Chunks are sized for that lead plus one round trip.
			Sizing: lease.Sizing{MinChunk: 1, MaxChunk: q.Chunk, Lead: q.TTL / 2, RTT: 120 * time.Millisecond},
		})
	}
	var err error
	d.proc, d.conn, err = d.ctl.start(ctx, env.Host, "chaosregion-"+d.name, d.bin, nil, filepath.Join(env.Dir, d.name+".json"), cfg,
		d.name, "region "+d.name, env.Log)
	return err
}

// SetDemand implements Region.
func (d *DriverRegion) SetDemand(ctx context.Context, quota string, perSecond float64) error {
	return d.conn.call(ctx, history.Command{Op: history.OpDemand, Quota: quota, Rate: perSecond})
}

// SetClockSkew implements Region.
func (d *DriverRegion) SetClockSkew(ctx context.Context, skew time.Duration) error {
	return d.conn.call(ctx, history.Command{Op: history.OpSkew, Skew: int64(skew)})
}

// Storm implements Region.
func (d *DriverRegion) Storm(ctx context.Context, n int) error {
	return d.conn.call(ctx, history.Command{Op: history.OpStorm, N: n})
}

// RestartStore implements Region: the driver holds its tokens in memory and
// has no store to restart (AgentRegion restarts its redis-server), so the
// restart-store scenario is reported as skipped with drivers.
func (d *DriverRegion) RestartStore(context.Context) error {
	return fmt.Errorf("region %s: restart the store: %w", d.name, ErrNeedsAgent)
}

// Stop implements Region.
func (d *DriverRegion) Stop(ctx context.Context) error {
	if d.proc == nil {
		return nil
	}
	var err error
	if d.conn != nil && !d.proc.Exited() {
		err = d.conn.call(ctx, history.Command{Op: history.OpStop})
	}
	select {
	case <-d.proc.Done():
	case <-ctx.Done():
		d.proc.Kill()
		err = errors.Join(err, fmt.Errorf("region %s: killed after %w", d.name, ctx.Err()))
	}
	if d.conn != nil {
		d.conn.wait(time.Second) // the last events are read before we return
	}
	return err
}

// control is the suite's end of the region processes' control socket
// (drivers, load generators): a unix socket path, which reaches every
// namespace and which no iptables rule touches.
type control struct {
	path   string
	ln     net.Listener
	record func(...history.Event)
	mu     sync.Mutex
	want   map[string]chan *driverConn
	wg     sync.WaitGroup
}

func newControl(path string, record func(...history.Event)) (*control, error) {
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	c := &control{path: path, ln: ln, record: record, want: map[string]chan *driverConn{}}
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			c.wg.Add(1)
			go func() { defer c.wg.Done(); c.serve(conn) }()
		}
	}()
	return c, nil
}

func (c *control) expect(name string) <-chan *driverConn {
	ch := make(chan *driverConn, 1)
	c.mu.Lock()
	c.want[name] = ch
	c.mu.Unlock()
	return ch
}

// start writes cfg as JSON to cfgPath, starts bin (as name, with args and
// -config cfgPath -ctl <socket>) inside host, and waits until it says hello
// as hello on the control socket. what names the process in errors.
func (c *control) start(ctx context.Context, host *topology.Host, name, bin string, args []string, cfgPath string, cfg any,
	hello, what string, log io.Writer) (*topology.Process, *driverConn, error) {
	b, err := json.MarshalIndent(cfg, "", "  ")
	if err != nil {
		return nil, nil, err
	}
	if err := os.WriteFile(cfgPath, b, 0o644); err != nil {
		return nil, nil, err
	}
	ch := c.expect(hello)
	proc, err := host.StartProcess(name, bin, append(args, "-config", cfgPath, "-ctl", c.path), log)
	if err != nil {
		return nil, nil, err
	}
	select {
	case conn := <-ch:
		return proc, conn, nil
	case <-proc.Done():
		return proc, nil, fmt.Errorf("%s exited: %s", what, proc.Output())
	case <-ctx.Done():
		return proc, nil, fmt.Errorf("%s did not say hello: %w", what, ctx.Err())
	}
}

func (c *control) close() {
	c.ln.Close()
	c.wg.Wait()
}

// driverConn is one region process's control connection.
type driverConn struct {
	conn net.Conn
	mu   sync.Mutex
	enc  *json.Encoder
	seq  int64
	acks map[int64]chan string
	done chan struct{}
}

func (c *control) serve(conn net.Conn) {
	defer conn.Close()
	dec := json.NewDecoder(bufio.NewReaderSize(conn, 256<<10))
	var hello history.Message
	if err := dec.Decode(&hello); err != nil || hello.Hello == "" {
		return
	}
	dc := &driverConn{conn: conn, enc: json.NewEncoder(conn), acks: map[int64]chan string{}, done: make(chan struct{})}
	defer close(dc.done)
	c.mu.Lock()
	ch := c.want[hello.Hello]
	delete(c.want, hello.Hello)
	c.mu.Unlock()
	if ch == nil {
		return
	}
	ch <- dc
	for {
		var m history.Message
		if err := dec.Decode(&m); err != nil {
			return
		}
		switch {
		case m.Event != nil:
			c.record(*m.Event)
		case m.Ack != nil:
			dc.mu.Lock()
			a := dc.acks[m.Ack.Seq]
			delete(dc.acks, m.Ack.Seq)
			dc.mu.Unlock()
			if a != nil {
				a <- m.Ack.Err
			}
		}
	}
}

func (dc *driverConn) call(ctx context.Context, cmd history.Command) error {
	ack := make(chan string, 1)
	dc.mu.Lock()
	dc.seq++
	cmd.Seq = dc.seq
	dc.acks[cmd.Seq] = ack
	err := dc.enc.Encode(history.Message{Command: &cmd})
	dc.mu.Unlock()
	if err != nil {
		return err
	}
	select {
	case e := <-ack:
		if e != "" {
			return errors.New(e)
		}
		return nil
	case <-dc.done:
		return fmt.Errorf("%s: the region process went away", cmd.Op)
	case <-ctx.Done():
		return fmt.Errorf("%s: %w", cmd.Op, ctx.Err())
	}
}

func (dc *driverConn) wait(d time.Duration) {
	select {
	case <-dc.done:
	case <-time.After(d):
		dc.conn.Close()
		<-dc.done
	}
}
