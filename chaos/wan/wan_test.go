package wan

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/internal/loopback"
	"github.com/allot-dev/allot/pkg/faultproxy"
	"github.com/allot-dev/allot/pkg/topology"
)

func freeAddr(t *testing.T) string {
	t.Helper()
	addr, err := topology.FreePort("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	return addr
}

// TestServe runs a WAN process's Serve against a control socket of the
// test's: it says hello once its links listen, carries bytes both ways
// through a link with its delay, counts the chunks of the gRPC link apart,
// and on stop acknowledges, returns and leaves the final stats.
func TestServe(t *testing.T) {
	dir := t.TempDir()
	ctlPath := filepath.Join(dir, "ctl.sock")
	ctl, err := net.Listen("unix", ctlPath)
	if err != nil {
		t.Fatal(err)
	}
	defer ctl.Close()
	echo := loopback.Echo(t)
	api, grpc := freeAddr(t), freeAddr(t)
	cfg := Config{Region: "eu", WAN: faultproxy.Config{DelayMin: 20 * time.Millisecond, DelayMax: 20 * time.Millisecond},
		StatsPath: filepath.Join(dir, "stats.json"),
		Links:     []Link{{Listen: api, Target: echo, Seed: 1}, {Listen: grpc, Target: echo, Seed: 2, GRPC: true}}}
	b, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	cfgPath := filepath.Join(dir, "wan.json")
	if err := os.WriteFile(cfgPath, b, 0o644); err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- Serve(context.Background(), cfgPath, ctlPath) }()

	conn, err := ctl.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	dec := json.NewDecoder(bufio.NewReader(conn))
	var hello history.Message
	if err := dec.Decode(&hello); err != nil || hello.Hello != "eu"+HelloSuffix {
		t.Fatalf("hello = %+v, %v; want %q", hello, err, "eu"+HelloSuffix)
	}

	c, err := net.Dial("tcp", grpc) // open at hello: no retry
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if err := c.SetReadDeadline(time.Now().Add(5 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("echo through the link: %q, %v", buf, err)
	}
	if rtt := time.Since(start); rtt < 40*time.Millisecond {
		t.Errorf("round trip through the link took %s, want at least 2 x 20 ms of added delay", rtt)
	}
	c.Close()

	if err := json.NewEncoder(conn).Encode(history.Message{Command: &history.Command{Seq: 1, Op: history.OpStop}}); err != nil {
		t.Fatal(err)
	}
	var ack history.Message
	if err := dec.Decode(&ack); err != nil || ack.Ack == nil || ack.Ack.Seq != 1 || ack.Ack.Err != "" {
		t.Fatalf("stop: %+v, %v; want an ack of seq 1 without error", ack, err)
	}
	select {
	case err := <-served:
		if err != nil {
			t.Fatalf("Serve: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return after stop")
	}
	st, err := ReadStats(cfg.StatsPath)
	if err != nil {
		t.Fatal(err)
	}
	if st.GRPCChunks < 2 || st.Chunks != st.GRPCChunks {
		t.Fatalf("stats %+v: want the ping and its echo (>= 2 chunks), all on the gRPC link", st)
	}
	if _, err := net.DialTimeout("tcp", grpc, time.Second); err == nil {
		t.Errorf("the link still listens after stop")
	}
}

// TestServeRefusesABadConfig: a config without a stats path, or with a
// WAN the proxies cannot apply, fails before the process says hello.
func TestServeRefusesABadConfig(t *testing.T) {
	dir := t.TempDir()
	for want, cfg := range map[string]Config{
		"stats_path": {Region: "eu"},
		"DelayMin":   {Region: "eu", StatsPath: filepath.Join(dir, "s.json"), WAN: faultproxy.Config{DelayMin: time.Second, DelayMax: time.Millisecond}},
	} {
		b, _ := json.Marshal(cfg)
		p := filepath.Join(dir, "wan.json")
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		// The control socket does not exist either: the config's error
		// must come first.
		if err := Serve(context.Background(), p, filepath.Join(dir, "no.sock")); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Serve = %v, want an error naming %s", err, want)
		}
	}
}
