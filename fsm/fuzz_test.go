package fsm

import (
	"bytes"
	"testing"

	"github.com/hashicorp/raft"
)

// fuzzSeeds are valid and broken entries for FuzzApply's corpus; they also
// run on every plain `go test`.
func fuzzSeeds(tb testing.TB) [][]byte {
	enc := func(c Command) []byte {
		b, err := Encode(c)
		if err != nil {
			tb.Fatal(err)
		}
		return b
	}
	v := []byte{FormatV1}
	return [][]byte{
		enc(Command{Type: CmdAcquire, NowUnixMs: t0 + 1, Acquire: &Acquire{Region: "eu", RequestID: "r1", Wants: []Want{{Quota: "atlas", Tokens: 50, DemandPerSecond: 2}}}}),
		enc(Command{Type: CmdAcquire, NowUnixMs: t0 + 2, Acquire: &Acquire{Region: "us", RequestID: "r2", Wants: []Want{{Quota: "atlas"}, {Quota: "birch", Tokens: 3}}}}),
		enc(Command{Type: CmdAcquire, NowUnixMs: t0 + 2, Acquire: &Acquire{Region: "eu", RequestID: "r3", Wants: []Want{{Quota: "std/x"}, {Quota: "std/y%2Fz", Tokens: 3}}}}),
		enc(Command{Type: CmdAcquire, NowUnixMs: t0 + 2, Acquire: &Acquire{Region: "eu", RequestID: "r4", Wants: []Want{{Quota: "std"}, {Quota: "std/a/b"}, {Quota: "atlas/x"}}}}),
		enc(Command{Type: CmdAcquire, NowUnixMs: t0 + 200_000, Acquire: &Acquire{Region: "eu", RequestID: "r5", Wants: []Want{{Quota: "std/#0123456789abcdef0123456789abcdef"}}}}),
		enc(Command{Type: CmdPublishPolicy, NowUnixMs: t0 + 4, Publish: &Publish{ExpectedVersion: 2, Author: "a", Quotas: []QuotaSpec{{Name: "std", Limit: 10, WindowMs: 1000, ChunkTokens: 1, TTLMs: 500, Clamp: true, TemplateKeys: 2}}}}),
		enc(Command{Type: CmdRelease, NowUnixMs: t0 + 3, Release: &Release{Region: "eu", GrantID: "1-0", Tokens: 10}}),
		enc(Command{Type: CmdRelease, NowUnixMs: t0 + 3, Release: &Release{Region: "eu", GrantID: "1-0", Tokens: 10, RequestID: "x"}}),
		enc(Command{Type: CmdPublishPolicy, NowUnixMs: t0 + 4, Publish: &Publish{ExpectedVersion: 2, Author: "a", Quotas: []QuotaSpec{{Name: "atlas", Limit: 10, WindowMs: 1000, ChunkTokens: 1, TTLMs: 500, Clamp: true, Strategy: StrategyFairShare}}}}),
		enc(Command{Type: CmdPublishPolicy, NowUnixMs: t0 + 4, Publish: &Publish{ExpectedVersion: 2, Author: "a", Quotas: []QuotaSpec{{Name: "atlas", Limit: 10, WindowMs: 1000, ChunkTokens: 4, TTLMs: 500, MaxHeldPerRegion: 6}}}}),
		enc(Command{Type: CmdPublishPolicy, NowUnixMs: t0 + 4, Publish: &Publish{ExpectedVersion: 2, Author: "a"}}),
		enc(Command{Type: CmdSetMember, NowUnixMs: t0 + 5, Member: &SetMember{ID: "a1", APIAddress: "127.0.0.1:7000"}}),
		enc(Command{Type: CmdSetMember, NowUnixMs: t0 + 5, Member: &SetMember{ID: "a1", Remove: true}}),
		enc(Command{Type: CmdSetCluster, NowUnixMs: t0 + 5, Cluster: &SetCluster{ID: "c1"}}),
		enc(Command{Type: CmdBatch, NowUnixMs: t0 + 3, Batch: []Command{
			{Type: CmdAcquire, Acquire: &Acquire{Region: "us", RequestID: "b1", Wants: []Want{{Quota: "atlas", Tokens: 5}, {Quota: "std/x"}}}},
			{Type: CmdRelease, Release: &Release{Region: "eu", GrantID: "1-0", Tokens: 1, RequestID: "b2"}},
			{Type: CmdAcquire, Acquire: &Acquire{Region: "eu", RequestID: "b3", Wants: []Want{{Quota: "nope"}}}},
			{Type: CmdAcquire, Acquire: &Acquire{Region: "us", RequestID: "b1", Wants: []Want{{Quota: "atlas", Tokens: 5}}}},
		}}),
		append(v, `{"type":5,"batch":[]}`...),
		append(v, `{"type":5,"now_unix_ms":1,"batch":[{"type":2,"release":{"region":"eu","grant_id":"1-0","tokens":1}},{"type":3,"publish":{}}]}`...),
		enc(Command{Type: CmdAcquire, NowUnixMs: MaxNowUnixMs, Acquire: &Acquire{Region: "eu", RequestID: "late", Wants: []Want{{Quota: "atlas", Tokens: 1000, DemandPerSecond: 1e300}}}}),
		append(v, `{"type":1,"now_unix_ms":-9223372036854775808,"acquire":{"region":"eu","request_id":"r","wants":[{"quota":"atlas"}]}}`...),
		append(v, `{"type":1,"now_unix_ms":1,"acquire":{"region":"eu","request_id":"r","wants":[{"quota":"atlas","tokens":9223372036854775807}]}}`...),
		append(v, `{"type":2,"release":{"region":"eu","grant_id":"1-0","tokens":-1}}`...),
		append(v, `{"type":3,"publish":{"expected_version":18446744073709551615,"author":"a"}}`...),
		append(v, `{"type":1,"acquire":{"wants":[{"quota":"atlas","demand_per_second":1e400}]}}`...),
		append(v, `{"type":1,"acquire":null}`...),
		append(v, `{"TYPE":1,"Acquire":{"Region":"eu","Request_ID":"r","Wants":[{"Quota":"atlas"}]}}`...),
		v,
		{},
		{0xff, '{', '}'},
		[]byte("not even close"),
	}
}

// fuzzFSM returns an FSM holding a policy and a few grants.
func fuzzFSM(tb testing.TB) *FSM {
	h := newHarness(tb)
	birch := QuotaSpec{Name: "birch", Limit: 30, WindowMs: 5_000, ChunkTokens: 3, TTLMs: 10_000, Strategy: StrategyFairShare}
	std := QuotaSpec{Name: "std", Limit: 50, WindowMs: 10_000, ChunkTokens: 5, TTLMs: 5_000, Clamp: true, TemplateKeys: 1}
	h.publish(t0, atlas(StrategyDemand), birch, std)
	h.acquire(t0, "eu", "seed", Want{Quota: "atlas"}, Want{Quota: "birch", DemandPerSecond: 1}, Want{Quota: "std/x", DemandPerSecond: 2})
	return h.f
}

// FuzzApply feeds arbitrary bytes to Apply: it must never panic, must
// answer with a result or an error, and an error must leave the state
// untouched.
func FuzzApply(f *testing.F) {
	for _, s := range fuzzSeeds(f) {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		m := fuzzFSM(t)
		before := snapshotBytes(t, m)
		res := m.Apply(&raft.Log{Index: 100, Type: raft.LogCommand, Data: data})
		switch r := res.(type) {
		case error:
			if after := snapshotBytes(t, m); !bytes.Equal(before, after) {
				t.Fatalf("rejected entry changed the state: %v", r)
			}
		case *AcquireResult, *ReleaseResult, *PublishResult, *SetMemberResult, *SetClusterResult:
		case *BatchResult:
			for i, sub := range r.Results {
				switch sub.(type) {
				case *AcquireResult, *ReleaseResult, error:
				default:
					t.Fatalf("batch result %d is %T", i, sub)
				}
			}
		default:
			t.Fatalf("Apply returned %T", res)
		}
		// Whatever happened, the state still snapshots and restores.
		snap := snapshotBytes(t, m)
		if err := restore(New(), snap); err != nil {
			t.Fatalf("snapshot after %q does not restore: %v", data, err)
		}
	})
}

// FuzzRestore feeds arbitrary bytes to Restore: it must never panic and
// must leave the state untouched when it fails.
func FuzzRestore(f *testing.F) {
	f.Add(snapshotBytes(f, fuzzFSM(f)))
	// The same records as an older build wrote them: no trailer to match,
	// so mutations reach the records' checks.
	f.Add(downgradeSnapshot(f, snapshotBytes(f, fuzzFSM(f))))
	f.Add([]byte(`{"format":1,"now_unix_ms":0,"tokens_granted":0,"policies":0,"quotas":0,"idempotency":0}`))
	f.Add([]byte(`{"format":1,"policies":1}` + "\nnull\n"))
	f.Add([]byte(`{"format":1,"now_unix_ms":5,"policies":1,"quotas":1}` + "\n" +
		`{"version":1,"author":"a","published_unix_ms":1,"quotas":[{"name":"q","limit":5,"window_ms":10,"chunk_tokens":1,"ttl_ms":5,"strategy":"demand"}]}` + "\n" +
		`{"name":"q","windows":[{"index":0,"limit":5,"grants":[{"id":"1-0","region":"eu","tokens":5,"released":1,"granted_unix_ms":1,"expires_unix_ms":3}]}]}` + "\n"))
	f.Add([]byte(`{}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		m := fuzzFSM(t)
		before := snapshotBytes(t, m)
		if err := restore(m, data); err != nil {
			if after := snapshotBytes(t, m); !bytes.Equal(before, after) {
				t.Fatalf("failed restore changed the state: %v", err)
			}
			return
		}
		// A snapshot that restores round-trips.
		again := snapshotBytes(t, m)
		m2 := New()
		if err := restore(m2, again); err != nil || !bytes.Equal(snapshotBytes(t, m2), again) {
			t.Fatalf("restored state does not round-trip: %v", err)
		}
	})
}
