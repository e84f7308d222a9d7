package topology

import "syscall"

// childAttr puts a child in its own process group, so a Ctrl-C in the
// terminal reaches only us and we stop children in order, and has the
// kernel send it SIGTERM if we die without stopping it (a SIGKILL, a
// crash), so no allocator or agent outlives the topology that started it.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
}
