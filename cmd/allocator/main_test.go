package main

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/allot-dev/allot/pkg/allocator"
)

// TestMain runs main itself when the test binary is re-executed by
// TestHelpExitsZero.
func TestMain(m *testing.M) {
	if os.Getenv("ALLOCATOR_RUN_MAIN") == "1" {
		os.Args = append([]string{"allocator"}, strings.Fields(os.Getenv("ALLOCATOR_ARGS"))...)
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestHelpExitsZero checks that -h prints the usage and exits 0, and that a
// bad flag still exits 1.
func TestHelpExitsZero(t *testing.T) {
	for _, tt := range []struct {
		args string
		code int
	}{{"-h", 0}, {"-help", 0}, {"-no-such-flag", 1}} {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "ALLOCATOR_RUN_MAIN=1", "ALLOCATOR_ARGS="+tt.args)
		out, err := cmd.CombinedOutput()
		code := 0
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		if code != tt.code {
			t.Errorf("allocator %s: exit %d, want %d; output:\n%s", tt.args, code, tt.code, out)
		}
		if !strings.Contains(string(out), "-bootstrap") { // a bad flag prints the usage too
			t.Errorf("allocator %s printed no usage:\n%s", tt.args, out)
		}
		if tt.code == 0 && strings.Contains(string(out), "help requested") {
			t.Errorf("allocator %s reported help as an error:\n%s", tt.args, out)
		}
	}
}

// TestFlagCombinations checks that contradictory or incomplete cluster flags
// are refused before anything starts, naming the flags.
func TestFlagCombinations(t *testing.T) {
	const (
		a1 = "a1=127.0.0.1:7001=127.0.0.1:8001"
		a2 = "a2=127.0.0.1:7002=127.0.0.1:8002"
	)
	base := []string{"-id", "a1", "-raft-addr", "127.0.0.1:7001", "-api-addr", "127.0.0.1:8001"}
	tests := []struct {
		name string
		args []string
		want []string
	}{
		{"peer without bootstrap", []string{"-peer", a1, "-peer", a2}, []string{"-peer", "-bootstrap"}},
		{"bootstrap without peer", []string{"-bootstrap"}, []string{"-bootstrap", "-peer"}},
		{"bootstrap with join", []string{"-bootstrap", "-peer", a1, "-peer", a2, "-join", "127.0.0.1:8002"}, []string{"-bootstrap", "-join"}},
		{"bootstrap peers without this node", []string{"-bootstrap", "-peer", a2}, []string{"a1"}},
		{"a stray argument hiding later flags", []string{"-bootstrap", "a1", "-peer", a1}, []string{`"a1"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			args := append(append(append([]string(nil), base...), "-data-dir", t.TempDir()), tt.args...)
			err := run(ctx, args)
			if err == nil {
				t.Fatal("run accepted the flags")
			}
			if !errors.Is(err, allocator.ErrConfig) {
				t.Errorf("run() = %v, want an ErrConfig", err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("%q does not name %s", err.Error(), w)
				}
			}
		})
	}
}

// TestFlagCombinationsAccepted checks the documented ways to start a node:
// the README's three-node bootstrap, a single-node cluster asked for by
// listing this node alone, a join, and a restart from the data dir.
func TestFlagCombinationsAccepted(t *testing.T) {
	const (
		a1 = "a1=127.0.0.1:7001=127.0.0.1:8001"
		a2 = "a2=127.0.0.1:7002=127.0.0.1:8002"
		a3 = "a3=127.0.0.1:7003=127.0.0.1:8003"
	)
	for name, args := range map[string][]string{
		"three-node bootstrap":  {"-bootstrap", "-peer", a1, "-peer", a2, "-peer", a3},
		"single-node bootstrap": {"-bootstrap", "-peer", a1},
		"join":                  {"-join", "127.0.0.1:8002"},
		"restart":               {},
	} {
		t.Run(name, func(t *testing.T) {
			args := append([]string{"-id", "a1", "-raft-addr", "127.0.0.1:7001", "-api-addr", "127.0.0.1:8001", "-data-dir", t.TempDir()}, args...)
			cfg, ro, _, err := parseFlags(args)
			if err != nil {
				t.Fatalf("parseFlags: %v", err)
			}
			if err := checkFlags(cfg, ro); err != nil {
				t.Fatalf("checkFlags: %v", err)
			}
		})
	}
}

// TestBadSettingsNameTheirFlags checks that a refused setting is named by
// its flag, not by the Config field it sets, and that every problem is
// reported at once.
func TestBadSettingsNameTheirFlags(t *testing.T) {
	const a1 = "a1=127.0.0.1:7001=127.0.0.1:8001"
	tests := []struct {
		name    string
		args    []string
		want    []string
		notWant []string
	}{
		{"no id, no data dir", []string{"-id", "", "-data-dir", ""},
			[]string{"-id must not be empty", "-data-dir must not be empty"}, []string{"NodeID", "DataDir", "data dir is empty"}},
		{"watch limits", []string{"-max-watch-streams", "0", "-watch-send-timeout", "-1s"},
			[]string{"-max-watch-streams must be positive, got 0", "-watch-send-timeout must be positive, got -1s"}, []string{"MaxWatchStreams", "WatchSendTimeout"}},
		{"lease longer than heartbeat", []string{"-leader-lease-timeout", "2s"},
			[]string{"-leader-lease-timeout 2s exceeds -heartbeat-timeout 500ms"}, []string{"LeaderLeaseTimeout", "HeartbeatTimeout"}},
		{"bound assumptions", []string{"-max-store-delay", "-1s", "-max-drift-ppm", "-3"},
			[]string{"-max-store-delay must not be negative", "-max-drift-ppm must not be negative"}, []string{"MaxOneWayDelay", "MaxDriftPPM"}},
		{"gateways per region", []string{"-gateways-per-region", "0"},
			[]string{"-gateways-per-region must be at least 1, got 0"}, []string{"GatewaysPerRegion"}},
		{"bootstrap peers twice", []string{"-bootstrap", "-peer", a1, "-peer", a1},
			[]string{`-peer: "a1" listed twice`}, []string{"Peers"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			args := append([]string{"-id", "a1", "-raft-addr", "127.0.0.1:7001", "-api-addr", "127.0.0.1:8001", "-data-dir", t.TempDir()}, tt.args...)
			cfg, ro, _, err := parseFlags(args)
			if err != nil {
				t.Fatalf("parseFlags: %v", err)
			}
			err = checkFlags(cfg, ro)
			if !errors.Is(err, allocator.ErrConfig) {
				t.Fatalf("checkFlags() = %v, want an ErrConfig", err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("%q does not say %q", err.Error(), w)
				}
			}
			for _, w := range tt.notWant {
				if strings.Contains(err.Error(), w) {
					t.Errorf("%q names %s", err.Error(), w)
				}
			}
		})
	}
}

// TestWatchFlags checks that the WatchPolicy limits are settable.
func TestWatchFlags(t *testing.T) {
	cfg, _, _, err := parseFlags([]string{"-max-watch-streams", "7", "-watch-send-timeout", "3s"})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.MaxWatchStreams != 7 || cfg.WatchSendTimeout != 3*time.Second {
		t.Errorf("MaxWatchStreams %d, WatchSendTimeout %s; want 7, 3s", cfg.MaxWatchStreams, cfg.WatchSendTimeout)
	}
	def := allocator.DefaultConfig()
	if cfg, _, _, _ = parseFlags(nil); cfg.MaxWatchStreams != def.MaxWatchStreams || cfg.WatchSendTimeout != def.WatchSendTimeout {
		t.Errorf("defaults %d, %s; want %d, %s", cfg.MaxWatchStreams, cfg.WatchSendTimeout, def.MaxWatchStreams, def.WatchSendTimeout)
	}
}

// TestGatewaysPerRegionFlag checks that the gateway count the bound states
// is settable and defaults to one.
func TestGatewaysPerRegionFlag(t *testing.T) {
	cfg, _, _, err := parseFlags(nil)
	if err != nil || cfg.GatewaysPerRegion != 1 {
		t.Fatalf("default: %d, %v; want 1", cfg.GatewaysPerRegion, err)
	}
	if cfg, _, _, err = parseFlags([]string{"-gateways-per-region", "12"}); err != nil || cfg.GatewaysPerRegion != 12 {
		t.Fatalf("-gateways-per-region 12: %d, %v", cfg.GatewaysPerRegion, err)
	}
	if cfg.BoundConfig().Gateways != 12 {
		t.Fatalf("the bound states %d gateways per region, want 12", cfg.BoundConfig().Gateways)
	}
}
