// Command allotctl is the operator CLI of allot: policy, bound, windows and
// cluster membership. See `allotctl -h`.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"

	"github.com/allot-dev/allot/pkg/ctl"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	err := ctl.Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp): // -h printed the usage
	case errors.Is(err, ctl.ErrUsage):
		fmt.Fprintln(os.Stderr, "allotctl:", err)
		if !ctl.UsageShown(err) {
			fmt.Fprintln(os.Stderr, "Run 'allotctl -h' for the usage.")
		}
		os.Exit(2)
	default:
		fmt.Fprintln(os.Stderr, "allotctl:", err)
		os.Exit(1)
	}
}
