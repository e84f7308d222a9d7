package admission_test

import (
	"context"
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/allot-dev/allot/internal/redistest"
)

// One standalone server and one 3-master cluster serve the whole package;
// tests isolate themselves with a key namespace of their own. Tests that
// stop a server start their own.
var (
	shared struct {
		redis   *redistest.Server
		cluster *redistest.Cluster
		err     error
	}
)

func TestMain(m *testing.M) {
	ctx := context.Background()
	shared.redis, shared.err = redistest.StartServer(ctx)
	if shared.err == nil {
		shared.cluster, shared.err = redistest.StartCluster(ctx)
	}
	code := m.Run()
	if shared.redis != nil {
		shared.redis.Close()
	}
	if shared.cluster != nil {
		shared.cluster.Close()
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}
