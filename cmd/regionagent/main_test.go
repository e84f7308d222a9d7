package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// standalonePolicy is a policy without global quotas, for an agent without
// allocators.
const standalonePolicy = `
name: standalone
rules:
  - name: bucket
    scope: tenant
    match: [{key: tenant}]
    kind: token_bucket
    capacity: 10
    refill_per_second: 1
`

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// TestShutdownBoundsTheServersDrain: calls their clients hold open (a
// Connect request whose body never comes, a gRPC call that never sends its
// message) do not hold the agent's exit past -shutdown-timeout. The HTTP
// drain used to wait 5 s whatever the flag said, and gRPC's GracefulStop
// as long as a call stayed open.
func TestShutdownBoundsTheServersDrain(t *testing.T) {
	pf := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(pf, []byte(standalonePolicy), 0o600); err != nil {
		t.Fatal(err)
	}
	api, envoy := freeAddr(t), freeAddr(t)
	const timeout = 300 * time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() {
		errc <- run(ctx, []string{"-region", "eu", "-store", "embedded", "-policy", pf, "-api-addr", api, "-envoy-addr", envoy,
			"-shutdown-timeout", timeout.String(), "-log-level", "error"})
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := http.Get("http://" + api + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent not ready: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}

	c, err := net.Dial("tcp", api)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := fmt.Fprint(c, "POST /allot.v1.AdmissionService/Check HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"); err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(envoy, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	sctx, scancel := context.WithCancel(context.Background())
	defer scancel()
	if _, err := cc.NewStream(sctx, &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}, "/allot.v1.AdmissionService/Check"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond) // both calls reach their handlers

	t0 := time.Now()
	cancel()
	select {
	case <-errc: // a drain cut short is reported; what matters is when
	case <-time.After(5 * time.Second):
		t.Fatal("run still draining 5 s after the stop")
	}
	if took := time.Since(t0); took > timeout+700*time.Millisecond {
		t.Fatalf("run returned %s after the stop, want within -shutdown-timeout (%s) and a little", took, timeout)
	}
}
