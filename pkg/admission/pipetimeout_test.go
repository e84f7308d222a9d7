package admission_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/faultproxy"
)

// TestPipelineTimeoutNeedsContextTimeouts: go-redis applies a pipeline's
// deadline (RedisConfig.PipelineTimeout) to the connection only when the
// client has ContextTimeoutEnabled. With it, a Redis that answers late
// fails the pipeline at PipelineTimeout and the fail mode decides; without
// it, the pipeline waits for the late answer, and the store warns of that
// when it is made.
func TestPipelineTimeoutNeedsContextTimeouts(t *testing.T) {
	redistest.Require(t, shared.err)
	ctx := context.Background()
	doc := parse(t, `
name: pipeline-timeout
rules:
  - {name: tenant, scope: tenant, match: [{key: tenant}], kind: fixed_window, limit: 10, window: 1h, fail_mode: closed}
`)
	for _, tt := range []struct {
		name       string
		ctxTimeout bool
		want       admission.Outcome
		warned     bool
	}{
		{"ContextTimeoutEnabled", true, admission.Unavailable, false},
		{"default options", false, admission.Allow, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			var dialer net.Dialer
			proxy := faultproxy.New(ln, func(ctx context.Context) (net.Conn, error) {
				return dialer.DialContext(ctx, "tcp", shared.redis.Addr())
			}, faultproxy.Config{}, 1)
			pctx, stop := context.WithCancel(ctx)
			done := make(chan struct{})
			go func() { _ = proxy.Run(pctx); close(done) }()
			t.Cleanup(func() { stop(); <-done })
			client := redis.NewClient(&redis.Options{Addr: proxy.Addr().String(), ContextTimeoutEnabled: tt.ctxTimeout, MaxRetries: -1})
			t.Cleanup(func() { client.Close() })
			core, logs := observer.New(zap.WarnLevel)
			rcfg := admission.DefaultRedisConfig()
			rcfg.PipelineTimeout = 200 * time.Millisecond
			st, err := admission.NewRedisStore(client, rcfg, admission.WithRedisLogger(zap.New(core)))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { st.Close() })
			warned := logs.FilterMessageSnippet("ContextTimeoutEnabled").Len() > 0
			if warned != tt.warned {
				t.Errorf("warned %v, want %v: %v", warned, tt.warned, logs.All())
			}
			if err := st.Load(ctx); err != nil {
				t.Fatal(err)
			}
			cfg := admission.DefaultConfig()
			cfg.Namespace = namespace()
			cfg.NegativeCacheTTL = 0
			cfg.StoreTimeout = 5 * time.Second // the caller waits: the pipeline's bound decides
			e, err := admission.New(cfg, st, doc, 1)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { e.Close() })
			req := &admission.Request{Descriptors: entries("tenant", "slow")}
			if d, err := e.Decide(ctx, req); err != nil || !d.Allowed() {
				t.Fatalf("before the delay: %+v, %v", d, err)
			}
			// Redis's answers now come 1.5 s late, well past PipelineTimeout.
			if err := proxy.Set(faultproxy.Config{DelayMin: 1500 * time.Millisecond, DelayMax: 1500 * time.Millisecond}); err != nil {
				t.Fatal(err)
			}
			d, err := e.Decide(ctx, req)
			if err != nil {
				t.Fatal(err)
			}
			if d.Outcome != tt.want {
				t.Errorf("a decision with Redis answering 1.5 s late: %v (source %s); want %v", d.Outcome, d.Source, tt.want)
			}
		})
	}
}
