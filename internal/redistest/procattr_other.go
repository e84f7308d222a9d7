//go:build !linux

package redistest

import "syscall"

// procAttr has no parent-death signal outside Linux; Close must run.
func procAttr() *syscall.SysProcAttr { return nil }
