package redistest

import "syscall"

// procAttr makes the kernel kill a server when the test process dies.
func procAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
