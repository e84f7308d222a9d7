package fsm

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"sync"
	"testing"

	"github.com/hashicorp/raft"
)

func TestEncodeDecodeRoundTrip(t *testing.T) {
	spec := QuotaSpec{Name: "atlas", Limit: 1000, WindowMs: minute, ChunkTokens: 100, TTLMs: 15_000, Clamp: true,
		Strategy: StrategyFairShare, FallbackPerRegion: 7, MaxHeldPerRegion: 300, Regions: []string{"eu", "us"}, TemplateKeys: 2}
	acquire := &Acquire{Region: "eu", RequestID: "r1", Wants: []Want{
		{Quota: "atlas", Tokens: 5, DemandPerSecond: 1.5},
		{Quota: "tq/a", Tokens: 3, DemandPerSecond: 0.25, Next: true},
	}}
	release := &Release{Region: "eu", GrantID: "1-0", Tokens: 2, RequestID: "x"}
	tests := []struct {
		name string
		give Command
	}{
		{name: "acquire", give: Command{Type: CmdAcquire, NowUnixMs: 42, Acquire: acquire}},
		{name: "release", give: Command{Type: CmdRelease, NowUnixMs: 43, Release: release}},
		{name: "publish", give: Command{Type: CmdPublishPolicy, NowUnixMs: 44, Publish: &Publish{
			ExpectedVersion: 1, Author: "a", Reason: "why", Document: []byte{0, 1, 2}, Quotas: []QuotaSpec{spec, atlas(StrategyDemand)},
		}}},
		{name: "set member", give: Command{Type: CmdSetMember, NowUnixMs: 45, Member: &SetMember{ID: "a1", APIAddress: "10.0.0.1:7000", Remove: true}}},
		{name: "set cluster", give: Command{Type: CmdSetCluster, NowUnixMs: 45, Cluster: &SetCluster{ID: "c0ffee"}}},
		{name: "batch", give: Command{Type: CmdBatch, NowUnixMs: 46, Batch: []Command{
			{Type: CmdAcquire, NowUnixMs: 47, Acquire: acquire},
			{Type: CmdRelease, NowUnixMs: 48, Release: release},
		}}},
	}
	// Every field of the command types is set in some case, so that a
	// field Encode drops (or Decode ignores) makes a case fail.
	set := map[string]bool{}
	for _, tt := range tests {
		markSetFields(reflect.ValueOf(tt.give), set)
	}
	for _, f := range commandFields(reflect.TypeFor[Command](), map[reflect.Type]bool{}) {
		if !set[f] {
			t.Errorf("no case sets %s: add one, so that the round trip covers it", f)
		}
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, err := Encode(tt.give)
			if err != nil {
				t.Fatalf("Encode: %v", err)
			}
			if b[0] != FormatV1 {
				t.Fatalf("first byte %d, want FormatV1", b[0])
			}
			got, err := Decode(b)
			if err != nil {
				t.Fatalf("Decode: %v", err)
			}
			if !reflect.DeepEqual(got, tt.give) {
				t.Fatalf("round trip changed the command:\ngot  %s\nwant %s\nencoded %s", dump(got), dump(tt.give), b)
			}
		})
	}
}

// dump prints c with its payloads, which %+v shows as pointers.
func dump(c Command) string {
	var b strings.Builder
	fmt.Fprintf(&b, "{Type:%d NowUnixMs:%d", c.Type, c.NowUnixMs)
	for _, p := range []struct {
		name string
		v    any
		set  bool
	}{{"Acquire", c.Acquire, c.Acquire != nil}, {"Release", c.Release, c.Release != nil}, {"Publish", c.Publish, c.Publish != nil}, {"Member", c.Member, c.Member != nil}} {
		if p.set {
			fmt.Fprintf(&b, " %s:%+v", p.name, reflect.ValueOf(p.v).Elem().Interface())
		}
	}
	for i, sub := range c.Batch {
		fmt.Fprintf(&b, " Batch[%d]:%s", i, dump(sub))
	}
	b.WriteString("}")
	return b.String()
}

// commandFields lists the fields ("Type.Field") of the struct types
// reachable from t.
func commandFields(t reflect.Type, seen map[reflect.Type]bool) []string {
	for t.Kind() == reflect.Pointer || t.Kind() == reflect.Slice {
		t = t.Elem()
	}
	if t.Kind() != reflect.Struct || seen[t] {
		return nil
	}
	seen[t] = true
	var out []string
	for f := range t.Fields() {
		out = append(out, t.Name()+"."+f.Name)
		out = append(out, commandFields(f.Type, seen)...)
	}
	return out
}

// markSetFields records in set the fields ("Type.Field") that are not zero
// somewhere in v.
func markSetFields(v reflect.Value, set map[string]bool) {
	switch v.Kind() {
	case reflect.Pointer:
		if !v.IsNil() {
			markSetFields(v.Elem(), set)
		}
	case reflect.Slice:
		for i := range v.Len() {
			markSetFields(v.Index(i), set)
		}
	case reflect.Struct:
		for i := range v.NumField() {
			if f := v.Field(i); !f.IsZero() {
				set[v.Type().Name()+"."+v.Type().Field(i).Name] = true
				markSetFields(f, set)
			}
		}
	}
}

func TestEncodeRejectsNaN(t *testing.T) {
	_, err := Encode(Command{Type: CmdAcquire, Acquire: &Acquire{Wants: []Want{{DemandPerSecond: math.NaN()}}}})
	if err == nil {
		t.Fatal("Encode accepted a NaN demand")
	}
}

func TestDecodeRejects(t *testing.T) {
	v := string([]byte{FormatV1})
	tests := []struct {
		name string
		give string
	}{
		{name: "empty", give: ""},
		{name: "unknown format", give: "\x02{}"},
		{name: "not json", give: v + "hello"},
		{name: "null", give: v + "null"},
		{name: "unknown type", give: v + `{"type":9,"acquire":{}}`},
		{name: "type overflows", give: v + `{"type":257}`},
		{name: "missing payload", give: v + `{"type":1}`},
		{name: "wrong payload", give: v + `{"type":1,"release":{}}`},
		{name: "two payloads", give: v + `{"type":1,"acquire":{},"release":{}}`},
		{name: "unknown field", give: v + `{"type":1,"acquire":{},"extra":1}`},
		{name: "trailing data", give: v + `{"type":1,"acquire":{}} {}`},
		{name: "truncated", give: v + `{"type":1,"acquire":{`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := Decode([]byte(tt.give)); !errors.Is(err, ErrMalformedCommand) {
				t.Fatalf("Decode(%q) = %v, want ErrMalformedCommand", tt.give, err)
			}
		})
	}
}

func TestApplyIgnoresNonCommandEntries(t *testing.T) {
	f := New()
	if got := f.Apply(&raft.Log{Index: 1, Type: raft.LogNoop}); got != nil {
		t.Fatalf("Apply(noop) = %v, want nil", got)
	}
	if got := f.Apply(nil); got != nil {
		t.Fatalf("Apply(nil) = %v, want nil", got)
	}
}

func TestAcquireValidation(t *testing.T) {
	long := strings.Repeat("x", 200)
	tests := []struct {
		name      string
		now       int64
		region    string
		id        string
		wants     []Want
		wantErr   error
		wantField string
	}{
		{name: "empty region", region: "", id: "r", wants: []Want{{Quota: "atlas"}}, wantErr: ErrInvalidArgument, wantField: "region"},
		{name: "long region", region: long, id: "r", wants: []Want{{Quota: "atlas"}}, wantErr: ErrInvalidArgument, wantField: "region"},
		{name: "empty request id", region: "eu", id: "", wants: []Want{{Quota: "atlas"}}, wantErr: ErrInvalidArgument, wantField: "request_id"},
		{name: "long request id", region: "eu", id: long, wants: []Want{{Quota: "atlas"}}, wantErr: ErrInvalidArgument, wantField: "request_id"},
		{name: "no wants", region: "eu", id: "r", wants: nil, wantErr: ErrInvalidArgument, wantField: "wants"},
		{name: "too many wants", region: "eu", id: "r", wants: make([]Want, MaxWants+1), wantErr: ErrInvalidArgument, wantField: "wants"},
		{name: "unknown quota", region: "eu", id: "r", wants: []Want{{Quota: "atlas"}, {Quota: "nope"}}, wantErr: ErrUnknownQuota, wantField: "wants[1].quota"},
		{name: "empty quota", region: "eu", id: "r", wants: []Want{{Quota: ""}}, wantErr: ErrInvalidArgument, wantField: "wants[0].quota"},
		{name: "duplicate quota", region: "eu", id: "r", wants: []Want{{Quota: "atlas"}, {Quota: "birch"}, {Quota: "atlas"}}, wantErr: ErrInvalidArgument, wantField: "wants[2].quota"},
		{name: "negative tokens", region: "eu", id: "r", wants: []Want{{Quota: "atlas", Tokens: -1}}, wantErr: ErrInvalidArgument, wantField: "wants[0].tokens"},
		{name: "tokens above limit", region: "eu", id: "r", wants: []Want{{Quota: "atlas", Tokens: 1001}}, wantErr: ErrInvalidArgument, wantField: "wants[0].tokens"},
		{name: "negative demand", region: "eu", id: "r", wants: []Want{{Quota: "birch"}, {Quota: "atlas", DemandPerSecond: -1}}, wantErr: ErrInvalidArgument, wantField: "wants[1].demand_per_second"},
		{name: "undeclared region", region: "apac", id: "r", wants: []Want{{Quota: "birch"}}, wantErr: ErrInvalidArgument, wantField: "region \"apac\""},
		{name: "negative now", now: -1, region: "eu", id: "r", wants: []Want{{Quota: "atlas"}}, wantErr: ErrInvalidArgument, wantField: "now_unix_ms"},
		{name: "now beyond year 9999", now: MaxNowUnixMs + 1, region: "eu", id: "r", wants: []Want{{Quota: "atlas"}}, wantErr: ErrInvalidArgument, wantField: "now_unix_ms"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t)
			birch := QuotaSpec{Name: "birch", Limit: 50, WindowMs: minute, ChunkTokens: 10, TTLMs: 1000, Regions: []string{"us", "eu"}}
			h.publish(t0, atlas(StrategyDemand), birch)
			h.acquire(t0+1, "us", "before", Want{Quota: "atlas", Tokens: 10})
			before := snapshotBytes(t, h.f)
			now := tt.now
			if now == 0 {
				now = t0 + 5_000
			}
			for i := range tt.wants {
				if tt.wants[i].Quota == "" && tt.name == "too many wants" {
					tt.wants[i].Quota = "atlas"
				}
			}
			err := wantErr(t, h.acquireRes(now, tt.region, tt.id, tt.wants...), tt.wantErr)
			if !strings.Contains(err.Error(), tt.wantField) {
				t.Fatalf("error %q does not name %q", err, tt.wantField)
			}
			if after := snapshotBytes(t, h.f); !bytes.Equal(before, after) {
				t.Fatalf("state changed by a rejected acquire")
			}
			if h.f.Now() != t0+1 {
				t.Fatalf("time advanced by a rejected acquire: %d", h.f.Now())
			}
		})
	}
}

func TestPublishValidation(t *testing.T) {
	ok := atlas(StrategyDemand)
	with := func(mod func(*QuotaSpec)) QuotaSpec {
		s := ok
		mod(&s)
		return s
	}
	tests := []struct {
		name      string
		give      Publish
		wantErr   error
		wantField string
	}{
		{name: "version skips", give: Publish{ExpectedVersion: 3, Author: "a"}, wantErr: ErrStaleVersion, wantField: "expected_version"},
		{name: "version replays", give: Publish{ExpectedVersion: 1, Author: "a"}, wantErr: ErrStaleVersion, wantField: "expected_version"},
		{name: "no author", give: Publish{ExpectedVersion: 2}, wantErr: ErrInvalidArgument, wantField: "author"},
		{name: "huge reason", give: Publish{ExpectedVersion: 2, Author: "a", Reason: strings.Repeat("r", MaxReasonBytes+1)}, wantErr: ErrInvalidArgument, wantField: "reason"},
		{name: "empty name", give: Publish{ExpectedVersion: 2, Author: "a", Quotas: []QuotaSpec{ok, with(func(s *QuotaSpec) { s.Name = "" })}}, wantErr: ErrInvalidArgument, wantField: "quotas[1].name"},
		{name: "duplicate name", give: Publish{ExpectedVersion: 2, Author: "a", Quotas: []QuotaSpec{ok, ok}}, wantErr: ErrInvalidArgument, wantField: "quotas[1].name"},
		{name: "zero limit", give: Publish{ExpectedVersion: 2, Author: "a", Quotas: []QuotaSpec{with(func(s *QuotaSpec) { s.Limit = 0 })}}, wantErr: ErrInvalidArgument, wantField: "quotas[0].limit"},
		{name: "zero window", give: Publish{ExpectedVersion: 2, Author: "a", Quotas: []QuotaSpec{with(func(s *QuotaSpec) { s.WindowMs = 0 })}}, wantErr: ErrInvalidArgument, wantField: "quotas[0].window_ms"},
		{name: "zero ttl", give: Publish{ExpectedVersion: 2, Author: "a", Quotas: []QuotaSpec{with(func(s *QuotaSpec) { s.TTLMs = 0 })}}, wantErr: ErrInvalidArgument, wantField: "quotas[0].ttl_ms"},
		{name: "zero chunk", give: Publish{ExpectedVersion: 2, Author: "a", Quotas: []QuotaSpec{with(func(s *QuotaSpec) { s.ChunkTokens = 0 })}}, wantErr: ErrInvalidArgument, wantField: "quotas[0].chunk_tokens"},
		{name: "chunk above limit", give: Publish{ExpectedVersion: 2, Author: "a", Quotas: []QuotaSpec{with(func(s *QuotaSpec) { s.ChunkTokens = 1001 })}}, wantErr: ErrInvalidArgument, wantField: "quotas[0].chunk_tokens"},
		{name: "clamp with ttl beyond window", give: Publish{ExpectedVersion: 2, Author: "a", Quotas: []QuotaSpec{with(func(s *QuotaSpec) { s.TTLMs = minute + 1 })}}, wantErr: ErrInvalidArgument, wantField: "quotas[0].ttl_ms"},
		{name: "unknown strategy", give: Publish{ExpectedVersion: 2, Author: "a", Quotas: []QuotaSpec{with(func(s *QuotaSpec) { s.Strategy = "lottery" })}}, wantErr: ErrInvalidArgument, wantField: "quotas[0].strategy"},
		{name: "negative fallback", give: Publish{ExpectedVersion: 2, Author: "a", Quotas: []QuotaSpec{with(func(s *QuotaSpec) { s.FallbackPerRegion = -1 })}}, wantErr: ErrInvalidArgument, wantField: "quotas[0].fallback_per_region"},
		{name: "negative max held", give: Publish{ExpectedVersion: 2, Author: "a", Quotas: []QuotaSpec{with(func(s *QuotaSpec) { s.MaxHeldPerRegion = -1 })}}, wantErr: ErrInvalidArgument, wantField: "quotas[0].max_held_per_region"},
		{name: "max held above limit", give: Publish{ExpectedVersion: 2, Author: "a", Quotas: []QuotaSpec{with(func(s *QuotaSpec) { s.MaxHeldPerRegion = 1001 })}}, wantErr: ErrInvalidArgument, wantField: "quotas[0].max_held_per_region"},
		{name: "max held with ttl beyond window", give: Publish{ExpectedVersion: 2, Author: "a", Quotas: []QuotaSpec{with(func(s *QuotaSpec) {
			s.Clamp, s.TTLMs, s.MaxHeldPerRegion = false, minute+1, 100
		})}}, wantErr: ErrInvalidArgument, wantField: "quotas[0].ttl_ms"},
		{name: "duplicate region", give: Publish{ExpectedVersion: 2, Author: "a", Quotas: []QuotaSpec{with(func(s *QuotaSpec) { s.Regions = []string{"eu", "us", "eu"} })}}, wantErr: ErrInvalidArgument, wantField: "quotas[0].regions"},
		{name: "empty region", give: Publish{ExpectedVersion: 2, Author: "a", Quotas: []QuotaSpec{with(func(s *QuotaSpec) { s.Regions = []string{"eu", ""} })}}, wantErr: ErrInvalidArgument, wantField: "quotas[0].regions[1]"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t)
			h.publish(t0, atlas(StrategyDemand))
			h.acquire(t0+1, "eu", "r", Want{Quota: "atlas"})
			before := snapshotBytes(t, h.f)
			p := tt.give
			err := wantErr(t, h.apply(Command{Type: CmdPublishPolicy, NowUnixMs: t0 + 2, Publish: &p}), tt.wantErr)
			if !strings.Contains(err.Error(), tt.wantField) {
				t.Fatalf("error %q does not name %q", err, tt.wantField)
			}
			if after := snapshotBytes(t, h.f); !bytes.Equal(before, after) {
				t.Fatalf("state changed by a rejected publish")
			}
		})
	}
}

func TestReleaseValidation(t *testing.T) {
	tests := []struct {
		name      string
		region    string
		grant     string
		tokens    int64
		wantErr   error
		wantField string
	}{
		{name: "empty region", region: "", grant: "2-0", tokens: 1, wantErr: ErrInvalidArgument, wantField: "region"},
		{name: "empty grant", region: "eu", grant: "", tokens: 1, wantErr: ErrInvalidArgument, wantField: "grant_id"},
		{name: "unknown grant", region: "eu", grant: "99-0", tokens: 1, wantErr: ErrUnknownGrant, wantField: "grant_id"},
		{name: "other region", region: "us", grant: "2-0", tokens: 1, wantErr: ErrInvalidArgument, wantField: "region"},
		{name: "zero tokens", region: "eu", grant: "2-0", tokens: 0, wantErr: ErrInvalidArgument, wantField: "tokens"},
		{name: "more than granted", region: "eu", grant: "2-0", tokens: 101, wantErr: ErrInvalidArgument, wantField: "tokens"},
		{name: "more than unreleased", region: "eu", grant: "2-0", tokens: 61, wantErr: ErrInvalidArgument, wantField: "tokens"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t)
			h.publish(t0, atlas(StrategyDemand))
			g := h.acquire(t0+1, "eu", "r", Want{Quota: "atlas"}).Grants[0]
			if g.GrantID != "2-0" {
				t.Fatalf("grant id %q, want 2-0 (log index 2, want 0)", g.GrantID)
			}
			h.release(t0+2, "eu", g.GrantID, 40)
			before := snapshotBytes(t, h.f)
			err := wantErr(t, h.releaseRes(t0+3, tt.region, tt.grant, tt.tokens), tt.wantErr)
			if !strings.Contains(err.Error(), tt.wantField) {
				t.Fatalf("error %q does not name %q", err, tt.wantField)
			}
			if after := snapshotBytes(t, h.f); !bytes.Equal(before, after) {
				t.Fatalf("state changed by a rejected release")
			}
		})
	}
}

// TestReferenceWorkedExample follows chapter 15: a 1,000/min pool, chunks
// of 100, 15 s leases clamped to the end of the window.
func TestReferenceWorkedExample(t *testing.T) {
	h := newHarness(t)
	h.publish(t0, atlas(StrategyDemand))
	tests := []struct {
		name        string
		at          int64
		wantTokens  int64
		wantExpires int64
		wantPool    int64
		wantExhaust bool
	}{
		{name: "early chunk keeps its full ttl", at: t0 + 10_000, wantTokens: 100, wantExpires: t0 + 25_000, wantPool: 900},
		{name: "mid window", at: t0 + 30_000, wantTokens: 100, wantExpires: t0 + 45_000, wantPool: 800},
		{name: "ttl reaching the end exactly", at: t0 + 45_000, wantTokens: 100, wantExpires: t0 + minute, wantPool: 700},
		{name: "near the end is clamped", at: t0 + 50_000, wantTokens: 100, wantExpires: t0 + minute, wantPool: 600},
		{name: "last millisecond is clamped", at: t0 + minute - 1, wantTokens: 100, wantExpires: t0 + minute, wantPool: 500},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := h.acquire(tt.at, "eu", fmt.Sprint("r", i), Want{Quota: "atlas"})
			g := r.Grants[0]
			if g.Tokens != tt.wantTokens || g.ExpiresUnixMs != tt.wantExpires || g.PoolRemaining != tt.wantPool || g.PoolExhausted != tt.wantExhaust {
				t.Fatalf("grant %+v, want tokens %d expires %d pool %d exhausted %v", g, tt.wantTokens, tt.wantExpires, tt.wantPool, tt.wantExhaust)
			}
			if g.TTLMs != g.ExpiresUnixMs-tt.at || g.WindowEndUnixMs != t0+minute || g.WindowIndex != t0/minute {
				t.Fatalf("grant %+v: ttl or window wrong", g)
			}
		})
	}
}

func TestPoolNeverOvergrants(t *testing.T) {
	h := newHarness(t)
	h.publish(t0, atlas(StrategyDemand))
	var total int64
	for i := range 9 {
		total += h.acquire(t0+int64(i), "eu", fmt.Sprint("r", i), Want{Quota: "atlas"}).Grants[0].Tokens
	}
	// 100 left; ask for 250.
	g := h.acquire(t0+10, "us", "big", Want{Quota: "atlas", Tokens: 250}).Grants[0]
	if g.Tokens != 100 || !g.PoolExhausted || g.PoolRemaining != 0 || g.Requested != 250 {
		t.Fatalf("partial grant %+v, want 100 of 250, exhausted", g)
	}
	total += g.Tokens
	g = h.acquire(t0+11, "us", "more", Want{Quota: "atlas"}).Grants[0]
	if g.Tokens != 0 || g.GrantID != "" || !g.PoolExhausted || g.ExpiresUnixMs != 0 || g.WindowEndUnixMs != t0+minute {
		t.Fatalf("empty pool grant %+v, want 0 tokens, no id, exhausted, window end set", g)
	}
	if total != 1000 {
		t.Fatalf("granted %d, want exactly the limit 1000", total)
	}
	w := h.f.CurrentWindow("atlas", t0+11)
	if w.Granted != 1000 || w.Remaining != 0 || len(w.Grants) != 10 {
		t.Fatalf("window %+v, want 1000 granted in 10 grants, 0 left", w)
	}
	// The next window opens with a full pool.
	g = h.acquire(t0+minute, "us", "next", Want{Quota: "atlas"}).Grants[0]
	if g.Tokens != 100 || g.WindowIndex != t0/minute+1 || g.PoolRemaining != 900 {
		t.Fatalf("next window grant %+v", g)
	}
}

// TestPartitionHolderGetsNothingNew is chapter 15's partition: US holds 200
// and is cut off (it simply stops calling); EU can take only the rest.
func TestPartitionHolderGetsNothingNew(t *testing.T) {
	h := newHarness(t)
	h.publish(t0, atlas(StrategyDemand))
	us := h.acquire(t0+1_000, "us", "u1", Want{Quota: "atlas", Tokens: 200})
	var eu int64
	for i := range 20 {
		eu += h.acquire(t0+2_000+int64(i)*1_000, "eu", fmt.Sprint("e", i), Want{Quota: "atlas"}).Grants[0].Tokens
	}
	w := h.f.CurrentWindow("atlas", t0+30_000)
	if eu != 800 || w.Granted != 1000 || w.Remaining != 0 {
		t.Fatalf("EU got %d, window granted %d remaining %d; want 800, 1000, 0", eu, w.Granted, w.Remaining)
	}
	if len(w.Regions) != 2 || w.Regions[1].Region != "us" || w.Regions[1].Granted != 200 || w.Regions[1].Grants != 1 {
		t.Fatalf("US row %+v, want its one grant of 200 and nothing new", w.Regions)
	}
	// Its lease expired unspent: counted as expired, not returned to the pool.
	w = h.f.CurrentWindow("atlas", us.Grants[0].ExpiresUnixMs)
	if w.Regions[1].Expired != 200 || w.Remaining != 0 {
		t.Fatalf("US expired %d, pool %d; want 200 expired, pool still 0", w.Regions[1].Expired, w.Remaining)
	}
}

func TestIdempotentRetry(t *testing.T) {
	h := newHarness(t)
	h.publish(t0, atlas(StrategyDemand))
	first := h.acquire(t0+1, "eu", "req-1", Want{Quota: "atlas", DemandPerSecond: 3})
	w1 := h.f.CurrentWindow("atlas", t0+1)

	retry := h.acquire(t0+5_000, "eu", "req-1", Want{Quota: "atlas", Tokens: 999})
	if !retry.Replayed || first.Replayed {
		t.Fatalf("Replayed first=%v retry=%v, want false, true", first.Replayed, retry.Replayed)
	}
	if fmt.Sprint(retry.Grants) != fmt.Sprint(first.Grants) || retry.NowUnixMs != first.NowUnixMs {
		t.Fatalf("retry %+v differs from first %+v", retry, first)
	}
	if w2 := h.f.CurrentWindow("atlas", t0+1); w2.Granted != w1.Granted || len(w2.Grants) != 1 {
		t.Fatalf("retry granted again: %d -> %d", w1.Granted, w2.Granted)
	}
	// Mutating a returned result does not change the record.
	retry.Grants[0].Tokens = 7
	if again := h.acquire(t0+5_001, "eu", "req-1", Want{Quota: "atlas"}); again.Grants[0].Tokens != 100 {
		t.Fatalf("recorded result changed through a returned copy: %+v", again.Grants[0])
	}
	// The same id from another region is another request.
	other := h.acquire(t0+6_000, "us", "req-1", Want{Quota: "atlas"})
	if other.Replayed || other.Grants[0].Tokens != 100 {
		t.Fatalf("other region's request replayed: %+v", other)
	}
	// A replay stays valid even if the quota has since been removed.
	keep := atlas(StrategyDemand)
	keep.Name = "birch"
	h.publish(t0+7_000, keep)
	if r := h.acquire(t0+8_000, "eu", "req-1", Want{Quota: "atlas"}); !r.Replayed {
		t.Fatalf("replay after quota removal = %+v", r)
	}
}

func TestIdempotencyRetention(t *testing.T) {
	h := newHarness(t)
	h.publish(t0, atlas(StrategyDemand))
	h.acquire(t0+1, "eu", "req-1", Want{Quota: "atlas"})
	// Two windows later (the longest window is a minute) the record is
	// still there at exactly 2W ...
	if r := h.acquire(t0+1+2*minute, "eu", "req-1", Want{Quota: "atlas"}); !r.Replayed {
		t.Fatal("record pruned before two windows passed")
	}
	// ... and gone after.
	if r := h.acquire(t0+2+2*minute, "eu", "req-1", Want{Quota: "atlas"}); r.Replayed || r.Grants[0].Tokens != 100 {
		t.Fatalf("record kept past two windows: %+v", r)
	}
	if got := h.f.Stats().IdempotencyRecords; got != 1 {
		t.Fatalf("%d idempotency records, want 1 (the new one)", got)
	}
}

func TestIdempotencyCap(t *testing.T) {
	if testing.Short() {
		t.Skip("applies MaxIdempotencyRecords entries")
	}
	h := newHarness(t)
	h.publish(t0, QuotaSpec{Name: "q", Limit: MaxLimit, WindowMs: minute, ChunkTokens: 1, TTLMs: 1000})
	for i := range MaxIdempotencyRecords + 10 {
		h.acquire(t0+1, "eu", fmt.Sprint(i), Want{Quota: "q"})
	}
	if got := h.f.Stats().IdempotencyRecords; got != MaxIdempotencyRecords {
		t.Fatalf("%d records, want the cap %d", got, MaxIdempotencyRecords)
	}
	if r := h.acquire(t0+1, "eu", "5", Want{Quota: "q"}); r.Replayed {
		t.Fatal("oldest records were not the ones evicted")
	}
	if r := h.acquire(t0+1, "eu", fmt.Sprint(MaxIdempotencyRecords+9), Want{Quota: "q"}); !r.Replayed {
		t.Fatal("newest record evicted")
	}
}

func TestRelease(t *testing.T) {
	h := newHarness(t)
	h.publish(t0, atlas(StrategyDemand))
	var ids []string
	for i := range 10 {
		ids = append(ids, h.acquire(t0+1, "eu", fmt.Sprint("r", i), Want{Quota: "atlas"}).Grants[0].GrantID)
	}
	if g := h.acquire(t0+2, "us", "u0", Want{Quota: "atlas"}).Grants[0]; g.Tokens != 0 {
		t.Fatalf("pool should be empty, got %d", g.Tokens)
	}
	r := h.release(t0+3, "eu", ids[0], 60)
	if r.Returned != 60 || r.PoolRemaining != 60 {
		t.Fatalf("release %+v, want 60 returned, pool 60", r)
	}
	// Released tokens are reusable.
	if g := h.acquire(t0+4, "us", "u1", Want{Quota: "atlas"}).Grants[0]; g.Tokens != 60 || !g.PoolExhausted {
		t.Fatalf("re-acquire %+v, want the 60 released tokens", g)
	}
	gv, ok := h.f.Grant(ids[0])
	if !ok || gv.Released != 60 || gv.Tokens != 100 || gv.Region != "eu" || gv.Quota != "atlas" {
		t.Fatalf("Grant(%s) = %+v, %v", ids[0], gv, ok)
	}
	// The rest of the grant can still be released, but no more.
	h.release(t0+5, "eu", ids[0], 40)
	wantErr(t, h.releaseRes(t0+6, "eu", ids[0], 1), ErrInvalidArgument)

	// In the next window a release of the previous window's grant is
	// accepted as a no-op: the pool it came from is closed.
	r = h.release(t0+minute+1, "eu", ids[1], 50)
	if r.Returned != 0 || r.PoolRemaining != 40 {
		t.Fatalf("late release %+v, want 0 returned (previous window pool 40 untouched)", r)
	}
	if gv, _ := h.f.Grant(ids[1]); gv.Released != 0 {
		t.Fatalf("late release recorded: %+v", gv)
	}
	// Two windows later the grant is gone.
	h.acquire(t0+2*minute, "us", "tick", Want{Quota: "atlas"})
	wantErr(t, h.releaseRes(t0+2*minute, "eu", ids[1], 1), ErrUnknownGrant)
	if _, ok := h.f.Grant(ids[1]); ok {
		t.Fatal("grant of a collected window still visible")
	}
}

func TestReleaseIdempotent(t *testing.T) {
	h := newHarness(t)
	h.publish(t0, atlas(StrategyDemand))
	id := h.acquire(t0+1, "eu", "r", Want{Quota: "atlas"}).Grants[0].GrantID
	rel := func() *ReleaseResult {
		res := h.apply(Command{Type: CmdRelease, NowUnixMs: t0 + 2, Release: &Release{Region: "eu", GrantID: id, Tokens: 30, RequestID: "rel-1"}})
		r, ok := res.(*ReleaseResult)
		if !ok {
			t.Fatalf("release: %v", res)
		}
		return r
	}
	first, second := rel(), rel()
	if first.Replayed || !second.Replayed || second.Returned != 30 {
		t.Fatalf("first %+v second %+v", first, second)
	}
	if gv, _ := h.f.Grant(id); gv.Released != 30 {
		t.Fatalf("retried release returned tokens twice: released %d", gv.Released)
	}
}

func TestTimeNeverGoesBackwards(t *testing.T) {
	h := newHarness(t)
	h.publish(t0, atlas(StrategyDemand))
	h.acquire(t0+minute+5, "eu", "a", Want{Quota: "atlas"})
	// A leader with a slow clock stamps an earlier time: the previous
	// window must not reopen.
	r := h.acquire(t0+10, "us", "b", Want{Quota: "atlas"})
	if r.NowUnixMs != t0+minute+5 || r.Grants[0].WindowIndex != t0/minute+1 {
		t.Fatalf("late stamp applied at %d in window %d", r.NowUnixMs, r.Grants[0].WindowIndex)
	}
	if h.f.Now() != t0+minute+5 {
		t.Fatalf("Now() = %d", h.f.Now())
	}
}

func TestPublishChanges(t *testing.T) {
	h := newHarness(t)
	birch := QuotaSpec{Name: "birch", Limit: 100, WindowMs: minute, ChunkTokens: 10, TTLMs: 5_000}
	h.publish(t0, atlas(StrategyDemand), birch)
	var ids []string
	for i := range 6 {
		ids = append(ids, h.acquire(t0+1, "eu", fmt.Sprint("a", i), Want{Quota: "atlas"}, Want{Quota: "birch"}).Grants[0].GrantID)
	}

	// Lower atlas's limit below what is outstanding (600): the pool is 0.
	lower := atlas(StrategyDemand)
	lower.Limit = 500
	res := h.publish(t0+2, lower, birch)
	if res.Policy.Version != 2 || res.Policy.PublishedUnixMs != t0+2 || res.Policy.Quotas[0].Limit != 500 || len(res.Removed) != 0 || len(res.WindowsReset) != 0 {
		t.Fatalf("publish result %+v", res)
	}
	w := h.f.CurrentWindow("atlas", t0+2)
	if w.Limit != 500 || w.Remaining != 0 || w.Outstanding != 600 {
		t.Fatalf("after lowering: %+v", w)
	}
	if g := h.acquire(t0+3, "us", "u", Want{Quota: "atlas"}).Grants[0]; g.Tokens != 0 {
		t.Fatalf("granted %d above the lowered limit", g.Tokens)
	}
	// Releasing 200 brings outstanding to 400: the pool is 500-400 = 100,
	// not the 200 released.
	h.release(t0+4, "eu", ids[0], 100)
	r := h.release(t0+4, "eu", ids[1], 100)
	if r.PoolRemaining != 100 {
		t.Fatalf("pool after releases %d, want 100", r.PoolRemaining)
	}
	// Raise it: pool = 2000 - 400.
	higher := atlas(StrategyDemand)
	higher.Limit = 2000
	h.publish(t0+5, higher, birch)
	if w := h.f.CurrentWindow("atlas", t0+5); w.Remaining != 1600 {
		t.Fatalf("after raising: remaining %d, want 1600", w.Remaining)
	}

	// Change birch's window length: its windows and grants go, but the 60
	// tokens of its six leases are carried into every window they reach:
	// the 2m window the change lands in, even once they expired (they may
	// have been spent in it), not the next one.
	birch2 := birch
	birch2.WindowMs = 2 * minute
	birchGrant, _ := h.f.Grant(fmt.Sprint(ids[0][:strings.Index(ids[0], "-")], "-1"))
	res = h.publish(t0+6, higher, birch2)
	if fmt.Sprint(res.WindowsReset) != "[birch]" {
		t.Fatalf("WindowsReset %v, want [birch]", res.WindowsReset)
	}
	if _, ok := h.f.Grant(birchGrant.ID); ok {
		t.Fatal("grant of a reset window still visible")
	}
	if w := h.f.CurrentWindow("birch", t0+6); w.Granted != 0 || w.Carried != 60 || w.Remaining != 40 || w.EndUnixMs-w.StartUnixMs != 2*minute {
		t.Fatalf("birch after reset: %+v", w)
	}
	if w := h.f.CurrentWindow("birch", birchGrant.ExpiresUnixMs); w.Carried != 60 || w.Remaining != 40 {
		t.Fatalf("birch once the carried leases expired, same window: %+v", w)
	}
	if w := h.f.CurrentWindow("birch", t0+2*minute); w.Carried != 0 || w.Remaining != 100 {
		t.Fatalf("birch in the next window: %+v", w)
	}

	// Drop atlas entirely.
	res = h.publish(t0+7, birch2)
	if fmt.Sprint(res.Removed) != "[atlas]" {
		t.Fatalf("Removed %v", res.Removed)
	}
	wantErr(t, h.acquireRes(t0+8, "eu", "z", Want{Quota: "atlas"}), ErrUnknownQuota)
	wantErr(t, h.releaseRes(t0+8, "eu", ids[2], 1), ErrUnknownGrant)
	if st := h.f.Stats(); st.Quotas != 1 || st.Windows != 0 || st.Grants != 0 || st.PolicyVersion != 5 {
		t.Fatalf("stats %+v", st)
	}
}

func TestPolicyHistory(t *testing.T) {
	h := newHarness(t)
	for i := range HistoryVersions + 6 {
		q := atlas(StrategyDemand)
		q.Limit = int64(1000 + i)
		h.publish(t0+int64(i), q)
	}
	hist := h.f.PolicyHistory()
	if len(hist) != HistoryVersions || hist[0].Version != 7 || hist[len(hist)-1].Version != HistoryVersions+6 {
		t.Fatalf("history has %d versions from %d", len(hist), hist[0].Version)
	}
	if hist[0].Document != nil || hist[0].Quotas != nil || hist[0].Author != "alice" || hist[0].PublishedUnixMs != t0+6 {
		t.Fatalf("history entry %+v, want metadata only", hist[0])
	}
	if _, ok := h.f.PolicyVersion(6); ok {
		t.Fatal("version 6 should have been dropped")
	}
	p, ok := h.f.PolicyVersion(7)
	if !ok || string(p.Document) != "doc" || p.Quotas[0].Limit != 1006 {
		t.Fatalf("PolicyVersion(7) = %+v", p)
	}
	// Copies: changing them does not change the FSM.
	p.Quotas[0].Limit = 1
	p.Document[0] = 'X'
	if p2, _ := h.f.PolicyVersion(7); p2.Quotas[0].Limit != 1006 || string(p2.Document) != "doc" {
		t.Fatal("PolicyVersion returned shared memory")
	}
	cur, _ := h.f.Policy()
	if cur.Version != HistoryVersions+6 {
		t.Fatalf("current version %d", cur.Version)
	}
}

func TestQuotasSortedAndNormalized(t *testing.T) {
	h := newHarness(t)
	a := atlas("")
	a.Regions = []string{"us", "eu"}
	b := atlas(StrategyFairShare)
	b.Name = "aardvark"
	h.publish(t0, a, b)
	qs := h.f.Quotas()
	if len(qs) != 2 || qs[0].Name != "aardvark" || qs[1].Name != "atlas" {
		t.Fatalf("Quotas() = %+v, want sorted by name", qs)
	}
	if qs[1].Strategy != StrategyDemand || fmt.Sprint(qs[1].Regions) != "[eu us]" {
		t.Fatalf("atlas spec %+v, want strategy demand and sorted regions", qs[1])
	}
	qs[1].Regions[0] = "mutated"
	if q, _ := h.f.Quota("atlas"); q.Regions[0] != "eu" {
		t.Fatal("Quotas returned shared memory")
	}
	if _, ok := h.f.Quota("nope"); ok {
		t.Fatal("Quota(nope) found")
	}
}

func TestWindowViews(t *testing.T) {
	h := newHarness(t)
	h.publish(t0, atlas(StrategyDemand))
	h.acquire(t0+1_000, "us", "u", Want{Quota: "atlas", Tokens: 50, DemandPerSecond: 2})
	h.acquire(t0+20_000, "eu", "e", Want{Quota: "atlas", DemandPerSecond: 15})

	w := h.f.CurrentWindow("atlas", t0+20_000)
	if w.Quota != "atlas" || w.Index != t0/minute || w.StartUnixMs != t0 || w.EndUnixMs != t0+minute {
		t.Fatalf("window identity %+v", w)
	}
	// The US lease (1 s + 15 s) has expired by 20 s; EU's has not.
	if w.Granted != 150 || w.Expired != 50 || w.Remaining != 850 || len(w.Grants) != 2 {
		t.Fatalf("window %+v", w)
	}
	if len(w.Regions) != 2 || w.Regions[0].Region != "eu" || w.Regions[1].Region != "us" {
		t.Fatalf("regions %+v, want eu then us", w.Regions)
	}
	if w.Regions[0].DemandPerSecond != 15 || w.Regions[0].Expired != 0 || w.Regions[1].Expired != 50 {
		t.Fatalf("rows %+v", w.Regions)
	}
	// US's demand report (at 1 s) is stale after 2 x TTL = 30 s.
	if w := h.f.CurrentWindow("atlas", t0+31_001); w.Regions[1].DemandPerSecond != 0 || w.Regions[0].DemandPerSecond != 15 {
		t.Fatalf("stale demand still shown: %+v", w.Regions)
	}
	// Window by index equals the current view at the FSM's time.
	byIndex, ok := h.f.Window("atlas", t0/minute)
	if !ok || fmt.Sprint(byIndex) != fmt.Sprint(h.f.CurrentWindow("atlas", 0)) {
		t.Fatalf("Window() = %+v, %v", byIndex, ok)
	}
	// A window not opened yet has its full pool.
	if next := h.f.CurrentWindow("atlas", t0+minute); next.Remaining != 1000 || next.Granted != 0 || next.Index != t0/minute+1 {
		t.Fatalf("next window %+v", next)
	}
	if _, ok := h.f.Window("atlas", t0/minute+1); ok {
		t.Fatal("Window() returned an unopened window")
	}
	if z := h.f.CurrentWindow("nope", t0); z.Quota != "" || z.Limit != 0 {
		t.Fatalf("unknown quota view %+v", z)
	}
	// Views are copies.
	w.Grants[0].Tokens = 1
	if again := h.f.CurrentWindow("atlas", t0+20_000); again.Grants[0].Tokens != 50 {
		t.Fatal("view shares memory")
	}
}

func TestOldWindowsCollected(t *testing.T) {
	h := newHarness(t)
	var specs []QuotaSpec
	for i := range 20 {
		q := atlas(StrategyDemand)
		q.Name = fmt.Sprintf("q%02d", i)
		specs = append(specs, q)
	}
	h.publish(t0, specs...)
	for i := range 20 {
		h.acquire(t0+1, "eu", fmt.Sprint("r", i), Want{Quota: fmt.Sprintf("q%02d", i)})
	}
	if st := h.f.Stats(); st.Windows != 20 || st.Grants != 20 {
		t.Fatalf("stats %+v", st)
	}
	// One window later the windows are the "previous" one: still visible.
	h.acquire(t0+minute, "eu", "x", Want{Quota: "q00"})
	if _, ok := h.f.Window("q05", t0/minute); !ok {
		t.Fatal("previous window not visible")
	}
	// Two windows later they are invisible at once, though memory is
	// reclaimed lazily: touched quotas now, the rest by the sweep.
	h.acquire(t0+2*minute, "eu", "y", Want{Quota: "q00"})
	if _, ok := h.f.Window("q05", t0/minute); ok {
		t.Fatal("window two windows old still visible")
	}
	for i := range 20 / gcPerApply {
		h.acquire(t0+2*minute, "eu", fmt.Sprint("z", i), Want{Quota: "q00"})
	}
	// Left: q00's previous window (grant x) and current one (y and the
	// five z grants).
	if st := h.f.Stats(); st.Windows != 2 || st.Grants != 7 {
		t.Fatalf("after sweeping: %+v, want only q00's two windows", st)
	}
}

func TestDeclaredRegions(t *testing.T) {
	h := newHarness(t)
	q := atlas(StrategyDemand)
	q.Regions = []string{"eu", "us"}
	h.publish(t0, q)
	h.acquire(t0+1, "us", "r", Want{Quota: "atlas"})
	wantErr(t, h.acquireRes(t0+1, "apac", "r", Want{Quota: "atlas"}), ErrInvalidArgument)
}

func TestGrantIDCollisionRejected(t *testing.T) {
	f := New()
	b, _ := Encode(Command{Type: CmdPublishPolicy, NowUnixMs: t0, Publish: &Publish{ExpectedVersion: 1, Author: "a", Quotas: []QuotaSpec{atlas(StrategyDemand)}}})
	f.Apply(&raft.Log{Index: 1, Type: raft.LogCommand, Data: b})
	a1, _ := Encode(Command{Type: CmdAcquire, NowUnixMs: t0, Acquire: &Acquire{Region: "eu", RequestID: "1", Wants: []Want{{Quota: "atlas"}}}})
	a2, _ := Encode(Command{Type: CmdAcquire, NowUnixMs: t0, Acquire: &Acquire{Region: "eu", RequestID: "2", Wants: []Want{{Quota: "atlas"}}}})
	if _, ok := f.Apply(&raft.Log{Index: 2, Type: raft.LogCommand, Data: a1}).(*AcquireResult); !ok {
		t.Fatal("first acquire failed")
	}
	wantErr(t, f.Apply(&raft.Log{Index: 2, Type: raft.LogCommand, Data: a2}), ErrInvalidArgument)
}

func TestWaterfill(t *testing.T) {
	tests := []struct {
		name     string
		capacity int64
		wants    []int64
		want     []int64
	}{
		{name: "all fit", capacity: 100, wants: []int64{10, 20, 30}, want: []int64{10, 20, 30}},
		{name: "small served first", capacity: 100, wants: []int64{10, 500}, want: []int64{10, 90}},
		{name: "equal split", capacity: 100, wants: []int64{500, 500}, want: []int64{50, 50}},
		{name: "remainder to first regions", capacity: 100, wants: []int64{500, 500, 500}, want: []int64{34, 33, 33}},
		{name: "three levels", capacity: 90, wants: []int64{10, 35, 100}, want: []int64{10, 35, 45}},
		{name: "zero want", capacity: 10, wants: []int64{0, 100}, want: []int64{0, 10}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			claims := make([]claim, len(tt.wants))
			for i, w := range tt.wants {
				claims[i] = claim{region: fmt.Sprint("r", i), want: w}
			}
			waterfill(tt.capacity, claims)
			var got []int64
			for _, c := range claims {
				got = append(got, c.share)
			}
			if fmt.Sprint(got) != fmt.Sprint(tt.want) {
				t.Fatalf("shares %v, want %v", got, tt.want)
			}
		})
	}
}

func TestConcurrentReadsDuringApply(t *testing.T) {
	h := newHarness(t)
	h.publish(t0, atlas(StrategyFairShare))
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				w := h.f.CurrentWindow("atlas", 0)
				if w.Remaining != max(0, w.Limit-w.Granted+w.Released) {
					t.Errorf("torn read: %+v", w)
					return
				}
				h.f.Stats()
				h.f.Policy()
				// Not snapshotBytes: t.Fatalf must not be called from
				// this goroutine.
				if _, err := persistSnapshot(h.f); err != nil {
					t.Errorf("snapshot during applies: %v", err)
					return
				}
			}
		})
	}
	for i := range 2000 {
		now := t0 + int64(i)*100
		r := h.acquire(now, fmt.Sprint("r", i%3), fmt.Sprint(i), Want{Quota: "atlas", Tokens: 7, DemandPerSecond: 1})
		if id := r.Grants[0].GrantID; id != "" && i%2 == 0 {
			h.release(now, fmt.Sprint("r", i%3), id, 3)
		}
	}
	close(stop)
	wg.Wait()
}

func TestSetCluster(t *testing.T) {
	h := newHarness(t)
	set := func(id string) any {
		return h.apply(Command{Type: CmdSetCluster, NowUnixMs: t0, Cluster: &SetCluster{ID: id}})
	}
	if h.f.ClusterID() != "" {
		t.Fatalf("a new FSM has cluster id %q", h.f.ClusterID())
	}
	for _, bad := range []string{"", "a b", "ü", "id/1", strings.Repeat("c", MaxClusterIDBytes+1)} {
		wantErr(t, set(bad), ErrInvalidArgument)
	}
	if h.f.ClusterID() != "" {
		t.Fatalf("a refused id was recorded: %q", h.f.ClusterID())
	}
	if r, ok := set("first-id_1").(*SetClusterResult); !ok || r.ID != "first-id_1" || !r.Set {
		t.Fatalf("first SetCluster = %+v, want it set", r)
	}
	// A later leader's proposal (both proposed before either committed)
	// changes nothing: the first one committed stays.
	if r, ok := set("second").(*SetClusterResult); !ok || r.ID != "first-id_1" || r.Set {
		t.Fatalf("second SetCluster = %+v, want the first id kept", r)
	}
	if h.f.ClusterID() != "first-id_1" {
		t.Fatalf("ClusterID() = %q", h.f.ClusterID())
	}
	f := New()
	if err := restore(f, snapshotBytes(t, h.f)); err != nil || f.ClusterID() != "first-id_1" {
		t.Fatalf("restored cluster id %q (%v), want first-id_1", f.ClusterID(), err)
	}
	// A batch carries only acquires and releases.
	b, _ := json.Marshal(Command{Type: CmdBatch, NowUnixMs: t0, Batch: []Command{{Type: CmdSetCluster, Cluster: &SetCluster{ID: "x"}}}})
	if _, err := Decode(append([]byte{FormatV1}, b...)); !errors.Is(err, ErrMalformedCommand) {
		t.Fatalf("Decode of a batch with a set_cluster = %v, want ErrMalformedCommand", err)
	}
}

func TestSetMember(t *testing.T) {
	h := newHarness(t)
	set := func(m SetMember) any { return h.apply(Command{Type: CmdSetMember, NowUnixMs: t0, Member: &m}) }
	if r, ok := set(SetMember{ID: "a1", APIAddress: "10.0.0.1:7000"}).(*SetMemberResult); !ok || r.APIAddress != "10.0.0.1:7000" {
		t.Fatalf("set a1: %+v", r)
	}
	set(SetMember{ID: "a2", APIAddress: "10.0.0.2:7000"})
	set(SetMember{ID: "a1", APIAddress: "10.0.0.9:7000"}) // moved
	if got := fmt.Sprint(h.f.Members()); got != "map[a1:10.0.0.9:7000 a2:10.0.0.2:7000]" {
		t.Fatalf("Members() = %s", got)
	}
	if r := set(SetMember{ID: "a2", Remove: true}).(*SetMemberResult); !r.Removed {
		t.Fatalf("remove a2: %+v", r)
	}
	if r := set(SetMember{ID: "a2", Remove: true}).(*SetMemberResult); r.Removed {
		t.Fatalf("second remove of a2 reported a removal: %+v", r)
	}
	m := h.f.Members()
	m["a1"] = "changed"
	if h.f.Members()["a1"] != "10.0.0.9:7000" {
		t.Fatal("Members returned shared memory")
	}
	for _, bad := range []SetMember{{ID: "", APIAddress: "x"}, {ID: "a3"}, {ID: "a1", APIAddress: "x", Remove: true}, {ID: strings.Repeat("i", MaxMemberIDBytes+1), APIAddress: "x"}} {
		wantErr(t, set(bad), ErrInvalidArgument)
	}
	// Members survive a snapshot.
	f := New()
	if err := restore(f, snapshotBytes(t, h.f)); err != nil || fmt.Sprint(f.Members()) != fmt.Sprint(h.f.Members()) {
		t.Fatalf("restored members %v (%v), want %v", f.Members(), err, h.f.Members())
	}
}
