// Package topology starts a local allot topology of real processes on one
// machine: an allocator cluster now, and regions with their stores and agents
// as they arrive. deploy/multiregion (the README's run command) and the chaos
// suite use it; integration tests use it too.
package topology

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"
)

// Process is one started child process. Its output goes to the writer given
// at start and is kept (the last 64 KiB) for diagnostics.
type Process struct {
	// Name labels the process in logs.
	Name string
	cmd  *exec.Cmd
	tail *tailBuffer
	done chan struct{}
	err  error
}

// StartProcess runs bin with args. out (may be nil) receives its output.
func StartProcess(name, bin string, args []string, out io.Writer) (*Process, error) {
	return startProcess(name, bin, args, nil, out)
}

// startProcess runs bin with args, in this process's environment plus env
// ("KEY=value" entries, which win over this process's): secrets go there,
// not in args, which ps shows to every local user.
func startProcess(name, bin string, args, env []string, out io.Writer) (*Process, error) {
	p := &Process{Name: name, cmd: exec.Command(bin, args...), tail: &tailBuffer{max: 64 << 10}, done: make(chan struct{})}
	if len(env) > 0 {
		p.cmd.Env = append(os.Environ(), env...)
	}
	w := io.Writer(p.tail)
	if out != nil {
		w = io.MultiWriter(p.tail, out)
	}
	p.cmd.Stdout, p.cmd.Stderr = w, w
	p.cmd.SysProcAttr = childAttr()
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// Pid returns the process id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Output returns the last 64 KiB the process printed.
func (p *Process) Output() string { return p.tail.String() }

// Exited reports whether the process has ended.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Done is closed when the process ends.
func (p *Process) Done() <-chan struct{} { return p.done }

// Signal sends sig to the process.
func (p *Process) Signal(sig os.Signal) error { return p.cmd.Process.Signal(sig) }

// Kill sends SIGKILL and waits for the process to end.
func (p *Process) Kill() {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// Stop sends SIGTERM and waits up to grace for a clean exit, then kills. It
// returns an error when the process did not exit cleanly in time.
func (p *Process) Stop(grace time.Duration) error {
	if p.Exited() {
		return p.exitErr()
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return p.exitErr()
	case <-time.After(grace):
		p.Kill()
		return fmt.Errorf("%s did not stop within %s", p.Name, grace)
	}
}

func (p *Process) exitErr() error {
	if p.err != nil {
		return fmt.Errorf("%s exited: %w", p.Name, p.err)
	}
	return nil
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	b   bytes.Buffer
	max int
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b.Write(p)
	if over := t.b.Len() - t.max; over > 0 {
		t.b.Next(over)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.b.String()
}

// Build compiles the main packages pkgs (e.g. "./cmd/allocator") of the module
// at root into dir and returns their paths by package.
func Build(ctx context.Context, root, dir string, pkgs ...string) (map[string]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	out := map[string]string{}
	args := []string{"build", "-o", dir + string(os.PathSeparator)}
	args = append(args, pkgs...)
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("go build: %w\n%s", err, b)
	}
	for _, p := range pkgs {
		out[p] = filepath.Join(dir, filepath.Base(p))
	}
	return out, nil
}

// ModuleRoot finds the directory holding go.mod, from dir upwards.
func ModuleRoot(dir string) (string, error) {
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
			return d, nil
		}
		if filepath.Dir(d) == d {
			return "", errors.New("go.mod not found above " + dir)
		}
	}
}
