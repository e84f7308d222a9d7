package check

import (
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/allot-dev/allot/chaos/history"
)

// Times in these histories are true Unix ns; window w of 1000 ms spans
// [w s, w+1 s).
const (
	ms  = int64(time.Millisecond)
	sec = int64(time.Second)
)

var atlas = Quota{Name: "atlas", Limit: 100, WindowMs: 1000}

func acquire(region, id string, asked, tokens, window, call, at, expiresMs int64, grant string) history.Event {
	return history.Event{Kind: history.KindAcquire, Region: region, Quota: "atlas", RequestID: id, Asked: asked, Tokens: tokens,
		Window: window, Call: call, At: at, Outcome: history.OK, GrantID: grant, ExpiresMs: expiresMs, Deadline: expiresMs*ms - 250*ms}
}

// pregrant marks e as a pre-grant of its window (made before it starts).
func pregrant(e history.Event) history.Event {
	e.Next, e.NotBeforeMs = true, e.Window*1000
	return e
}

func admit(region, grant string, n, at, deadline int64) history.Event {
	return history.Event{Kind: history.KindAdmit, Region: region, Quota: "atlas", GrantID: grant, Tokens: n, At: at, Deadline: deadline}
}

func read(window, call, at, remaining, granted, released int64, grants ...history.LedgerGrant) history.Event {
	return history.Event{Kind: history.KindGetWindow, Quota: "atlas", Window: window, Call: call, At: at, Outcome: history.OK,
		Remaining: remaining, Granted: granted, Released: released, Grants: grants, Reason: "current"}
}

func run(t *testing.T, h history.History, qs ...Quota) *Result {
	t.Helper()
	if len(qs) == 0 {
		qs = []Quota{atlas}
	}
	return Run(h, Params{Quotas: qs, FaultGrace: 500 * time.Millisecond, LinearizabilityTimeout: 10 * time.Second})
}

func TestBound(t *testing.T) {
	base := []history.Event{
		acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
		acquire("us", "r2", 40, 40, 10, 10*sec, 10*sec+60*ms, 10_900, "g2"),
		read(10, 10*sec+500*ms, 10*sec+510*ms, 0, 100, 0,
			history.LedgerGrant{GrantID: "g1", Region: "eu", Tokens: 60}, history.LedgerGrant{GrantID: "g2", Region: "us", Tokens: 40}),
		admit("eu", "g1", 60, 10*sec+100*ms, 10*sec+600*ms),
		admit("us", "g2", 40, 10*sec+100*ms, 10*sec+600*ms),
	}
	tests := []struct {
		name  string
		extra []history.Event
		bound int64
		want  int
	}{
		{name: "at G", want: 0},
		{name: "one over G", extra: []history.Event{{Kind: history.KindAdmit, Region: "us", Quota: "atlas", Tokens: 1, At: 10*sec + 200*ms}}, want: 1},
		{name: "one over G within a bound of 1", extra: []history.Event{{Kind: history.KindAdmit, Region: "us", Quota: "atlas", Tokens: 1, At: 10*sec + 200*ms}}, bound: 1, want: 0},
		{name: "over G but in the next window", extra: []history.Event{{Kind: history.KindAdmit, Region: "us", Quota: "atlas", Tokens: 5, At: 11*sec + 200*ms}}, want: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			q := atlas
			q.Bound = tt.bound
			h := history.History{Events: append(append([]history.Event(nil), base...), tt.extra...),
				Faults: []history.Fault{{Scenario: "partition-region", Action: "inject", Detail: "eu cut", At: 10*sec + 300*ms}}}
			r := run(t, h, q)
			if got := r.Count(CheckBound); got != tt.want {
				t.Fatalf("bound violations = %d, want %d: %v", got, tt.want, r.Violations)
			}
			if tt.want > 0 {
				d := r.Violations[0].Detail
				for _, s := range []string{"admitted 101 > G 100 + bound 0", "eu", "us", "partition-region", "eu cut"} {
					if !strings.Contains(d, s) {
						t.Errorf("detail lacks %q:\n%s", s, d)
					}
				}
			}
		})
	}
}

func TestLostGrantsAndReplays(t *testing.T) {
	g1 := history.LedgerGrant{GrantID: "g1", Region: "eu", Tokens: 60}
	tests := []struct {
		name   string
		events []history.Event
		check  string
		want   int
	}{
		{name: "grant in the ledger", check: CheckLostGrant, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			read(10, 10*sec+500*ms, 10*sec+510*ms, 40, 60, 0, g1),
		}},
		{name: "grant missing after a failover", check: CheckLostGrant, want: 1, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			read(10, 10*sec+500*ms, 10*sec+510*ms, 100, 0, 0),
		}},
		{name: "grant recorded for another region", check: CheckLostGrant, want: 1, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			read(10, 10*sec+500*ms, 10*sec+510*ms, 40, 60, 0, history.LedgerGrant{GrantID: "g1", Region: "us", Tokens: 60}),
		}},
		{name: "read invoked before the grant was received need not hold it", check: CheckLostGrant, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			read(10, 10*sec+20*ms, 10*sec+30*ms, 100, 0, 0),
			read(10, 10*sec+500*ms, 10*sec+510*ms, 40, 60, 0, g1),
		}},
		{name: "no read after the last grant", check: CheckUnverified, want: 1, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
		}},
		{name: "probe replayed", check: CheckDoubleGrant, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			{Kind: history.KindProbe, Region: "eu", Quota: "atlas", RequestID: "r1", Outcome: history.OK, Replayed: true, GrantID: "g1", Tokens: 60, Window: 10, Call: 10*sec + 100*ms, At: 10*sec + 150*ms},
			read(10, 10*sec+500*ms, 10*sec+510*ms, 40, 60, 0, g1),
		}},
		{name: "probe granted anew", check: CheckDoubleGrant, want: 1, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			{Kind: history.KindProbe, Region: "eu", Quota: "atlas", RequestID: "r1", Outcome: history.OK, GrantID: "g7", Tokens: 40, Window: 10, Call: 10*sec + 100*ms, At: 10*sec + 150*ms},
			read(10, 10*sec+500*ms, 10*sec+510*ms, 0, 100, 0, g1, history.LedgerGrant{GrantID: "g7", Region: "eu", Tokens: 40}),
		}},
		{name: "one grant id for two requests", check: CheckDoubleGrant, want: 1, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			acquire("eu", "r2", 60, 40, 10, 10*sec+60*ms, 10*sec+90*ms, 10_900, "g1"),
			read(10, 10*sec+500*ms, 10*sec+510*ms, 0, 100, 0, g1),
		}},
		{name: "release rejected", check: CheckRelease, want: 1, events: []history.Event{
			{Kind: history.KindRelease, Region: "eu", Quota: "atlas", GrantID: "g1", Tokens: 10, Window: 10, Outcome: history.Failed, Err: "invalid_argument"},
		}},
		{name: "release of a window no longer kept", check: CheckRelease, events: []history.Event{
			{Kind: history.KindRelease, Region: "eu", Quota: "atlas", GrantID: "g1", Tokens: 10, Window: 10, Outcome: history.Failed, Err: "not_found", Reason: "not_found"},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := run(t, history.History{Events: tt.events})
			if got := r.Count(tt.check); got != tt.want {
				t.Fatalf("%s violations = %d, want %d: %v", tt.check, got, tt.want, r.Violations)
			}
		})
	}
}

func TestLeases(t *testing.T) {
	grant := acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1") // expires at 10.9 s
	tests := []struct {
		name   string
		events []history.Event
		check  string
		want   int
	}{
		{name: "spent before the deadline", check: CheckLateSpend, events: []history.Event{admit("eu", "g1", 10, 10*sec+600*ms, 10*sec+650*ms)}},
		{name: "spent after the allocator's expiry", check: CheckLateSpend, want: 1, events: []history.Event{admit("eu", "g1", 10, 10*sec+950*ms, 11*sec)}},
		{name: "spent after the region's own deadline", check: CheckLateSpend, want: 1, events: []history.Event{admit("eu", "g1", 10, 10*sec+700*ms, 10*sec+650*ms)}},
		{name: "another region's grant", check: CheckUnleased, want: 1, events: []history.Event{admit("us", "g1", 10, 10*sec+600*ms, 10*sec+650*ms)}},
		{name: "spent before received", check: CheckUnleased, want: 1, events: []history.Event{admit("eu", "g1", 10, 10*sec+10*ms, 10*sec+650*ms)}},
		{name: "overspent", check: CheckOverspent, want: 1, events: []history.Event{admit("eu", "g1", 50, 10*sec+100*ms, 10*sec+650*ms), admit("eu", "g1", 11, 10*sec+200*ms, 10*sec+650*ms)}},
		{name: "anonymous admissions a live grant covers", check: CheckUnleased, events: []history.Event{
			{Kind: history.KindAdmit, Region: "eu", Quota: "atlas", Tokens: 60, At: 10*sec + 500*ms},
		}},
		{name: "anonymous admissions beyond the grant", check: CheckUnleased, want: 1, events: []history.Event{
			{Kind: history.KindAdmit, Region: "eu", Quota: "atlas", Tokens: 61, At: 10*sec + 500*ms},
		}},
		{name: "anonymous admissions after expiry", check: CheckUnleased, want: 1, events: []history.Event{
			{Kind: history.KindAdmit, Region: "eu", Quota: "atlas", Tokens: 1, At: 10*sec + 900*ms},
		}},
		{name: "anonymous admissions of tokens handed back", check: CheckUnleased, want: 1, events: []history.Event{
			{Kind: history.KindAdmit, Region: "eu", Quota: "atlas", Tokens: 41, At: 10*sec + 300*ms},
			{Kind: history.KindRelease, Region: "eu", Quota: "atlas", GrantID: "g1", Tokens: 20, Returned: 20, Window: 10, Call: 10*sec + 600*ms, At: 10*sec + 700*ms, Outcome: history.OK},
		}},
		{name: "anonymous admissions before a pre-grant's window", check: CheckUnleased, want: 1, events: []history.Event{
			pregrant(acquire("eu", "r9", 50, 50, 11, 10*sec+100*ms, 10*sec+150*ms, 11_900, "g9")),
			{Kind: history.KindAdmit, Region: "eu", Quota: "atlas", Tokens: 61, At: 10*sec + 500*ms},
		}},
		{name: "anonymous admissions of a pre-grant in its window", check: CheckUnleased, events: []history.Event{
			pregrant(acquire("eu", "r9", 50, 50, 11, 10*sec+100*ms, 10*sec+150*ms, 11_900, "g9")),
			{Kind: history.KindAdmit, Region: "eu", Quota: "atlas", Tokens: 50, At: 11*sec + 100*ms},
		}},
		{name: "a pre-grant spent before its window", check: CheckUnleased, want: 1, events: []history.Event{
			pregrant(acquire("eu", "r9", 50, 50, 11, 10*sec+100*ms, 10*sec+150*ms, 11_900, "g9")),
			admit("eu", "g9", 5, 10*sec+600*ms, 11*sec+650*ms),
		}},
		{name: "anonymous admissions of the tokens kept", check: CheckUnleased, events: []history.Event{
			{Kind: history.KindAdmit, Region: "eu", Quota: "atlas", Tokens: 40, At: 10*sec + 300*ms},
			{Kind: history.KindRelease, Region: "eu", Quota: "atlas", GrantID: "g1", Tokens: 20, Call: 10*sec + 600*ms, At: 10*sec + 700*ms, Outcome: history.Unknown},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ev := append([]history.Event{grant, read(10, 11*sec, 11*sec+ms, 40, 60, 0, history.LedgerGrant{GrantID: "g1", Region: "eu", Tokens: 60})}, tt.events...)
			r := run(t, history.History{Events: ev})
			if got := r.Count(tt.check); got != tt.want {
				t.Fatalf("%s violations = %d, want %d: %v", tt.check, got, tt.want, r.Violations)
			}
		})
	}
}

func TestDepositOutlivesLease(t *testing.T) {
	tests := []struct {
		name     string
		deadline int64 // true ns; 0: never deposited
		want     int
	}{
		{name: "store expiry before the allocator's", deadline: 10*sec + 640*ms},
		{name: "store expiry at the allocator's", deadline: 10*sec + 900*ms},
		{name: "never deposited", deadline: 0},
		{name: "store expiry after the allocator's", deadline: 10*sec + 901*ms, want: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1")
			g.Deadline = tt.deadline
			r := run(t, history.History{Events: []history.Event{g, read(10, 11*sec, 11*sec+ms, 40, 60, 0, history.LedgerGrant{GrantID: "g1", Region: "eu", Tokens: 60})}})
			if got := r.Count(CheckDepositLate); got != tt.want {
				t.Fatalf("%s violations = %d, want %d: %v", CheckDepositLate, got, tt.want, r.Violations)
			}
		})
	}
}

func TestStrandsOfAnonymousAdmissions(t *testing.T) {
	// An agent region: 60 granted in window 10, 25 admitted, 20 handed
	// back: 15 expired unspent. The driver reports its own strands; this
	// estimate is for regions whose admissions name no grant.
	h := history.History{Events: []history.Event{
		acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
		{Kind: history.KindAdmit, Region: "eu", Quota: "atlas", Tokens: 25, At: 10*sec + 300*ms},
		{Kind: history.KindRelease, Region: "eu", Quota: "atlas", GrantID: "g1", Tokens: 20, Returned: 20, Window: 10, Call: 10*sec + 600*ms, At: 10*sec + 700*ms, Outcome: history.OK},
		read(10, 11*sec, 11*sec+ms, 60, 60, 20, history.LedgerGrant{GrantID: "g1", Region: "eu", Tokens: 60, Released: 20}),
	}}
	r := run(t, h)
	for _, w := range r.Windows["atlas"] {
		if w.Index == 10 {
			if w.Stranded != 15 || w.Regions["eu"].Stranded != 15 {
				t.Fatalf("stranded %d (eu %d), want 15", w.Stranded, w.Regions["eu"].Stranded)
			}
			return
		}
	}
	t.Fatal("no window 10")
}

func TestLeasesFromLedgersAlone(t *testing.T) {
	// A region that reports admissions but no Acquires (the agent): its
	// admissions are matched against the grants the ledgers list for it.
	ledger := read(10, 11*sec, 11*sec+ms, 40, 60, 0, history.LedgerGrant{GrantID: "g1", Region: "eu", Tokens: 60, GrantedMs: 10_050, ExpiresMs: 10_900})
	tests := []struct {
		name string
		adm  []history.Event
		want int
	}{
		{name: "within the grant", adm: []history.Event{{Kind: history.KindAdmit, Region: "eu", Quota: "atlas", Tokens: 60, At: 10*sec + 500*ms}}},
		{name: "after its expiry", want: 1, adm: []history.Event{{Kind: history.KindAdmit, Region: "eu", Quota: "atlas", Tokens: 1, At: 10*sec + 950*ms}}},
		{name: "before it was made", want: 1, adm: []history.Event{{Kind: history.KindAdmit, Region: "eu", Quota: "atlas", Tokens: 1, At: 10*sec + 10*ms}}},
		{name: "more than granted", want: 1, adm: []history.Event{{Kind: history.KindAdmit, Region: "eu", Quota: "atlas", Tokens: 61, At: 10*sec + 500*ms}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := run(t, history.History{Events: append([]history.Event{ledger}, tt.adm...)})
			if got := r.Count(CheckUnleased); got != tt.want {
				t.Fatalf("unleased violations = %d, want %d: %v", got, tt.want, r.Violations)
			}
		})
	}
}

func TestUnmatchedEDF(t *testing.T) {
	g := func(at, expMs, tokens int64) history.Event {
		return history.Event{At: at, ExpiresMs: expMs, Tokens: tokens}
	}
	a := func(at, n int64) history.Event { return history.Event{At: at, Tokens: n} }
	tests := []struct {
		name   string
		adm    []history.Event
		grants []history.Event
		want   int64
	}{
		{name: "earliest expiry first leaves room for later", grants: []history.Event{g(0, 10_000, 5), g(0, 1, 5)},
			adm: []history.Event{a(int64(500*time.Microsecond), 5), a(5*sec, 5)}, want: 0},
		{name: "nothing live", grants: []history.Event{g(2*sec, 3000, 5)}, adm: []history.Event{a(sec, 1)}, want: 1},
		{name: "too many", grants: []history.Event{g(0, 3000, 5)}, adm: []history.Event{a(sec, 4), a(2*sec, 4)}, want: 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got int64
			miss, _ := unmatched(tt.adm, tt.grants)
			for _, e := range miss {
				got += e.Tokens
			}
			if got != tt.want {
				t.Fatalf("unmatched tokens = %d, want %d", got, tt.want)
			}
		})
	}
}

func TestLinearizability(t *testing.T) {
	rel := func(tokens, returned, call, at int64) history.Event {
		return history.Event{Kind: history.KindRelease, Region: "eu", Quota: "atlas", GrantID: "g1", Tokens: tokens, Returned: returned, Window: 10, Call: call, At: at, Outcome: history.OK}
	}
	tests := []struct {
		name   string
		events []history.Event
		check  string
		want   int
	}{
		{name: "grants, release and reads in order", check: CheckLinearizable, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			acquire("us", "r2", 60, 40, 10, 10*sec+100*ms, 10*sec+150*ms, 10_900, "g2"),
			read(10, 10*sec+200*ms, 10*sec+210*ms, 0, 100, 0),
			rel(20, 20, 10*sec+300*ms, 10*sec+310*ms),
			read(10, 10*sec+400*ms, 10*sec+410*ms, 20, 100, 20),
		}},
		// A Release is tied to its grant: it hands back at most what the
		// grant has not released yet, and the pool never exceeds G.
		{name: "a grant released in two parts", check: CheckLinearizable, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			rel(20, 20, 10*sec+100*ms, 10*sec+110*ms),
			rel(40, 40, 10*sec+120*ms, 10*sec+130*ms),
			read(10, 10*sec+140*ms, 10*sec+150*ms, 100, 60, 60),
		}},
		{name: "a grant released twice", check: CheckLinearizable, want: 1, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			acquire("us", "r2", 40, 40, 10, 10*sec+60*ms, 10*sec+90*ms, 10_900, "g2"),
			rel(60, 60, 10*sec+100*ms, 10*sec+110*ms),
			rel(60, 60, 10*sec+120*ms, 10*sec+130*ms),
			read(10, 10*sec+140*ms, 10*sec+150*ms, 120, 100, 120), // remaining 120 > G 100
			acquire("us", "r3", 120, 120, 10, 10*sec+200*ms, 10*sec+250*ms, 10_900, "g3"),
		}},
		{name: "a release of more than its grant", check: CheckLinearizable, want: 1, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			acquire("us", "r2", 40, 40, 10, 10*sec+60*ms, 10*sec+90*ms, 10_900, "g2"),
			rel(90, 90, 10*sec+100*ms, 10*sec+110*ms), // within G, beyond g1's 60
			read(10, 10*sec+140*ms, 10*sec+150*ms, 90, 100, 90),
		}},
		{name: "an unanswered second release cannot have applied", check: CheckLinearizable, want: 1, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			rel(60, 60, 10*sec+100*ms, 10*sec+110*ms),
			{Kind: history.KindRelease, Region: "eu", Quota: "atlas", GrantID: "g1", Tokens: 60, Window: 10, Call: 10*sec + 120*ms, At: 10*sec + 130*ms, Outcome: history.Unknown},
			acquire("us", "r2", 100, 100, 10, 10*sec+200*ms, 10*sec+250*ms, 10_900, "g2"),
			read(10, 10*sec+300*ms, 10*sec+310*ms, 60, 160, 120), // the second release applied
		}},
		{name: "a release of a grant not in the history lifts the pool above G", check: CheckLinearizable, want: 1, events: []history.Event{
			{Kind: history.KindRelease, Region: "eu", Quota: "atlas", GrantID: "gx", Tokens: 30, Returned: 30, Window: 10, Call: 10*sec + 100*ms, At: 10*sec + 110*ms, Outcome: history.OK},
		}},
		{name: "concurrent grants in either order", check: CheckLinearizable, events: []history.Event{
			acquire("eu", "r1", 60, 40, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			acquire("us", "r2", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g2"),
		}},
		{name: "a grant larger than the pool", check: CheckLinearizable, want: 1, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			acquire("us", "r2", 60, 60, 10, 10*sec+100*ms, 10*sec+150*ms, 10_900, "g2"),
		}},
		{name: "a read that misses an acknowledged grant", check: CheckLinearizable, want: 1, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			read(10, 10*sec+200*ms, 10*sec+210*ms, 100, 0, 0),
		}},
		{name: "an unanswered acquire may have applied", check: CheckLinearizable, events: []history.Event{
			{Kind: history.KindAcquire, Region: "eu", Quota: "atlas", RequestID: "r1", Asked: 30, Call: 10 * sec, At: 10*sec + 100*ms, Outcome: history.Unknown},
			read(10, 10*sec+200*ms, 10*sec+210*ms, 70, 30, 0),
		}},
		{name: "an unanswered acquire may not have applied", check: CheckLinearizable, events: []history.Event{
			{Kind: history.KindAcquire, Region: "eu", Quota: "atlas", RequestID: "r1", Asked: 30, Call: 10 * sec, At: 10*sec + 100*ms, Outcome: history.Unknown},
			read(10, 10*sec+200*ms, 10*sec+210*ms, 100, 0, 0),
		}},
		{name: "a replay of a recorded grant", check: CheckLinearizable, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			{Kind: history.KindProbe, Region: "eu", Quota: "atlas", RequestID: "r1", Outcome: history.OK, Replayed: true, GrantID: "g1", Tokens: 60, Window: 10, Call: 10*sec + 100*ms, At: 10*sec + 150*ms},
		}},
		{name: "a replay with other tokens", check: CheckLinearizable, want: 1, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			{Kind: history.KindProbe, Region: "eu", Quota: "atlas", RequestID: "r1", Outcome: history.OK, Replayed: true, GrantID: "g1", Tokens: 50, Window: 10, Call: 10*sec + 100*ms, At: 10*sec + 150*ms},
		}},
		{name: "an unanswered probe of a granted id is a replay", check: CheckLinearizable, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			{Kind: history.KindProbe, Region: "eu", Quota: "atlas", RequestID: "r1", Asked: 60, Outcome: history.Unknown, Call: 10*sec + 100*ms, At: 10*sec + 300*ms},
			read(10, 10*sec+400*ms, 10*sec+410*ms, 40, 60, 0),
		}},
		{name: "an unanswered probe delivered after the id's retention grants anew", check: CheckLinearizable, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			{Kind: history.KindProbe, Region: "eu", Quota: "atlas", RequestID: "r1", Asked: 60, Outcome: history.Unknown, Call: 10*sec + 100*ms, At: 10*sec + 300*ms},
			read(12, 12*sec+400*ms, 12*sec+410*ms, 40, 60, 0), // window 12 granted r1 again
		}},
		{name: "an unanswered probe cannot grant twice in one window", check: CheckLinearizable, want: 1, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			{Kind: history.KindProbe, Region: "eu", Quota: "atlas", RequestID: "r1", Asked: 40, Outcome: history.Unknown, Call: 10*sec + 100*ms, At: 10*sec + 300*ms},
			read(10, 10*sec+400*ms, 10*sec+410*ms, 0, 100, 0),
		}},
		{name: "a window reopened", check: CheckReopened, want: 1, events: []history.Event{
			read(11, 11*sec, 11*sec+10*ms, 100, 0, 0),
			acquire("eu", "r1", 60, 60, 10, 11*sec+100*ms, 11*sec+150*ms, 10_900, "g1"),
		}},
		{name: "a pre-grant of the next window opens nothing", check: CheckReopened, events: []history.Event{
			pregrant(acquire("eu", "r1", 60, 60, 11, 10*sec+800*ms, 10*sec+850*ms, 11_900, "g1")),
			read(10, 10*sec+900*ms, 10*sec+910*ms, 100, 0, 0),
		}},
		{name: "a pre-grant is in its window's linearization", check: CheckLinearizable, events: []history.Event{
			pregrant(acquire("eu", "r1", 60, 60, 11, 10*sec+800*ms, 10*sec+850*ms, 11_900, "g1")),
			read(11, 11*sec+400*ms, 11*sec+410*ms, 40, 60, 0),
		}},
		{name: "a pre-grant capped by what the region holds of the window", check: CheckLinearizable, events: []history.Event{
			pregrant(acquire("eu", "r1", 60, 11, 11, 10*sec+800*ms, 10*sec+850*ms, 11_900, "g1")),
			read(11, 11*sec+400*ms, 11*sec+410*ms, 89, 11, 0),
		}},
		{name: "a pre-grant larger than asked", check: CheckLinearizable, want: 1, events: []history.Event{
			pregrant(acquire("eu", "r1", 60, 61, 11, 10*sec+800*ms, 10*sec+850*ms, 11_900, "g1")),
			read(11, 11*sec+400*ms, 11*sec+410*ms, 39, 61, 0),
		}},
		{name: "an unanswered pre-grant may have taken from the next window", check: CheckLinearizable, events: []history.Event{
			{Kind: history.KindAcquire, Region: "eu", Quota: "atlas", RequestID: "r1", Asked: 60, Next: true, Outcome: history.Unknown, Call: 10*sec + 800*ms, At: 10*sec + 850*ms},
			read(11, 11*sec+400*ms, 11*sec+410*ms, 40, 60, 0),
		}},
		// Sent 200 ms before the turn, held in a partition, applied after
		// it: the allocator finds the ask early for window 12 and records
		// it with no tokens; a re-send replays that.
		{name: "an unanswered pre-grant applied too early got nothing", check: CheckLinearizable, events: []history.Event{
			{Kind: history.KindAcquire, Region: "eu", Quota: "atlas", RequestID: "r1", Asked: 60, Next: true, Outcome: history.Unknown, Call: 10*sec + 800*ms, At: 11*sec + 300*ms},
			{Kind: history.KindProbe, Region: "eu", Quota: "atlas", RequestID: "r1", Asked: 60, Next: true, Outcome: history.OK, Replayed: true, Tokens: 0, Window: 12, Call: 11*sec + 350*ms, At: 11*sec + 360*ms},
			read(12, 12*sec+400*ms, 12*sec+410*ms, 100, 0, 0),
		}},
		{name: "a replayed pre-grant of nothing, then tokens from the same window", check: CheckLinearizable, events: []history.Event{
			{Kind: history.KindAcquire, Region: "eu", Quota: "atlas", RequestID: "r1", Asked: 60, Next: true, Outcome: history.Unknown, Call: 10*sec + 800*ms, At: 11*sec + 300*ms},
			{Kind: history.KindProbe, Region: "eu", Quota: "atlas", RequestID: "r1", Asked: 60, Next: true, Outcome: history.OK, Replayed: true, Tokens: 60, Window: 12, Call: 11*sec + 350*ms, At: 11*sec + 360*ms},
			read(12, 12*sec+400*ms, 12*sec+410*ms, 100, 0, 0),
		}, want: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := run(t, history.History{Events: tt.events})
			if got := r.Count(tt.check); got != tt.want {
				t.Fatalf("%s violations = %d, want %d: %v", tt.check, got, tt.want, r.Violations)
			}
		})
	}
}

func TestBirch(t *testing.T) {
	birch := Quota{Name: "atlas", Limit: 100, WindowMs: 1000, Birch: true}
	sentAt := func(e history.Event, call int64) history.Event { e.Call = call; return e }
	deny := func(region string, at int64) history.Event {
		return history.Event{Kind: history.KindDeny, Region: region, Quota: "atlas", Tokens: 3, At: at, Reason: history.ReasonCutOff}
	}
	span := history.Span{Scenario: "partition-region", Start: 20 * sec, End: 22 * sec, RecoverFrom: 22 * sec, Regions: []string{"eu"}}
	first := []history.Event{
		acquire("eu", "r1", 10, 10, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
		acquire("us", "r2", 10, 10, 10, 10*sec, 10*sec+50*ms, 10_900, "g2"),
	}
	tests := []struct {
		name string
		deny history.Event
		want int
	}{
		{name: "before the first grant (start-up)", deny: deny("eu", 9*sec)},
		{name: "sent before the first grant, answered after it (start-up)", deny: sentAt(deny("eu", 10*sec+900*ms), 9*sec+900*ms)},
		{name: "sent after the first grant", deny: sentAt(deny("us", 10*sec+900*ms), 10*sec+100*ms), want: 1},
		{name: "inside the fault of its region", deny: deny("eu", 21*sec)},
		{name: "within the grace after the heal", deny: deny("eu", 22*sec+400*ms)},
		{name: "after the grace", deny: deny("eu", 22*sec+600*ms), want: 1},
		{name: "in a region the fault does not touch", deny: deny("us", 21*sec), want: 1},
		{name: "with no fault at all", deny: deny("us", 15*sec), want: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := history.History{Events: append(append([]history.Event(nil), first...), tt.deny), Spans: []history.Span{span}}
			r := run(t, h, birch)
			if got := r.Count(CheckBirch); got != tt.want {
				t.Fatalf("birch violations = %d, want %d: %v", got, tt.want, r.Violations)
			}
		})
	}
}

// TestBirchStartupIsBounded: a request sent before its region's first
// grant is excused as a cold start only within Params.StartupGrace (5 s by
// default) of the region's first request or Acquire, and a region that
// never receives a grant is a violation however its denials fall.
func TestBirchStartupIsBounded(t *testing.T) {
	birch := Quota{Name: "atlas", Limit: 100, WindowMs: 1000, Birch: true}
	base := []history.Event{
		acquire("eu", "r1", 10, 10, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
		read(10, 10*sec+500*ms, 10*sec+510*ms, 90, 10, 0, history.LedgerGrant{GrantID: "g1", Region: "eu", Tokens: 10}),
	}
	// ap: a request every 100 ms from 10 s to 70 s, every one denied 503,
	// no fault anywhere.
	var denials []history.Event
	for i := int64(0); i < 600; i++ {
		at := 10*sec + i*100*ms
		denials = append(denials, history.Event{Kind: history.KindDeny, Region: "ap", Quota: "atlas", Tokens: 1, Call: at - 5*ms, At: at, Reason: history.ReasonUnavailable})
	}
	never := func(r *Result) bool {
		for _, v := range r.Violations {
			if v.Check == CheckBirch && v.Region == "ap" && strings.Contains(v.Detail, "never received a grant") {
				return true
			}
		}
		return false
	}
	// Windows of ap with a violation.
	flagged := func(r *Result) map[int64]bool {
		out := map[int64]bool{}
		for _, v := range r.Violations {
			if v.Check == CheckBirch && v.Region == "ap" && v.Window != 0 {
				out[v.Window] = true
			}
		}
		return out
	}

	r := run(t, history.History{Events: append(append([]history.Event(nil), base...), denials...)}, birch)
	if !never(r) {
		t.Errorf("a region never granted is not reported: %v", r.Violations)
	}
	// Start-up runs from 9.995 s (the first request's send) to 14.995 s.
	if w := flagged(r); len(w) != 55 || w[14] || !w[15] || !w[69] {
		t.Errorf("never granted: %d windows flagged (%v), want 15..69 but not 10..14", len(w), w)
	}

	late := append(append([]history.Event(nil), base...), acquire("ap", "r9", 10, 10, 60, 60*sec, 60*sec+50*ms, 60_900, "g9"))
	r = run(t, history.History{Events: append(late, denials...)}, birch)
	if never(r) {
		t.Errorf("a region granted at 60 s is reported as never granted: %v", r.Violations)
	}
	if w := flagged(r); w[14] || !w[15] || !w[59] {
		t.Errorf("first grant 50 s late: windows flagged %v, want from 15 on", w)
	}

	// Inside a fault span every denial is excused, but a region that was
	// never granted is still reported.
	span := history.Span{Scenario: "partition-region", Start: 9 * sec, End: 71 * sec, RecoverFrom: 71 * sec, Regions: []string{"ap"}}
	r = run(t, history.History{Events: append(append([]history.Event(nil), base...), denials...), Spans: []history.Span{span}}, birch)
	if !never(r) || len(flagged(r)) != 0 {
		t.Errorf("inside a fault: never granted reported %v, windows flagged %v; want true, none", never(r), flagged(r))
	}
}

// TestBirchDenialContext: a Birch violation says when the request was sent
// and which Acquires of its quota its region made just before, so that a CI
// failure can be read without the run's logs.
func TestBirchDenialContext(t *testing.T) {
	birch := Quota{Name: "atlas", Limit: 100, WindowMs: 1000, Birch: true}
	late := pregrant(acquire("us", "r3", 20, 20, 13, 12*sec+200*ms, 12*sec+900*ms, 13_900, "g3"))
	lost := acquire("us", "r4", 10, 0, 0, 12*sec+950*ms, 14*sec+950*ms, 0, "")
	lost.Outcome = history.Unknown
	deny := history.Event{Kind: history.KindDeny, Region: "us", Quota: "atlas", Tokens: 2, Call: 12*sec + 100*ms, At: 13*sec + 100*ms, Reason: history.ReasonUnavailable}
	h := history.History{Events: []history.Event{
		acquire("us", "r1", 10, 10, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"), // before the context
		acquire("eu", "r2", 10, 10, 12, 12*sec, 12*sec+50*ms, 12_900, "g2"), // another region
		late, lost, deny,
	}}
	r := run(t, h, birch)
	if r.Count(CheckBirch) != 1 {
		t.Fatalf("birch violations = %d, want 1: %v", r.Count(CheckBirch), r.Violations)
	}
	var detail string
	for _, v := range r.Violations {
		if v.Check == CheckBirch {
			detail = v.Detail
		}
	}
	for _, want := range []string{
		"2 denials (unavailable_503 2)",
		"sent at 00:00:12.100, answered after 1s",
		"00:00:12.200 pre-grant asked 20 got 20 (ok after 700ms)",
		"00:00:12.950 renewal asked 10 got 0 (unknown after 2s)",
	} {
		if !strings.Contains(detail, want) {
			t.Errorf("detail lacks %q:\n%s", want, detail)
		}
	}
	if strings.Contains(detail, "00:00:10.000") || strings.Contains(detail, "00:00:12.000") {
		t.Errorf("detail lists an Acquire from before the context or of another region:\n%s", detail)
	}
}

func TestRecoveryAndTable(t *testing.T) {
	h := history.History{
		Events: []history.Event{
			acquire("eu", "r1", 10, 10, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			acquire("us", "r2", 10, 10, 10, 10*sec, 10*sec+50*ms, 10_900, "g2"),
			acquire("eu", "r3", 10, 10, 12, 12*sec, 12*sec+700*ms, 12_900, "g3"),
			acquire("us", "r4", 10, 10, 12, 12*sec, 12*sec+300*ms, 12_900, "g4"),
			{Kind: history.KindStrand, Region: "eu", Quota: "atlas", GrantID: "g3", Tokens: 10, Window: 12, At: 12*sec + 900*ms},
			{Kind: history.KindDeny, Region: "eu", Quota: "atlas", Tokens: 4, At: 11*sec + 550*ms, Reason: history.ReasonCutOff},
			read(10, 10*sec+500*ms, 10*sec+510*ms, 80, 20, 0, history.LedgerGrant{GrantID: "g1", Region: "eu", Tokens: 10}, history.LedgerGrant{GrantID: "g2", Region: "us", Tokens: 10}),
			read(12, 12*sec+800*ms, 12*sec+810*ms, 80, 20, 0, history.LedgerGrant{GrantID: "g3", Region: "eu", Tokens: 10}, history.LedgerGrant{GrantID: "g4", Region: "us", Tokens: 10}),
		},
		Spans: []history.Span{
			{Scenario: "kill-leader", Start: 11*sec + 500*ms, End: 11*sec + 600*ms, RecoverFrom: 12 * sec},
			{Scenario: "restart-store", Skipped: "needs the region agent"},
		},
	}
	r := run(t, h)
	if got, want := r.Recovery[0], 700*time.Millisecond; got != want {
		t.Fatalf("recovery = %s, want %s", got, want)
	}
	rows := Table(h, r, []Quota{atlas}, 500*time.Millisecond)
	if len(rows) != 3 {
		t.Fatalf("rows = %+v, want kill-leader, restart-store and calm", rows)
	}
	if rows[0].Windows != 2 || rows[0].StrandedPct != 5 || rows[0].Violations != 0 {
		t.Errorf("kill-leader row = %+v, want 2 windows (11, 12) and 10 of 200 stranded (5%%)", rows[0])
	}
	if rows[1].Note == "" {
		t.Errorf("restart-store row = %+v, want a note saying why it was skipped", rows[1])
	}
	var b strings.Builder
	if err := Render(&b, "test", h, r, []Quota{atlas}, 500*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"kill-leader", "restart-store", "needs the region agent", "calm", "porcupine atlas"} {
		if !strings.Contains(b.String(), s) {
			t.Errorf("report lacks %q:\n%s", s, b.String())
		}
	}
}

// TestLedgerFallbackKeepsReleases: region ap spends 60 tokens of a grant it
// had released in full. With its journal present (even when that grant is
// its only one) and without (the ledger fallback, which must subtract what
// the ledger says was released), the admission had no lease.
func TestLedgerFallbackKeepsReleases(t *testing.T) {
	lg := history.LedgerGrant{GrantID: "g5", Region: "ap", Tokens: 60, Released: 60, GrantedMs: 10_050, ExpiresMs: 10_900}
	readEv := read(10, 11*sec, 11*sec+ms, 100, 60, 60, lg)
	adm := history.Event{Kind: history.KindAdmit, Region: "ap", Quota: "atlas", Tokens: 60, At: 10*sec + 500*ms}
	rel := history.Event{Kind: history.KindRelease, Region: "ap", Quota: "atlas", GrantID: "g5", Tokens: 60, Returned: 60,
		Window: 10, Call: 10*sec + 100*ms, At: 10*sec + 150*ms, Outcome: history.OK}
	journal := run(t, history.History{Events: []history.Event{
		acquire("ap", "r5", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g5"), rel, adm, readEv}})
	if n := journal.Count(CheckUnleased); n == 0 {
		t.Errorf("journal whose only grant was released: spent_without_lease = 0, want the 60 spent flagged (%v)", journal.Violations)
	}
	noJournal := run(t, history.History{Events: []history.Event{adm, readEv}})
	if n := noJournal.Count(CheckUnleased); n == 0 {
		t.Errorf("no journal (ledger fallback): spent_without_lease = 0, want the 60 spent flagged (%v)", noJournal.Violations)
	}
	// The ledger's unreleased part still covers an admission.
	part := history.LedgerGrant{GrantID: "g6", Region: "ap", Tokens: 60, Released: 20, GrantedMs: 10_050, ExpiresMs: 10_900}
	ok := run(t, history.History{Events: []history.Event{
		{Kind: history.KindAdmit, Region: "ap", Quota: "atlas", Tokens: 40, At: 10*sec + 500*ms},
		read(10, 11*sec, 11*sec+ms, 60, 60, 20, part)}})
	if n := ok.Count(CheckUnleased); n != 0 {
		t.Errorf("40 spent of a ledger grant of 60 with 20 released: %d flagged, want none (%v)", n, ok.Violations)
	}
}

// deposit is a region agent's deposit of grant g, sent at sent and
// returned at at, with outcome o (its Deadline: see history.KindDeposit).
func deposit(g history.Event, o history.Outcome, sent, at int64) history.Event {
	d := history.Event{Kind: history.KindDeposit, Region: g.Region, Quota: g.Quota, GrantID: g.GrantID, Tokens: g.Tokens, Window: g.Window,
		ExpiresMs: g.ExpiresMs, Call: sent, At: at, Outcome: o}
	if o == history.Failed && sent != 0 {
		d.Deadline = at
	}
	return d
}

// TestFailedDepositEndsTheGrant: nothing of a grant whose deposit failed
// is spendable in the store after the deposit returned (At, its Deadline),
// so the earliest-deadline-first matching lets it cover only admissions
// stamped up to Params.AnswerDelay (250 ms) later. Admissions after that
// are a violation exactly when the region's other live grants cannot
// cover them: the matching gives each admission to the live grant that
// ends first and has tokens left, and the failed grant is not live.
func TestFailedDepositEndsTheGrant(t *testing.T) {
	g1 := acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1") // deposit failed at 10.2 s
	g1.Deadline = 10*sec + 200*ms
	g2 := acquire("eu", "r2", 30, 30, 10, 10*sec+60*ms, 10*sec+100*ms, 10_950, "g2")
	base := []history.Event{g1, deposit(g1, history.Failed, 10*sec+60*ms, 10*sec+200*ms), g2, deposit(g2, history.OK, 10*sec+110*ms, 10*sec+120*ms),
		read(10, 11*sec, 11*sec+ms, 910, 90, 0, history.LedgerGrant{GrantID: "g1", Region: "eu", Tokens: 60}, history.LedgerGrant{GrantID: "g2", Region: "eu", Tokens: 30})}
	anon := func(n, at int64) history.Event {
		return history.Event{Kind: history.KindAdmit, Region: "eu", Quota: "atlas", Tokens: n, At: at}
	}
	q := atlas
	q.Limit = 1000 // the bound is not what this tests
	tests := []struct {
		name string
		adm  []history.Event
		want int64 // admissions no grant covers
	}{
		{name: "300 ms past its At, more than the live grant holds", adm: []history.Event{anon(60, 10*sec+500*ms)}, want: 30},
		{name: "300 ms past its At, within what the live grant holds", adm: []history.Event{anon(30, 10*sec+500*ms)}},
		{name: "answered within the answer delay of its At", adm: []history.Event{anon(60, 10*sec+440*ms), anon(30, 10*sec+500*ms)}},
		{name: "before its At, then the live grant", adm: []history.Event{anon(60, 10*sec+150*ms), anon(30, 10*sec+800*ms)}},
		{name: "before its At, more than both", adm: []history.Event{anon(60, 10*sec+150*ms), anon(31, 10*sec+800*ms)}, want: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := run(t, history.History{Events: append(append([]history.Event(nil), base...), tt.adm...)}, q)
			got := unleasedTokens(t, r)
			if got != tt.want {
				t.Fatalf("admissions without a lease = %d, want %d: %v", got, tt.want, r.Violations)
			}
		})
	}
	// Its deadline is held to the allocator's expiry like any other.
	late := g1
	late.Deadline = 10*sec + 901*ms
	r := run(t, history.History{Events: []history.Event{late, deposit(late, history.Failed, 10*sec+60*ms, 10*sec+901*ms),
		read(10, 11*sec, 11*sec+ms, 40, 60, 0, history.LedgerGrant{GrantID: "g1", Region: "eu", Tokens: 60})}})
	if r.Count(CheckDepositLate) != 1 || r.DepositsChecked != 1 {
		t.Errorf("a failed deposit returning after the allocator's expiry: %d %s, %d deadlines checked; want 1 and 1: %v",
			r.Count(CheckDepositLate), CheckDepositLate, r.DepositsChecked, r.Violations)
	}
}

// TestReplayedAdmissionIsPlacedFromItsFirstSend: an admission answered as
// a replay (the request's first answer was lost, the retry got the stored
// decision back) was decided by an earlier attempt, at some instant from
// its first send to its answer: a grant live anywhere in that span covers
// it, and the bound counts it in the window of its first send. The same
// admission answered fresh is a point at its answer, where no grant is
// live.
func TestReplayedAdmissionIsPlacedFromItsFirstSend(t *testing.T) {
	g1 := acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1")
	base := []history.Event{g1, deposit(g1, history.OK, 10*sec+60*ms, 10*sec+70*ms),
		read(10, 11*sec, 11*sec+ms, 940, 60, 0, history.LedgerGrant{GrantID: "g1", Region: "eu", Tokens: 60})}
	adm := func(call, at int64, replayed bool) history.Event {
		return history.Event{Kind: history.KindAdmit, Region: "eu", Quota: "atlas", Tokens: 60, Call: call, At: at, Replayed: replayed}
	}
	q := atlas
	q.Limit = 1000 // the bound is not what this tests
	tests := []struct {
		name       string
		adm        history.Event
		unleased   int64
		wantWindow int64 // where the bound counts it
	}{
		{name: "replay of a decision the grant covered", adm: adm(10*sec+100*ms, 12*sec+300*ms, true), wantWindow: 10},
		{name: "the same answer decided fresh", adm: adm(10*sec+100*ms, 12*sec+300*ms, false), unleased: 60, wantWindow: 12},
		{name: "replay first sent after the grant expired", adm: adm(10*sec+950*ms, 12*sec+300*ms, true), unleased: 60, wantWindow: 10},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := run(t, history.History{Events: append(append([]history.Event(nil), base...), tt.adm)}, q)
			got := unleasedTokens(t, r)
			if got != tt.unleased {
				t.Fatalf("admissions without a lease = %d, want %d: %v", got, tt.unleased, r.Violations)
			}
			if want := map[bool]int{true: 1}[tt.adm.Replayed]; r.ReplayedAdmissions != want {
				t.Errorf("ReplayedAdmissions = %d, want %d", r.ReplayedAdmissions, want)
			}
			for _, w := range r.Windows["atlas"] {
				if w.Admitted > 0 && w.Index != tt.wantWindow {
					t.Fatalf("counted in window %d, want %d", w.Index, tt.wantWindow)
				}
			}
		})
	}
}

// unleasedTokens sums the admissions r's spent_without_lease violations
// count (each detail starts with the number); any other violation fails t.
func unleasedTokens(t *testing.T, r *Result) int64 {
	t.Helper()
	var got int64
	for _, v := range r.Violations {
		if v.Check != CheckUnleased {
			t.Errorf("unexpected violation %v", v)
			continue
		}
		var n int64
		fmt.Sscan(v.Detail, &n)
		got += n
	}
	return got
}

// TestDepositUnknown: a deposit whose outcome is unknown may land late and
// outlive its lease by any amount: a violation, unless a fault that stops
// or kills its region's store (Span.Store) comes within FaultGrace of it.
func TestDepositUnknown(t *testing.T) {
	g := acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1")
	g.Deadline = 0 // what the journal gives a grant whose deposit is unknown
	dep := deposit(g, history.Unknown, 10*sec+60*ms, 10*sec+560*ms)
	events := []history.Event{g, dep, read(10, 11*sec, 11*sec+ms, 40, 60, 0, history.LedgerGrant{GrantID: "g1", Region: "eu", Tokens: 60})}
	store := func(region string, start, end int64) history.Span {
		return history.Span{Scenario: "restart-store", Start: start, End: end, RecoverFrom: end, Regions: []string{region}, Store: true}
	}
	tests := []struct {
		name  string
		spans []history.Span
		want  int
	}{
		{name: "no fault", want: 1},
		{name: "its region's store restarted meanwhile", spans: []history.Span{store("eu", 10*sec+300*ms, 10*sec+400*ms)}},
		{name: "its region's store restarted just after (the withdrawal met it)", spans: []history.Span{store("eu", 11*sec, 11*sec+100*ms)}},
		{name: "another region's store restarted", spans: []history.Span{store("us", 10*sec+300*ms, 10*sec+400*ms)}, want: 1},
		{name: "its region's store restarted long before", spans: []history.Span{store("eu", 5*sec, 5*sec+100*ms)}, want: 1},
		{name: "a fault that leaves the store alone", spans: []history.Span{{Scenario: "partition-region", Start: 10 * sec, End: 11 * sec, Regions: []string{"eu"}}}, want: 1},
		{name: "a store fault that was skipped", spans: []history.Span{{Scenario: "restart-store", Start: 10 * sec, End: 11 * sec, Store: true, Skipped: "skipped"}}, want: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := run(t, history.History{Events: events, Spans: tt.spans})
			if got := r.Count(CheckDepositUnknown); got != tt.want {
				t.Fatalf("%s violations = %d, want %d: %v", CheckDepositUnknown, got, tt.want, r.Violations)
			}
			if r.DepositsUnknown != 1 || r.DepositsExcused != 1-tt.want {
				t.Errorf("deposits unknown %d, excused %d; want 1, %d", r.DepositsUnknown, r.DepositsExcused, 1-tt.want)
			}
			if r.OK() != (tt.want == 0) {
				t.Errorf("Result.OK() = %v with %d violations", r.OK(), len(r.Violations))
			}
			var b strings.Builder
			if err := Render(&b, "test", history.History{Events: events, Spans: tt.spans}, r, []Quota{atlas}, 500*time.Millisecond); err != nil {
				t.Fatal(err)
			}
			if want := fmt.Sprintf("%s %d", CheckDepositUnknown, tt.want); !strings.Contains(b.String(), want) {
				t.Errorf("report lacks %q:\n%s", want, b.String())
			}
		})
	}
}

// TestVacuousDeposits: a run whose grants all have Deadline 0 (never
// deposited, or deposits the history does not bound) checked no deposit:
// Result.Vacuous says so.
func TestVacuousDeposits(t *testing.T) {
	g1 := acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1")
	g2 := acquire("us", "r2", 40, 40, 10, 10*sec, 10*sec+60*ms, 10_900, "g2")
	events := func(deadline int64) []history.Event {
		a, b := g1, g2
		a.Deadline, b.Deadline = 0, deadline
		return []history.Event{a, b,
			{Kind: history.KindProbe, Region: "eu", Quota: "atlas", RequestID: "r1", Outcome: history.OK, Replayed: true, GrantID: "g1", Tokens: 60, Window: 10, Call: 10*sec + 100*ms, At: 10*sec + 150*ms},
			read(10, 10*sec+500*ms, 10*sec+510*ms, 0, 100, 0,
				history.LedgerGrant{GrantID: "g1", Region: "eu", Tokens: 60}, history.LedgerGrant{GrantID: "g2", Region: "us", Tokens: 40})}
	}
	r := run(t, history.History{Events: events(0)})
	if r.DepositsChecked != 0 || len(r.Vacuous()) != 1 || !strings.Contains(r.Vacuous()[0], "deposit") {
		t.Errorf("no grant with a deadline: %d checked, vacuous %q; want 0 and the deposit check named", r.DepositsChecked, r.Vacuous())
	}
	r = run(t, history.History{Events: events(10*sec + 600*ms)})
	if r.DepositsChecked != 1 || len(r.Vacuous()) != 0 {
		t.Errorf("one grant with a deadline: %d checked, vacuous %q; want 1 and nothing", r.DepositsChecked, r.Vacuous())
	}
	if v := (&Result{}).Vacuous(); len(v) != 3 {
		t.Errorf("an empty result: vacuous %q, want no grant, no ledger read, no replay", v)
	}
}

// TestMaxHeldPerRegion: a quota whose policy caps what a region holds
// (lease.max_held_per_region) may grant less than min(asked, remaining):
// the pool model allows it, up to the cap, only for such a quota; an
// unanswered Acquire of it may have taken any amount up to the cap.
func TestMaxHeldPerRegion(t *testing.T) {
	capped := atlas
	capped.MaxHeldPerRegion = 50
	lost := history.Event{Kind: history.KindAcquire, Region: "eu", Quota: "atlas", RequestID: "r9", Asked: 40, Call: 10 * sec, At: 10*sec + 100*ms, Outcome: history.Unknown}
	tests := []struct {
		name   string
		q      Quota
		events []history.Event
		want   int
	}{
		{name: "cut short by the cap", q: capped, events: []history.Event{
			acquire("eu", "r1", 60, 50, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			acquire("eu", "r2", 60, 10, 10, 10*sec+100*ms, 10*sec+150*ms, 10_900, "g2"), // the region holds 40 of another window
			read(10, 10*sec+200*ms, 10*sec+210*ms, 40, 60, 0),
		}},
		{name: "cut short without a cap", q: atlas, want: 1, events: []history.Event{
			acquire("eu", "r1", 60, 50, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			read(10, 10*sec+200*ms, 10*sec+210*ms, 50, 50, 0),
		}},
		{name: "more than the cap", q: capped, want: 1, events: []history.Event{
			acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
		}},
		{name: "more than the pool", q: capped, want: 1, events: []history.Event{
			acquire("eu", "r1", 50, 50, 10, 10*sec, 10*sec+50*ms, 10_900, "g1"),
			acquire("us", "r2", 50, 50, 10, 10*sec, 10*sec+50*ms, 10_900, "g2"),
			acquire("ap", "r3", 50, 1, 10, 10*sec+100*ms, 10*sec+150*ms, 10_900, "g3"),
		}},
		{name: "an unanswered capped Acquire took part of its ask", q: capped, events: []history.Event{
			lost, read(10, 10*sec+200*ms, 10*sec+210*ms, 83, 17, 0),
		}},
		{name: "an unanswered uncapped Acquire took part of its ask", q: atlas, want: 1, events: []history.Event{
			lost, read(10, 10*sec+200*ms, 10*sec+210*ms, 83, 17, 0),
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := run(t, history.History{Events: tt.events}, tt.q)
			if got := r.Count(CheckLinearizable); got != tt.want {
				t.Fatalf("%s violations = %d, want %d: %v", CheckLinearizable, got, tt.want, r.Violations)
			}
		})
	}
}

// TestCeilingSaturates: G plus a bound near the int64 range saturates
// (as pkg/bound's Ceiling does) instead of wrapping below G.
func TestCeilingSaturates(t *testing.T) {
	huge := Quota{Name: "atlas", Limit: math.MaxInt64 - 5, WindowMs: 1000, Bound: 10}
	if got := huge.Ceiling(); got != math.MaxInt64 {
		t.Fatalf("Ceiling = %d, want math.MaxInt64", got)
	}
	if got := (Quota{Limit: 1000, Bound: 250}).Ceiling(); got != 1250 {
		t.Fatalf("Ceiling = %d, want 1250", got)
	}
	r := run(t, history.History{Events: []history.Event{{Kind: history.KindAdmit, Region: "eu", Quota: "atlas", Tokens: 1000, At: 10 * sec}}}, huge)
	if n := r.Count(CheckBound); n != 0 {
		t.Fatalf("1,000 admitted against a ceiling of math.MaxInt64: %d bound violations, want 0: %v", n, r.Violations)
	}
}

// TestMeasureLoad: a calm window offered (admitted + denied, measured) more
// than G + bound, with denials, is contended; a window a fault span touches
// (extended by grace) or one offered no more than the ceiling is not.
func TestMeasureLoad(t *testing.T) {
	deny := func(region string, n, at int64) history.Event {
		return history.Event{Kind: history.KindDeny, Region: region, Quota: "atlas", Tokens: n, At: at, Reason: history.ReasonLimited}
	}
	// Window 10: eu 70 + us 30 admitted, 20 denied: offered 120 > G 100.
	flood := []history.Event{
		admit("eu", "g1", 70, 10*sec+100*ms, 10*sec+600*ms),
		admit("us", "g2", 30, 10*sec+100*ms, 10*sec+600*ms),
		deny("eu", 20, 10*sec+300*ms),
	}
	// Window 12: 90 admitted, none denied: under G.
	light := []history.Event{admit("eu", "g3", 90, 12*sec+100*ms, 12*sec+600*ms)}
	tests := []struct {
		name      string
		events    []history.Event
		spans     []history.Span
		bound     int64
		contended int
		max       int64
	}{
		{name: "a calm flooded window", events: flood, contended: 1, max: 120},
		{name: "under G", events: light, max: 90},
		{name: "flooded during a fault", events: flood, spans: []history.Span{{Scenario: "stop-leader", Start: 10*sec + 200*ms, End: 10*sec + 400*ms}}},
		{name: "flooded within the grace after a fault", events: flood, spans: []history.Span{{Scenario: "stop-leader", Start: 9*sec + 200*ms, End: 9*sec + 600*ms}}},
		{name: "flooded beside a skipped fault", events: flood, spans: []history.Span{{Scenario: "restart-store", Start: 10 * sec, End: 11 * sec, Skipped: "no store"}}, contended: 1, max: 120},
		{name: "over G but within G + bound", events: flood, bound: 20, max: 120},
		{name: "over G and nothing denied", events: append(append([]history.Event(nil), flood[:2]...), admit("us", "g2", 20, 10*sec+300*ms, 10*sec+600*ms)), max: 120},
		{name: "a flood and a light window", events: append(append([]history.Event(nil), flood...), light...), contended: 1, max: 120},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			q := atlas
			q.Bound = tt.bound
			h := history.History{Events: tt.events, Spans: tt.spans}
			r := run(t, h, q)
			l := MeasureLoad(h, r, q, 500*time.Millisecond)
			if l.Contended != tt.contended || l.MaxOffered != tt.max {
				t.Errorf("contended %d, max offered %d; want %d, %d (%s)", l.Contended, l.MaxOffered, tt.contended, tt.max, l)
			}
			var admitted int64
			for _, e := range tt.events {
				if e.Kind == history.KindAdmit {
					admitted += e.Tokens
				}
			}
			if got := l.Admitted["eu"] + l.Admitted["us"]; got != admitted {
				t.Errorf("admitted per region %v, want %d in all", l.Admitted, admitted)
			}
			var b strings.Builder
			if err := Render(&b, "test", h, r, []Quota{q}, 500*time.Millisecond); err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(b.String(), l.String()) || !strings.Contains(b.String(), "max offered") {
				t.Errorf("report lacks the measured load %q:\n%s", l, b.String())
			}
		})
	}
}

// TestFallbackAllowance: a fail_mode fallback quota's admissions that no
// grant covers are charged to the region's allowance of their window (by
// the true clock), doubled in a window a fault of the region's store
// touches; only what exceeds it is spent_without_lease, and the bound
// check counts them like any admission.
func TestFallbackAllowance(t *testing.T) {
	cedar := Quota{Name: "cedar", Limit: 100, WindowMs: 1000, Bound: 30, FallbackPerRegion: 10}
	closed := cedar
	closed.FallbackPerRegion, closed.Bound = 0, 0
	q := func(e history.Event) history.Event { e.Quota = "cedar"; return e }
	anon := func(region string, n, at int64) history.Event {
		return history.Event{Kind: history.KindAdmit, Region: region, Quota: "cedar", Tokens: n, At: at}
	}
	base := []history.Event{
		q(acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1")), // expires at 10.9 s
		q(read(10, 11*sec, 11*sec+ms, 40, 60, 0, history.LedgerGrant{GrantID: "g1", Region: "eu", Tokens: 60})),
		anon("eu", 60, 10*sec+500*ms), // the grant, all of it
	}
	storeFault := history.Span{Scenario: "restart-store", Start: 10*sec + 100*ms, End: 10*sec + 200*ms, Regions: []string{"eu"}, Store: true}
	tests := []struct {
		name     string
		quota    Quota
		events   []history.Event
		spans    []history.Span
		unleased int64 // tokens
		fallback map[int64]int64
	}{
		{name: "within the allowance, after the grant expired", quota: cedar, events: []history.Event{anon("eu", 10, 10*sec+950*ms)},
			fallback: map[int64]int64{10: 10}},
		{name: "beyond the allowance", quota: cedar, events: []history.Event{anon("eu", 7, 10*sec+920*ms), anon("eu", 4, 10*sec+950*ms)},
			unleased: 1, fallback: map[int64]int64{10: 10}},
		{name: "one allowance per window", quota: cedar, events: []history.Event{anon("eu", 10, 10*sec+950*ms), anon("eu", 10, 11*sec+100*ms)},
			fallback: map[int64]int64{10: 10, 11: 10}},
		{name: "two windows' allowances in one window", quota: cedar, events: []history.Event{anon("eu", 10, 10*sec+920*ms), anon("eu", 10, 10*sec+950*ms)},
			unleased: 10, fallback: map[int64]int64{10: 10}},
		{name: "a fault of the region's store doubles it", quota: cedar, events: []history.Event{anon("eu", 20, 10*sec+950*ms)},
			spans: []history.Span{storeFault}, fallback: map[int64]int64{10: 20}},
		{name: "a fault of another region's store does not", quota: cedar, events: []history.Event{anon("eu", 20, 10*sec+950*ms)},
			spans:    []history.Span{{Scenario: "restart-store", Start: 10*sec + 100*ms, End: 10*sec + 200*ms, Regions: []string{"us"}, Store: true}},
			unleased: 10, fallback: map[int64]int64{10: 10}},
		{name: "fail closed: no allowance", quota: closed, events: []history.Event{anon("eu", 1, 10*sec+950*ms)}, unleased: 1},
		{name: "a named admission of an unknown grant is never fallback", quota: cedar,
			events: []history.Event{q(admit("eu", "gX", 1, 10*sec+950*ms, 11*sec))}, unleased: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := run(t, history.History{Events: append(append([]history.Event(nil), base...), tt.events...), Spans: tt.spans}, tt.quota)
			var unleased int64
			for _, v := range r.Violations {
				if v.Check == CheckUnleased {
					var n int64
					fmt.Sscanf(v.Detail, "%d", &n)
					unleased += n
				}
			}
			if unleased != tt.unleased || r.Count(CheckUnleased) > 0 != (tt.unleased > 0) {
				t.Fatalf("unleased tokens %d, want %d: %v", unleased, tt.unleased, r.Violations)
			}
			got := map[int64]int64{}
			for _, w := range r.Windows["cedar"] {
				if rw := w.Regions["eu"]; rw != nil && rw.Fallback > 0 {
					got[w.Index] = rw.Fallback
					if w.Fallback != rw.Fallback {
						t.Errorf("window %d: fallback %d, region eu %d", w.Index, w.Fallback, rw.Fallback)
					}
				}
			}
			if fmt.Sprint(got) != fmt.Sprint(tt.fallback) && !(len(got) == 0 && len(tt.fallback) == 0) {
				t.Fatalf("fallback by window %v, want %v", got, tt.fallback)
			}
		})
	}

	// The bound: G 100 + 3 regions x 10. us spends 40 of the pool, eu 60
	// and 10 of its allowance: 110 admitted, within 130; a claim that
	// leaves the allowance out is broken.
	h := history.History{Events: []history.Event{
		q(acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_900, "g1")),
		q(acquire("us", "r2", 40, 40, 10, 10*sec, 10*sec+60*ms, 10_900, "g2")),
		q(read(10, 11*sec, 11*sec+ms, 0, 100, 0, history.LedgerGrant{GrantID: "g1", Region: "eu", Tokens: 60}, history.LedgerGrant{GrantID: "g2", Region: "us", Tokens: 40})),
		anon("eu", 60, 10*sec+500*ms),
		anon("us", 40, 10*sec+600*ms),
		anon("eu", 10, 10*sec+950*ms),
	}}
	if r := run(t, h, cedar); !r.OK() {
		t.Fatalf("admitted within G + bound: %v", r.Violations)
	}
	claim := cedar
	claim.Bound = 0
	if r := run(t, h, claim); r.Count(CheckBound) != 1 || r.Count(CheckUnleased) != 0 {
		t.Fatalf("a bound without the fallback term: bound violations %d (want 1), unleased %d (want 0): %v",
			r.Count(CheckBound), r.Count(CheckUnleased), r.Violations)
	}

	// MeasureFallback attributes the fallback admissions to the cut-off
	// that touches their window.
	cut := history.Span{Scenario: "partition-region", Start: 10*sec + 500*ms, End: 10*sec + 800*ms, Regions: []string{"eu"}, CutOff: true}
	h.Spans = []history.Span{cut}
	r := run(t, h, cedar)
	if f := MeasureFallback(h, r, cedar, 500*time.Millisecond); f.Tokens != 10 || f.RegionWindows != 1 || f.CutOff != 1 || f.CutOffSpans != 1 || f.Elsewhere != 0 {
		t.Fatalf("MeasureFallback = %+v", f)
	}
	h.Spans = nil
	r = run(t, h, cedar)
	if f := MeasureFallback(h, r, cedar, 500*time.Millisecond); f.CutOffSpans != 0 || f.Elsewhere != 1 || f.Calm != 1 {
		t.Fatalf("MeasureFallback with no fault = %+v", f)
	}
	cut.Regions = []string{"us"}
	h.Spans = []history.Span{cut}
	r = run(t, h, cedar)
	if f := MeasureFallback(h, r, cedar, 500*time.Millisecond); f.CutOff != 0 || f.Elsewhere != 1 || f.Calm != 0 {
		t.Fatalf("MeasureFallback with another region cut off = %+v", f)
	}
}
