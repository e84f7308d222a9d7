package main

import (
	"context"
	"io"
	"strings"
	"testing"
)

func TestLocalRedis(t *testing.T) {
	for addr, want := range map[string]bool{
		"":                   true, // the private server
		"127.0.0.1:6379":     true,
		"127.0.0.5:6379":     true,
		"localhost:6379":     true,
		"[::1]:6379":         true,
		"10.0.0.7:6379":      false,
		"redis.internal:637": false,
		"no-port":            false,
	} {
		if got := localRedis(addr); got != want {
			t.Errorf("localRedis(%q) = %v, want %v", addr, got, want)
		}
	}
}

func TestBadFlagsAreRefused(t *testing.T) {
	for _, tt := range []struct{ args, want string }{
		{"-procs -1", "-procs: -1 is negative"},
		{"-suite nope", `-suite: "nope"`},
	} {
		err := run(context.Background(), strings.Fields(tt.args), io.Discard, io.Discard)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("allotbench %s: %v, want an error containing %q", tt.args, err, tt.want)
		}
	}
}
