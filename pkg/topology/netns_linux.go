//go:build linux

package topology

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// NetnsSupport reports, wrapping ErrNetnsUnavailable with the reason, why
// this process cannot build a Lab; nil when it can. It creates and deletes a
// probe namespace, which is what fails in an unprivileged container.
func NetnsSupport(ctx context.Context) error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("%w: not root (euid %d); namespaces, veth pairs and iptables need root", ErrNetnsUnavailable, os.Geteuid())
	}
	for _, bin := range []string{"ip", "iptables"} {
		if _, err := exec.LookPath(bin); err != nil {
			return fmt.Errorf("%w: %s not found (Debian: apt-get install -y iproute2 iptables)", ErrNetnsUnavailable, bin)
		}
	}
	probe := "allotprobe" + strconv.Itoa(os.Getpid())
	if _, err := run(ctx, "ip", "netns", "add", probe); err != nil {
		return fmt.Errorf("%w: %v", ErrNetnsUnavailable, err)
	}
	if _, err := run(ctx, "ip", "netns", "del", probe); err != nil {
		return fmt.Errorf("%w: %v", ErrNetnsUnavailable, err)
	}
	return nil
}

// lockFile takes an exclusive flock on path, polling until wait passes.
func lockFile(ctx context.Context, path string, wait time.Duration) (func(), error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("lab lock: %w", err)
	}
	deadline := time.Now().Add(wait)
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() {
				_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
				f.Close()
			}, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) || time.Now().After(deadline) {
			f.Close()
			return nil, fmt.Errorf("lab lock %s (another run holds it?): %w", path, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func killPid(pid int) {
	if pid > 1 && pid != os.Getpid() {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// inNetns runs fn on a locked OS thread switched into namespace ns, so the
// sockets fn creates live there. The thread is switched back afterwards; if
// that fails it stays locked and the runtime ends it with the goroutine.
func inNetns(ns string, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("netns: own namespace: %w", err)
			return
		}
		defer unix.Close(orig)
		target, err := unix.Open("/var/run/netns/"+ns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("netns %s: %w", ns, err)
			return
		}
		defer unix.Close(target)
		if err := unix.Setns(target, unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("setns %s: %w", ns, err)
			return
		}
		ferr := fn()
		if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
			errc <- errors.Join(ferr, fmt.Errorf("setns back from %s: %w", ns, err))
			return // the thread stays locked and dies with this goroutine
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// MarkedDialer returns a dialer whose sockets carry firewall mark mark
// (SO_MARK), so iptables rules can tell them apart (a transparent proxy's
// own upstream connections must not be redirected to itself).
func MarkedDialer(mark int, timeout time.Duration) *net.Dialer {
	return &net.Dialer{Timeout: timeout, Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) {
			serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_MARK, mark)
		}); err != nil {
			return err
		}
		return serr
	}}
}
