package main

import (
	"errors"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestMain runs main instead of the tests when the test binary is started
// as allotctl by run.
func TestMain(m *testing.M) {
	if os.Getenv("ALLOTCTL_TEST_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// run runs allotctl with args and returns its exit code and stderr.
func run(t *testing.T, args ...string) (int, string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), "ALLOTCTL_TEST_MAIN=1")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatal(err)
	}
	return cmd.ProcessState.ExitCode(), stderr.String()
}

// TestExitCodes: -h prints the usage and exits 0, a usage error exits 2 and
// a failed call 1.
func TestExitCodes(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	_ = ln.Close() // nothing listens there now: calls fail

	for _, tt := range []struct {
		args     []string
		code     int
		want     string
		dontWant string
	}{
		{[]string{"-h"}, 0, "usage: allotctl", "help requested"},
		{[]string{"-addr", dead, "cluster", "-h"}, 0, "usage: allotctl", "help requested"},
		{[]string{"-addr", dead, "cluster", "extra"}, 2, `unexpected argument "extra"`, ""},
		{[]string{"-addr", dead, "-timeout", "0", "cluster"}, 2, "-timeout must be positive", ""},
		{[]string{"-bogus"}, 2, "-bogus", ""},
		{[]string{"-addr", dead, "-timeout", "300ms", "cluster"}, 1, "allotctl:", ""},
		{[]string{"-addr", dead, "frobnicate"}, 2, "usage: allotctl", "Run 'allotctl -h'"},
	} {
		code, stderr := run(t, tt.args...)
		if code != tt.code || !strings.Contains(stderr, tt.want) || tt.dontWant != "" && strings.Contains(stderr, tt.dontWant) {
			t.Errorf("allotctl %s: exit %d, want %d; stderr %q, want it to contain %q and not %q",
				strings.Join(tt.args, " "), code, tt.code, stderr, tt.want, tt.dontWant)
		}
	}
}

// TestUsageErrorsPrintedOnce: a flag error is printed once, with a pointer
// to -h instead of the whole usage; a flag after the command says where
// global flags go.
func TestUsageErrorsPrintedOnce(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	_ = ln.Close()
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"-bogus", "cluster"}, "flag provided but not defined: -bogus"},
		{[]string{"-addr", dead, "policy", "publish", "policy.yaml", "-author", "a", "-reason", "r", "-timeout", "3s"},
			`unexpected argument "-timeout": global flags go before the command (allotctl -timeout ... policy publish ...)`},
	} {
		code, stderr := run(t, tt.args...)
		// Two lines: the error, once, and the pointer to -h.
		lines := strings.Split(strings.TrimSuffix(stderr, "\n"), "\n")
		if code != 2 || len(lines) != 2 || !strings.HasPrefix(lines[0], "allotctl: ") || !strings.Contains(lines[0], tt.want) ||
			lines[1] != "Run 'allotctl -h' for the usage." {
			t.Errorf("allotctl %s: exit %d, stderr %q; want exit 2, the error (%q) and a pointer to -h, without the usage",
				strings.Join(tt.args, " "), code, stderr, tt.want)
		}
	}
}
