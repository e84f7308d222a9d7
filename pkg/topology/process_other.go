//go:build !linux

package topology

import "syscall"

// childAttr puts a child in its own process group, so a Ctrl-C in the
// terminal reaches only us and we stop children in order.
func childAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{Setpgid: true} }
