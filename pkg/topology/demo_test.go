package topology_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/allot-dev/allot/pkg/topology"
)

// demoBins builds the demo's binaries once for the package's tests.
var demoBins struct {
	once sync.Once
	dir  string
	err  error
}

func TestMain(m *testing.M) {
	code := m.Run()
	if demoBins.dir != "" {
		os.RemoveAll(demoBins.dir)
	}
	os.Exit(code)
}

// binDir builds allocator, regionagent and allotctl from the module at root
// once for the package's tests and returns their directory.
func binDir(t *testing.T, root string) string {
	t.Helper()
	demoBins.once.Do(func() {
		if demoBins.dir, demoBins.err = os.MkdirTemp("", "allot-demo-bin-"); demoBins.err != nil {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		_, demoBins.err = topology.Build(ctx, root, demoBins.dir, "./cmd/allocator", "./cmd/regionagent", "./cmd/allotctl")
	})
	if demoBins.err != nil {
		t.Fatal(demoBins.err)
	}
	return demoBins.dir
}

// demoConfig returns a short demo: 3 s windows and a light load that still
// floods Atlas (450/s offered against G = 1,000 per 3 s window).
func demoConfig(t *testing.T) topology.DemoConfig {
	t.Helper()
	if testing.Short() {
		t.Skip("builds and starts processes")
	}
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	cfg := topology.DefaultDemoConfig()
	if cfg.Root, err = topology.ModuleRoot(wd); err != nil {
		t.Fatal(err)
	}
	cfg.BinDir = binDir(t, cfg.Root)
	cfg.Window = 3 * time.Second
	cfg.Atlas = map[string]float64{"eu": 400, "us": 50}
	cfg.Birch = map[string]float64{"eu": 40, "us": 40}
	return cfg
}

// runDemo runs the demo as RunDemo does (StartDemo, Run, Close) and checks
// that afterwards every child process has exited and the temporary
// directory is gone. It returns the output.
func runDemo(t *testing.T, cfg topology.DemoConfig) (string, *topology.Demo) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out bytes.Buffer
	d, err := topology.StartDemo(ctx, cfg, &out)
	if err != nil {
		t.Fatalf("StartDemo: %v\n%s", err, out.String())
	}
	procs, dir := d.Processes(), d.Dir
	runErr := d.Run(ctx)
	closeErr := d.Close()
	t.Logf("output:\n%s", out.String())
	if runErr != nil {
		t.Errorf("Run: %v", runErr)
	}
	if closeErr != nil {
		t.Errorf("Close: %v", closeErr)
	}
	if len(procs) == 0 {
		t.Fatal("no processes")
	}
	for _, p := range procs {
		if !p.Exited() {
			t.Errorf("%s (pid %d) still running after Close", p.Name, p.Pid())
		} else if err := syscall.Kill(p.Pid(), 0); !errors.Is(err, syscall.ESRCH) {
			t.Errorf("%s (pid %d): kill -0 after exit: %v, want ESRCH", p.Name, p.Pid(), err)
		}
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("data dir %s after Close: %v, want it removed", dir, err)
	}
	return out.String(), d
}

var (
	verdictRe = regexp.MustCompile(`(?m)^admitted (\d+) (?:<=|>) G \+ bound = (\d+): (\S+)`)
	rowRe     = regexp.MustCompile(`(?m)^\s*(eu|us|total)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s*$`)
	birchRe   = regexp.MustCompile(`(?m)^birch: demand (\d+), admitted (\d+), denied (\d+), unavail (\d+): `)
	// birchLostRe is the note of Birch's calls that failed (no answer) or
	// were never sent (the load generator's cap on calls in flight).
	birchLostRe = regexp.MustCompile(`(?m)^note: birch \S+: (\d+) calls failed \(last: .*\), (\d+) not sent `)
)

func atoi(t *testing.T, s string) int64 {
	t.Helper()
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// checkTables checks windows tables in out: Atlas within G + the bound in
// each, admitted and denied (a flood), both regions reported, Birch never
// denied, and answered unavailable (503), failed or not sent for at most 1%
// of its requests.
func checkTables(t *testing.T, out string, windows int) {
	t.Helper()
	verdicts := verdictRe.FindAllStringSubmatch(out, -1)
	if len(verdicts) != windows {
		t.Fatalf("%d verdict lines, want %d", len(verdicts), windows)
	}
	for _, v := range verdicts {
		if admitted, limit := atoi(t, v[1]), atoi(t, v[2]); admitted > limit || v[3] != "ok" {
			t.Errorf("window verdict %q: admitted %d, G + bound %d", v[0], admitted, limit)
		}
	}
	rows := map[string]int{}
	var admitted, denied int64
	for _, m := range rowRe.FindAllStringSubmatch(out, -1) {
		rows[m[1]]++
		if m[1] == "total" {
			admitted += atoi(t, m[5])
			denied += atoi(t, m[6])
		}
	}
	for _, r := range []string{"eu", "us", "total"} {
		if rows[r] != windows {
			t.Errorf("%d rows for %s, want %d", rows[r], r, windows)
		}
	}
	if admitted == 0 || denied == 0 {
		t.Errorf("Atlas admitted %d and denied %d over the run; want both > 0 (a flood)", admitted, denied)
	}
	birch := birchRe.FindAllStringSubmatch(out, -1)
	if len(birch) != windows {
		t.Fatalf("%d birch lines, want %d", len(birch), windows)
	}
	var requests, unavail int64
	for _, b := range birch {
		if atoi(t, b[2]) == 0 || atoi(t, b[3]) != 0 {
			t.Errorf("birch %q: want admitted > 0, never denied", b[0])
		}
		requests += atoi(t, b[1])
		unavail += atoi(t, b[4])
	}
	// A 503 fails Birch's request as surely as a 429 (the chaos suite
	// counts both as a birch_denied violation outside faults), and the demo
	// has no fault: an agent that answers 503 whenever a pool runs short
	// instead of renewing within its starve wait must fail here. A correct
	// agent answers none; the tolerance, 1% of Birch's requests, is for a
	// renewal slower than the starve wait when this test shares a 2-core
	// CI machine with other packages' tests, and stays far below what such
	// an agent answers (14-20% of Birch's requests).
	if requests == 0 {
		t.Fatal("birch offered no requests")
	}
	// A call that failed or was never sent is a Birch request the limiter
	// did not serve either (a hung agent shows as calls failed by timeout,
	// or not sent once the in-flight cap fills): it counts with the 503s.
	var lost int64
	for _, m := range birchLostRe.FindAllStringSubmatch(out, -1) {
		lost += atoi(t, m[1]) + atoi(t, m[2])
	}
	if (unavail+lost)*100 > requests {
		t.Errorf("birch: of %d requests, %d answered unavailable (503) and %d failed or not sent: more than 1%%", requests, unavail, lost)
	} else if unavail+lost > 0 {
		t.Logf("birch: of %d requests, %d answered unavailable (503) and %d failed or not sent, within the 1%% a loaded machine is allowed", requests, unavail, lost)
	}
}

// TestDemo runs the real topology, 3 allocators and two regions with a
// redis-server each behind a 10 ms WAN, for two 3 s windows.
func TestDemo(t *testing.T) {
	cfg := demoConfig(t)
	if _, err := exec.LookPath("redis-server"); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("redis-server not installed")
		}
		t.Skip("redis-server not installed")
	}
	cfg.Store = topology.StoreRedis
	cfg.Windows = 2
	cfg.WANLatency = 10 * time.Millisecond
	out, d := runDemo(t, cfg)
	if d.Embedded() || !strings.Contains(out, "redis 127.0.0.1:") {
		t.Error("regions did not run on redis-server")
	}
	checkTables(t, out, cfg.Windows)
}

// TestDemoEmbeddedStore forces the agents' embedded store although
// redis-server may be installed: no Redis process is started and the
// output says so.
func TestDemoEmbeddedStore(t *testing.T) {
	cfg := demoConfig(t)
	cfg.Store = topology.StoreEmbedded
	cfg.Allocators = 1
	cfg.Windows = 1
	out, d := runDemo(t, cfg)
	if !d.Embedded() || !strings.Contains(out, "embedded in-process store") {
		t.Error("the output does not say the regions use the embedded store")
	}
	for _, p := range d.Processes() {
		if strings.HasSuffix(p.Name, "-redis") {
			t.Errorf("process %s started in embedded mode", p.Name)
		}
	}
	checkTables(t, out, cfg.Windows)
}
