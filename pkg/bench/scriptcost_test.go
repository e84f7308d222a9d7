package bench

import (
	"context"
	"testing"
	"time"

	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/policy"
)

// BenchmarkScriptRules runs the decide script for the 1-rule and the 3-rule
// policy, pipelined, against a private redis-server, and reports the
// script's Redis CPU per call (INFO commandstats), which does not depend on
// how busy the client side is.
func BenchmarkScriptRules(b *testing.B) {
	ctx := context.Background()
	srv, err := redistest.StartServer(ctx)
	redistest.Require(b, err)
	defer srv.Close()
	client := srv.Client()
	store, err := admission.NewRedisStore(client, admission.DefaultRedisConfig())
	if err != nil {
		b.Fatal(err)
	}
	defer store.Close()
	if err := store.Load(ctx); err != nil {
		b.Fatal(err)
	}
	for _, tc := range []struct {
		name, ns, src string
	}{{"rules=1", "sc1", onePolicy}, {"rules=3", "sc3", ThreeRulePolicy}} {
		b.Run(tc.name, func(b *testing.B) {
			doc, err := policy.Parse([]byte(tc.src))
			if err != nil {
				b.Fatal(err)
			}
			ecfg := admission.DefaultConfig()
			ecfg.Namespace = tc.ns
			ecfg.StoreTimeout = time.Second
			ecfg.ExtraDescriptors = []string{"route"}
			e, err := admission.New(ecfg, store, doc, 1)
			if err != nil {
				b.Fatal(err)
			}
			defer e.Close()
			reqs := requests(10000)
			calls := make([]admission.ScriptCall, len(reqs))
			for i, r := range reqs {
				c, err := e.ScriptCalls(r)
				if err != nil || len(c) != 1 {
					b.Fatalf("key %d: %v", i, err)
				}
				calls[i] = c[0]
			}
			if err := client.ConfigResetStat(ctx).Err(); err != nil {
				b.Fatal(err)
			}
			sha := admission.ScriptSHA()
			b.ResetTimer()
			for i := 0; i < b.N; i += 64 {
				p := client.Pipeline()
				for j := i; j < i+64 && j < b.N; j++ {
					k := calls[keyOf(0, uint64(j), len(calls))]
					p.EvalSha(ctx, sha, k.Keys, k.Args...)
				}
				if _, err := p.Exec(ctx); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			n, usec, err := scriptStats(ctx, client)
			if err != nil || n == 0 {
				b.Fatalf("commandstats: %v (%v calls)", err, n)
			}
			b.ReportMetric(usec/n, "redis-us/call")
		})
	}
}
