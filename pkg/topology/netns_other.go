//go:build !linux

package topology

import (
	"context"
	"fmt"
	"net"
	"runtime"
	"time"
)

// NetnsSupport reports that network namespaces need Linux.
func NetnsSupport(context.Context) error {
	return fmt.Errorf("%w: network namespaces need Linux (this is %s)", ErrNetnsUnavailable, runtime.GOOS)
}

func lockFile(context.Context, string, time.Duration) (func(), error) {
	return nil, fmt.Errorf("%w: needs Linux", ErrNetnsUnavailable)
}

func killPid(int) {}

func inNetns(string, func() error) error {
	return fmt.Errorf("%w: needs Linux", ErrNetnsUnavailable)
}

// MarkedDialer returns a plain dialer: firewall marks need Linux.
func MarkedDialer(_ int, timeout time.Duration) *net.Dialer { return &net.Dialer{Timeout: timeout} }
