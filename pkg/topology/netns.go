package topology

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
)

// ErrNetnsUnavailable is returned (wrapped, with the reason) when this
// process cannot build network namespaces: not root, not Linux, or ip or
// iptables missing.
var ErrNetnsUnavailable = errors.New("network namespaces unavailable")

// LabConfig describes a Lab: one bridge in the root namespace and hosts, each
// a network namespace joined to the bridge by a veth pair.
type LabConfig struct {
	// Prefix starts the name of every namespace, link, lock file and iptables
	// comment the lab makes (at most 8 bytes, so link names fit in 15), so a
	// later run can find and remove the leftovers of a crashed one.
	Prefix string
	// Subnet is the first three octets of the lab's /24, e.g. "10.77.0". The
	// bridge (the root namespace's address in the lab) takes .1.
	Subnet string
	// LockWait bounds how long NewLab waits for another lab with the same
	// prefix (another run) to finish.
	LockWait time.Duration
}

// Lab is a set of network namespaces ("hosts") on one bridge. Processes run
// inside a host through `ip netns exec`; sockets of this process can be made
// inside a host with Listen and Dial. Close removes everything it made; so
// does SweepLab for the leftovers of a crashed run.
type Lab struct {
	cfg     LabConfig
	bridge  string
	unlock  func()
	mu      sync.Mutex
	hosts   []*Host
	closed  bool
	gateway string
}

// Host is one network namespace of a Lab with its own address.
type Host struct {
	// Name is the short name given to AddHost, e.g. "a1" or "eu".
	Name string
	// NS is the namespace name (the lab prefix + Name).
	NS string
	// IP is the host's address on the lab bridge.
	IP string
	// Veth is the root-namespace end of the host's veth pair.
	Veth string
}

// NewLab takes the lab's lock (waiting for a concurrent run with the same
// prefix), removes leftovers of a crashed earlier run (SweepLab), and
// creates the bridge.
func NewLab(ctx context.Context, cfg LabConfig) (*Lab, error) {
	if err := NetnsSupport(ctx); err != nil {
		return nil, err
	}
	if cfg.Prefix == "" || len(cfg.Prefix) > 8 {
		return nil, fmt.Errorf("lab: prefix %q: want 1 to 8 bytes", cfg.Prefix)
	}
	if strings.Count(cfg.Subnet, ".") != 2 {
		return nil, fmt.Errorf("lab: subnet %q: want three octets like 10.77.0", cfg.Subnet)
	}
	if cfg.LockWait <= 0 {
		cfg.LockWait = 5 * time.Minute
	}
	unlock, err := lockFile(ctx, filepath.Join("/tmp", cfg.Prefix+"lab.lock"), cfg.LockWait)
	if err != nil {
		return nil, err
	}
	l := &Lab{cfg: cfg, bridge: cfg.Prefix + "br", unlock: unlock, gateway: cfg.Subnet + ".1"}
	if err := SweepLab(ctx, cfg.Prefix); err != nil {
		unlock()
		return nil, err
	}
	steps := [][]string{
		{"ip", "link", "add", l.bridge, "type", "bridge"},
		{"ip", "addr", "add", l.gateway + "/24", "dev", l.bridge},
		{"ip", "link", "set", l.bridge, "up"},
		// Bridged frames pass the root namespace's FORWARD chain when
		// br_netfilter is loaded; make sure a DROP policy there does not
		// cut the lab. The comment lets SweepLab find the rule.
		{"iptables", "-w", "-I", "FORWARD", "-i", l.bridge, "-o", l.bridge, "-j", "ACCEPT", "-m", "comment", "--comment", cfg.Prefix + "lab"},
	}
	for _, s := range steps {
		if _, err := run(ctx, s[0], s[1:]...); err != nil {
			return nil, errors.Join(err, l.Close())
		}
	}
	return l, nil
}

// Gateway returns the bridge's address: the root namespace as seen from hosts.
func (l *Lab) Gateway() string { return l.gateway }

// Bridge returns the bridge's name.
func (l *Lab) Bridge() string { return l.bridge }

// AddHost creates namespace prefix+name with address subnet.octet, joined to
// the bridge, with its loopback up.
func (l *Lab) AddHost(ctx context.Context, name string, octet int) (*Host, error) {
	if octet < 2 || octet > 254 {
		return nil, fmt.Errorf("lab: host %s: octet %d: want 2 to 254", name, octet)
	}
	h := &Host{Name: name, NS: l.cfg.Prefix + name, IP: l.cfg.Subnet + "." + strconv.Itoa(octet), Veth: l.cfg.Prefix + name}
	if len(h.Veth) > 15 {
		return nil, fmt.Errorf("lab: host %s: link name %q longer than 15 bytes", name, h.Veth)
	}
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil, errors.New("lab: closed")
	}
	l.hosts = append(l.hosts, h)
	l.mu.Unlock()
	steps := [][]string{
		{"ip", "netns", "add", h.NS},
		{"ip", "link", "add", h.Veth, "type", "veth", "peer", "name", "eth0", "netns", h.NS},
		{"ip", "link", "set", h.Veth, "master", l.bridge, "up"},
		{"ip", "-n", h.NS, "addr", "add", h.IP + "/24", "dev", "eth0"},
		{"ip", "-n", h.NS, "link", "set", "eth0", "up"},
		{"ip", "-n", h.NS, "link", "set", "lo", "up"},
	}
	for _, s := range steps {
		if _, err := run(ctx, s[0], s[1:]...); err != nil {
			return nil, err
		}
	}
	return h, nil
}

// Hosts returns the hosts added so far.
func (l *Lab) Hosts() []*Host {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]*Host(nil), l.hosts...)
}

// Close kills every process left in the lab's namespaces, deletes the
// namespaces, links and the FORWARD rule, and releases the lock. It is safe
// to call more than once.
func (l *Lab) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	l.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := SweepLab(ctx, l.cfg.Prefix)
	l.unlock()
	return err
}

// SweepLab removes what a lab with this prefix left behind: it kills (by
// pid) the processes inside its namespaces, deletes the namespaces and the
// links whose names start with prefix, and removes the root FORWARD rule it
// added. NewLab calls it while holding the lab's lock, so it never touches a
// live run.
func SweepLab(ctx context.Context, prefix string) error {
	if prefix == "" {
		return errors.New("sweep: empty prefix")
	}
	var errs []error
	out, err := run(ctx, "ip", "netns", "list")
	if err != nil {
		return err
	}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || !strings.HasPrefix(f[0], prefix) {
			continue
		}
		ns := f[0]
		if pids, err := run(ctx, "ip", "netns", "pids", ns); err == nil {
			for _, p := range strings.Fields(string(pids)) {
				if pid, err := strconv.Atoi(p); err == nil {
					killPid(pid)
				}
			}
		}
		if _, err := run(ctx, "ip", "netns", "del", ns); err != nil {
			errs = append(errs, err)
		}
	}
	out, err = run(ctx, "ip", "-o", "link", "show")
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		name, _, _ := strings.Cut(strings.TrimSuffix(f[1], ":"), "@")
		if !strings.HasPrefix(name, prefix) {
			continue
		}
		// A veth whose peer namespace was just deleted may already be gone.
		if _, err := run(ctx, "ip", "link", "del", name); err != nil && linkExists(ctx, name) {
			errs = append(errs, err)
		}
	}
	if rules, err := run(ctx, "iptables", "-w", "-S", "FORWARD"); err == nil {
		for _, rule := range strings.Split(string(rules), "\n") {
			if !strings.Contains(rule, prefix+"lab") || !strings.HasPrefix(rule, "-A ") {
				continue
			}
			args := append([]string{"-w", "-D"}, splitRule(strings.TrimPrefix(rule, "-A "))...)
			if _, err := run(ctx, "iptables", args...); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// splitRule splits an iptables -S line into arguments, honouring the double
// quotes iptables puts around comments.
func splitRule(s string) []string {
	var out []string
	var cur strings.Builder
	quoted, has := false, false
	for _, r := range s {
		switch {
		case r == '"':
			quoted, has = !quoted, true
		case r == ' ' && !quoted:
			if has {
				out = append(out, cur.String())
				cur.Reset()
				has = false
			}
		default:
			cur.WriteRune(r)
			has = true
		}
	}
	if has {
		out = append(out, cur.String())
	}
	return out
}

func linkExists(ctx context.Context, name string) bool {
	_, err := run(ctx, "ip", "link", "show", name)
	return err == nil
}

// Command returns the program and arguments that run bin with args inside h.
func (h *Host) Command(bin string, args ...string) (string, []string) {
	return "ip", append([]string{"netns", "exec", h.NS, bin}, args...)
}

// StartProcess starts bin with args inside h (see StartProcess). `ip netns
// exec` execs bin in place, so the Process's pid and signals are bin's.
func (h *Host) StartProcess(name, bin string, args []string, out io.Writer) (*Process, error) {
	return h.startProcess(name, bin, args, nil, out)
}

// startProcess starts bin with args inside h, with env added to its
// environment (`ip netns exec` passes the environment on).
func (h *Host) startProcess(name, bin string, args, env []string, out io.Writer) (*Process, error) {
	prog, argv := h.Command(bin, args...)
	return startProcess(name, prog, argv, env, out)
}

// Run runs bin with args inside h and returns its combined output.
func (h *Host) Run(ctx context.Context, bin string, args ...string) ([]byte, error) {
	prog, argv := h.Command(bin, args...)
	return run(ctx, prog, argv...)
}

// IPTables runs iptables with args inside h (waiting for the xtables lock).
func (h *Host) IPTables(ctx context.Context, args ...string) error {
	_, err := h.Run(ctx, "iptables", append([]string{"-w"}, args...)...)
	return err
}

// SetLink takes the root-namespace end of h's veth down or up: a cut of
// every path to and from h.
func (h *Host) SetLink(ctx context.Context, up bool) error {
	state := "down"
	if up {
		state = "up"
	}
	_, err := run(ctx, "ip", "link", "set", h.Veth, state)
	return err
}

// Listen opens a listener whose socket lives in h's namespace.
func (h *Host) Listen(network, addr string) (net.Listener, error) {
	var ln net.Listener
	err := inNetns(h.NS, func() error {
		var err error
		ln, err = net.Listen(network, addr)
		return err
	})
	return ln, err
}

// DialContext dials from h's namespace with d (nil: a default dialer).
func (h *Host) DialContext(ctx context.Context, d *net.Dialer, network, addr string) (net.Conn, error) {
	if d == nil {
		d = &net.Dialer{}
	}
	var c net.Conn
	err := inNetns(h.NS, func() error {
		var err error
		c, err = d.DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

func run(ctx context.Context, prog string, args ...string) ([]byte, error) {
	var b bytes.Buffer
	cmd := exec.CommandContext(ctx, prog, args...)
	cmd.Stdout, cmd.Stderr = &b, &b
	if err := cmd.Run(); err != nil {
		return b.Bytes(), fmt.Errorf("%s %s: %w: %s", prog, strings.Join(args, " "), err, strings.TrimSpace(b.String()))
	}
	return b.Bytes(), nil
}
