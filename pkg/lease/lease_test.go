package lease

import (
	"errors"
	"math"
	"testing"
	"time"

	"pgregory.net/rapid"
)

func TestWindowIndex(t *testing.T) {
	tests := []struct {
		name     string
		now, w   int64
		want     int64
		wantFrom int64
		wantTo   int64
	}{
		{name: "epoch", now: 0, w: 60_000, want: 0, wantFrom: 0, wantTo: 60_000},
		{name: "inside first", now: 59_999, w: 60_000, want: 0, wantFrom: 0, wantTo: 60_000},
		{name: "boundary opens next", now: 60_000, w: 60_000, want: 1, wantFrom: 60_000, wantTo: 120_000},
		{name: "negative floors down", now: -1, w: 60_000, want: -1, wantFrom: -60_000, wantTo: 0},
		{name: "negative boundary", now: -60_000, w: 60_000, want: -1, wantFrom: -60_000, wantTo: 0},
		{name: "negative past boundary", now: -60_001, w: 60_000, want: -2, wantFrom: -120_000, wantTo: -60_000},
		{name: "realistic", now: 1_700_000_123_456, w: 60_000, want: 28_333_335, wantFrom: 1_700_000_100_000, wantTo: 1_700_000_160_000},
		{name: "zero window is safe", now: 12345, w: 0, want: 0, wantFrom: 0, wantTo: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := WindowIndex(tt.now, tt.w)
			if got != tt.want {
				t.Fatalf("WindowIndex(%d, %d) = %d, want %d", tt.now, tt.w, got, tt.want)
			}
			if s, e := WindowStart(got, tt.w), WindowEnd(got, tt.w); s != tt.wantFrom || e != tt.wantTo {
				t.Fatalf("window [%d, %d), want [%d, %d)", s, e, tt.wantFrom, tt.wantTo)
			}
		})
	}
}

func TestWindowIndexContainsNow(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		w := rapid.Int64Range(1, 400*24*3600*1000).Draw(t, "w")
		now := rapid.Int64Range(-1<<50, 1<<50).Draw(t, "now")
		i := WindowIndex(now, w)
		if s, e := WindowStart(i, w), WindowEnd(i, w); now < s || now >= e {
			t.Fatalf("now %d outside window %d = [%d, %d)", now, i, s, e)
		}
	})
}

func TestClampExpiry(t *testing.T) {
	// The reference design's example: 1,000/min pool, 15 s TTL, clamped to
	// the end of the minute.
	const end = 60_000
	tests := []struct {
		name  string
		now   int64
		ttl   int64
		clamp bool
		want  int64
	}{
		{name: "early in window keeps ttl", now: 10_000, ttl: 15_000, clamp: true, want: 25_000},
		{name: "exactly reaches end", now: 45_000, ttl: 15_000, clamp: true, want: 60_000},
		{name: "near end is clamped", now: 50_000, ttl: 15_000, clamp: true, want: 60_000},
		{name: "no clamp carries over", now: 50_000, ttl: 15_000, clamp: false, want: 65_000},
		{name: "overflow saturates", now: math.MaxInt64 - 1, ttl: 15_000, clamp: false, want: math.MaxInt64},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := ClampExpiry(tt.now, tt.ttl, end, tt.clamp); got != tt.want {
				t.Fatalf("ClampExpiry(%d, %d, %d, %v) = %d, want %d", tt.now, tt.ttl, end, tt.clamp, got, tt.want)
			}
		})
	}
}

func TestDeadline(t *testing.T) {
	sent := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	tests := []struct {
		name      string
		expires   int64
		leaderNow int64
		margin    time.Duration
		want      time.Time
	}{
		{name: "full ttl", expires: 15_000, leaderNow: 0, want: sent.Add(15 * time.Second)},
		{name: "margin subtracted", expires: 15_000, leaderNow: 0, margin: 200 * time.Millisecond, want: sent.Add(14800 * time.Millisecond)},
		// The leader's clock is a year ahead: only the difference matters.
		{name: "leader clock offset irrelevant", expires: 31_536_000_000 + 5_000, leaderNow: 31_536_000_000, want: sent.Add(5 * time.Second)},
		{name: "clamped near window end", expires: 60_000, leaderNow: 58_500, margin: 100 * time.Millisecond, want: sent.Add(1400 * time.Millisecond)},
		{name: "already expired", expires: 1_000, leaderNow: 2_000, want: sent.Add(-time.Second)},
		{name: "negative margin ignored", expires: 1_000, leaderNow: 0, margin: -time.Hour, want: sent.Add(time.Second)},
		{name: "huge span saturates", expires: math.MaxInt64, leaderNow: math.MinInt64, want: sent.Add(math.MaxInt64)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// One millisecond comes off every deadline: leaderNow is truncated.
			want := tt.want.Add(-time.Millisecond)
			if got := Deadline(sent, tt.expires, tt.leaderNow, tt.margin); !got.Equal(want) {
				t.Fatalf("Deadline = %s, want %s", got, want)
			}
		})
	}
	// A span that saturates on the negative side stays before sentAt: the
	// millisecond taken off used to wrap it round to centuries ahead.
	if got := Deadline(sent, math.MinInt64, math.MaxInt64, 0); !got.Before(sent) {
		t.Fatalf("hugely negative span: Deadline = %s, want before %s", got, sent)
	}
}

// TestDeadlineNeverAfterExpiry models real time explicitly: the region and
// the leader read clocks with arbitrary offsets from real time; the request
// takes any time to reach the leader and the reply any time to come back.
// With zero drift, the deadline converted to real time is never later than
// the real instant at which the allocator's clock reaches the expiry.
func TestDeadlineNeverAfterExpiry(t *testing.T) {
	base := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	rapid.Check(t, func(t *rapid.T) {
		const day = int64(24 * time.Hour / time.Millisecond)
		regionOffset := time.Duration(rapid.Int64Range(-365*day, 365*day).Draw(t, "regionOffsetMs")) * time.Millisecond
		leaderOffsetMs := rapid.Int64Range(-365*day, 365*day).Draw(t, "leaderOffsetMs")
		sendLatency := rapid.Int64Range(0, 60_000).Draw(t, "sendLatencyMs")
		ttlMs := rapid.Int64Range(-1_000, 3_600_000).Draw(t, "remainingMs")
		margin := time.Duration(rapid.Int64Range(0, 5_000).Draw(t, "marginMs")) * time.Millisecond

		// Real time, in ms after base.
		realSend := rapid.Int64Range(0, day).Draw(t, "realSendMs")
		realStamp := realSend + sendLatency // causality: stamped after sending
		leaderNow := realStamp + leaderOffsetMs
		expires := leaderNow + ttlMs
		realExpiry := realStamp + ttlMs // zero drift: the leader's clock advances with real time

		sentAt := base.Add(time.Duration(realSend)*time.Millisecond + regionOffset)
		deadline := Deadline(sentAt, expires, leaderNow, margin)
		realDeadline := deadline.Add(-regionOffset)

		limit := base.Add(time.Duration(realExpiry)*time.Millisecond - margin)
		if realDeadline.After(limit) {
			t.Fatalf("real deadline %s after allocator expiry-margin %s", realDeadline, limit)
		}
	})
}

// TestDeadlineWithDrift checks the margin rule stated in the Deadline doc:
// a region clock that runs slow by rate rho measures the remaining TTL R as
// R/(1-rho) of real time; margin >= rho*R keeps it inside the expiry.
func TestDeadlineWithDrift(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		rho := rapid.Float64Range(0, 1e-3).Draw(t, "rho")
		remaining := time.Duration(rapid.Int64Range(0, 3_600_000).Draw(t, "remainingMs")) * time.Millisecond
		sendLatency := time.Duration(rapid.Int64Range(0, 10_000).Draw(t, "sendLatencyMs")) * time.Millisecond
		margin := time.Duration(math.Ceil(rho * float64(remaining)))

		var zero time.Time
		regionElapsed := Deadline(zero, remaining.Milliseconds(), 0, margin).Sub(zero)
		realElapsed := time.Duration(float64(regionElapsed) / (1 - rho))
		// The allocator expires sendLatency+remaining after the send, in real time.
		if realElapsed > sendLatency+remaining+time.Nanosecond { // 1 ns float rounding
			t.Fatalf("drift %.6f: real deadline %s after expiry %s", rho, realElapsed, sendLatency+remaining)
		}
	})
}

func TestRedisTTL(t *testing.T) {
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	tests := []struct {
		name     string
		deadline time.Time
		delay    time.Duration
		want     time.Duration
	}{
		{name: "subtracts store delay", deadline: now.Add(10 * time.Second), delay: 3 * time.Millisecond, want: 9997 * time.Millisecond},
		{name: "truncates to ms", deadline: now.Add(10*time.Second + 900*time.Microsecond), delay: 0, want: 10 * time.Second},
		{name: "sub-millisecond remains is zero", deadline: now.Add(1500 * time.Microsecond), delay: time.Millisecond, want: 0},
		{name: "past deadline is zero", deadline: now.Add(-time.Second), delay: 0, want: 0},
		{name: "delay exceeds remaining", deadline: now.Add(5 * time.Millisecond), delay: 10 * time.Millisecond, want: 0},
		{name: "negative delay ignored", deadline: now.Add(time.Second), delay: -time.Hour, want: time.Second},
		// deadline.Sub(now) saturates at MinInt64; subtracting the delay
		// from it must not wrap around to a TTL of centuries.
		{name: "zero deadline with a delay", deadline: time.Time{}, delay: time.Millisecond, want: 0},
		{name: "far past deadline with a delay", deadline: now.AddDate(-300, 0, 0), delay: time.Nanosecond, want: 0},
		{name: "far future deadline saturates", deadline: now.AddDate(300, 0, 0), delay: time.Millisecond, want: time.Duration(math.MaxInt64 - int64(time.Millisecond)).Truncate(time.Millisecond)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := RedisTTL(tt.deadline, now, tt.delay)
			if got != tt.want {
				t.Fatalf("RedisTTL = %s, want %s", got, tt.want)
			}
			if got > 0 && now.Add(tt.delay).Add(got).After(tt.deadline) {
				t.Fatalf("store expiry %s after deadline %s", now.Add(tt.delay).Add(got), tt.deadline)
			}
		})
	}
}

func TestSizing(t *testing.T) {
	s := Sizing{MinChunk: 10, MaxChunk: 500, Lead: 2 * time.Second, RTT: 100 * time.Millisecond}
	tests := []struct {
		name      string
		rate      float64
		wantChunk int64
		wantLow   int64
	}{
		{name: "zero demand gets min", rate: 0, wantChunk: 10, wantLow: 0},
		{name: "negative demand gets min", rate: -5, wantChunk: 10, wantLow: 0},
		{name: "NaN demand gets min", rate: math.NaN(), wantChunk: 10, wantLow: 0},
		{name: "EU 900/min", rate: 15, wantChunk: 32, wantLow: 30},        // chunk ceil(15*2.1)=ceil(31.5); low 15*2
		{name: "US 100/min", rate: 100.0 / 60, wantChunk: 10, wantLow: 4}, // chunk ceil(3.5)=4 < min; low ceil(3.33)
		{name: "exact product not rounded up", rate: 100, wantChunk: 210, wantLow: 200},
		{name: "capped at max", rate: 1_000, wantChunk: 500, wantLow: 2_000},
		{name: "infinite demand capped", rate: math.Inf(1), wantChunk: 500, wantLow: math.MaxInt64},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := s.Chunk(tt.rate); got != tt.wantChunk {
				t.Errorf("Chunk(%v) = %d, want %d", tt.rate, got, tt.wantChunk)
			}
			if got := s.LowWatermark(tt.rate); got != tt.wantLow {
				t.Errorf("LowWatermark(%v) = %d, want %d", tt.rate, got, tt.wantLow)
			}
		})
	}
}

// TestChunkLeadPlusRTTSaturates: a Sizing that passes Validate with the
// largest lead still sizes chunks at MaxChunk under demand; Lead + RTT must
// not wrap around to a negative duration (which would ask for MinChunk).
func TestChunkLeadPlusRTTSaturates(t *testing.T) {
	tests := []struct {
		name string
		give Sizing
		rate float64
		want int64
	}{
		{name: "max lead plus rtt", give: Sizing{MinChunk: 1, MaxChunk: 500, Lead: math.MaxInt64, RTT: time.Millisecond}, rate: 100, want: 500},
		{name: "lead plus max rtt", give: Sizing{MinChunk: 1, MaxChunk: 500, Lead: time.Second, RTT: math.MaxInt64}, rate: 100, want: 500},
		{name: "zero demand still min", give: Sizing{MinChunk: 7, MaxChunk: 500, Lead: math.MaxInt64, RTT: math.MaxInt64}, rate: 0, want: 7},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := tt.give.Validate(); err != nil {
				t.Fatalf("Validate() = %v", err)
			}
			if got := tt.give.Chunk(tt.rate); got != tt.want {
				t.Fatalf("Chunk(%v) = %d, want %d", tt.rate, got, tt.want)
			}
		})
	}
}

func TestSizingValidate(t *testing.T) {
	tests := []struct {
		name string
		give Sizing
		ok   bool
	}{
		{name: "valid", give: Sizing{MinChunk: 1, MaxChunk: 1, Lead: time.Second}, ok: true},
		{name: "zero min", give: Sizing{MinChunk: 0, MaxChunk: 10}},
		{name: "max below min", give: Sizing{MinChunk: 10, MaxChunk: 5}},
		{name: "negative lead", give: Sizing{MinChunk: 1, MaxChunk: 5, Lead: -1}},
		{name: "negative rtt", give: Sizing{MinChunk: 1, MaxChunk: 5, RTT: -1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.give.Validate()
			if tt.ok != (err == nil) {
				t.Fatalf("Validate() = %v, want ok=%v", err, tt.ok)
			}
			if err != nil && !errors.Is(err, ErrInvalidSizing) {
				t.Fatalf("Validate() = %v, not ErrInvalidSizing", err)
			}
		})
	}
}

func TestChunkWithinBounds(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		lo := rapid.Int64Range(1, 1_000).Draw(t, "min")
		s := Sizing{
			MinChunk: lo,
			MaxChunk: rapid.Int64Range(lo, 1_000_000).Draw(t, "max"),
			Lead:     time.Duration(rapid.Int64Range(0, int64(time.Minute)).Draw(t, "lead")),
			RTT:      time.Duration(rapid.Int64Range(0, int64(time.Second)).Draw(t, "rtt")),
		}
		rate := rapid.Float64Range(0, 1e6).Draw(t, "rate")
		c := s.Chunk(rate)
		if c < s.MinChunk || c > s.MaxChunk {
			t.Fatalf("Chunk(%v) = %d outside [%d, %d]", rate, c, s.MinChunk, s.MaxChunk)
		}
		// Unless capped, a chunk lasts at least lead+RTT at the given rate.
		if c < s.MaxChunk && float64(c) < rate*(s.Lead+s.RTT).Seconds()-1e-9 {
			t.Fatalf("Chunk(%v) = %d does not cover lead+rtt", rate, c)
		}
	})
}

// TestNotBeforeNeverBeforeStart: whatever the offset between the clocks and
// the delays on the way out and back, a pre-grant's local not-before is at
// or after the instant the leader's clock reaches the window's start.
func TestNotBeforeNeverBeforeStart(t *testing.T) {
	base := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	rapid.Check(t, func(t *rapid.T) {
		offset := time.Duration(rapid.Int64Range(-3_600_000, 3_600_000).Draw(t, "offset ms")) * time.Millisecond // leader = region + offset
		sent := base.Add(time.Duration(rapid.Int64Range(0, 1_000_000).Draw(t, "sent us")) * time.Microsecond)
		out := time.Duration(rapid.Int64Range(0, 500_000).Draw(t, "out us")) * time.Microsecond
		back := time.Duration(rapid.Int64Range(0, 500_000).Draw(t, "back us")) * time.Microsecond
		lead := rapid.Int64Range(0, 60_000).Draw(t, "lead ms")
		stamp := sent.Add(out)                          // real time the leader stamped
		leaderNow := stamp.Add(offset).UnixMilli()      // truncated, as the FSM stores it
		start := leaderNow + lead                       // the window start, leader's clock
		startReal := time.UnixMilli(start).Add(-offset) // when the leader's clock reads start
		received := stamp.Add(back)
		if nb := NotBefore(received, start, leaderNow); nb.Before(startReal) {
			t.Fatalf("not-before %s is %s before the start", nb, startReal.Sub(nb))
		}
	})
	if got := NotBefore(time.UnixMilli(1000), 5000, 4000); !got.Equal(time.UnixMilli(2001).Add(200 * time.Microsecond)) {
		t.Fatalf("NotBefore = %v, want 1 s after receipt + 200 ppm of it + 1 ms", got)
	}
}

// TestNotBeforeCoversDrift: a region whose clock runs up to 200 ppm fast
// against the leader's (the drift the bound assumes by default) measures a
// pre-grant's lead, up to a minute, as that much longer: its not-before,
// read back in real time, is still at or after the instant the leader's
// clock reaches the window's start. With 1 ms for drift alone, a 30 s lead
// opened the window 5 ms early.
func TestNotBeforeCoversDrift(t *testing.T) {
	base := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	check := func(t interface {
		Fatalf(string, ...any)
	}, ppm int64, out, back time.Duration, leadMs int64) {
		// The leader's clock is true time; the region's runs ppm fast:
		// local(r) = base + (r - base) x (1e6 + ppm) / 1e6.
		local := func(r time.Time) time.Time {
			return base.Add(time.Duration(int64(r.Sub(base)) * (1_000_000 + ppm) / 1_000_000))
		}
		real := func(l time.Time) time.Time {
			return base.Add(time.Duration(float64(l.Sub(base)) * 1e6 / float64(1_000_000+ppm)))
		}
		stamp := base.Add(time.Second).Add(out).Truncate(time.Millisecond)
		leaderNow := stamp.UnixMilli()
		start := leaderNow + leadMs
		received := local(stamp.Add(back))
		if nb := real(NotBefore(received, start, leaderNow)); nb.Before(time.UnixMilli(start)) {
			t.Fatalf("%d ppm, lead %d ms: the pre-grant opens %s before its window", ppm, leadMs, time.UnixMilli(start).Sub(nb))
		}
	}
	check(t, DefaultMaxDriftPPM, 0, 0, 30_000)
	rapid.Check(t, func(t *rapid.T) {
		check(t, rapid.Int64Range(0, DefaultMaxDriftPPM).Draw(t, "ppm"),
			time.Duration(rapid.Int64Range(0, 500_000).Draw(t, "out us"))*time.Microsecond,
			time.Duration(rapid.Int64Range(0, 500_000).Draw(t, "back us"))*time.Microsecond,
			rapid.Int64Range(0, 60_000).Draw(t, "lead ms"))
	})
	// 30 s ahead at 200 ppm: 6 ms for the drift, 1 ms for the stamp.
	if got := NotBefore(time.UnixMilli(0), 30_000, 0); !got.Equal(time.UnixMilli(30_007)) {
		t.Fatalf("NotBefore 30 s ahead = %v, want 30.007 s", got)
	}
}

func TestNotBeforeDrift(t *testing.T) {
	r := time.UnixMilli(1000)
	for _, c := range []struct {
		name               string
		nb, leaderNow, ppm int64
		want               time.Time
	}{
		{"no drift", 31_000, 1000, 0, time.UnixMilli(31_001)},
		{"negative drift counts as zero", 31_000, 1000, -5, time.UnixMilli(31_001)},
		{"500 ppm over 30 s", 31_000, 1000, 500, time.UnixMilli(31_016)},
		{"rounded up to the nanosecond", 1001, 1000, 1, r.Add(time.Millisecond + time.Nanosecond + time.Millisecond)},
		{"a start already passed adds no drift", 900, 1000, 200, time.UnixMilli(901)},
		{"saturates", math.MaxInt64, 0, 999_999, r.Add(math.MaxInt64)},
	} {
		if got := NotBeforeDrift(r, c.nb, c.leaderNow, c.ppm); !got.Equal(c.want) {
			t.Errorf("%s: NotBeforeDrift = %v, want %v", c.name, got, c.want)
		}
	}
}

func TestLeadWithin(t *testing.T) {
	ms := time.Millisecond
	cases := []struct {
		name                  string
		lead, life, tick, rtt time.Duration
		want                  time.Duration
	}{
		{"long-lived grants keep the lead", time.Second, 14 * time.Second, 100 * ms, 5 * ms, time.Second},
		{"exactly two leads fit", time.Second, 2100 * ms, 100 * ms, 0, time.Second},
		{"a 1.5 s TTL halves what is left", time.Second, 1200 * ms, 100 * ms, 0, 550 * ms},
		{"the round trip counts", time.Second, 1200 * ms, 100 * ms, 100 * ms, 500 * ms},
		{"never below a tick and a round trip", time.Second, 200 * ms, 100 * ms, 20 * ms, 120 * ms},
		{"nor above the configured lead", 50 * ms, 100 * ms, 100 * ms, 20 * ms, 50 * ms},
		{"a life already gone", time.Second, -time.Second, 100 * ms, 0, 100 * ms},
		{"no lead", 0, time.Second, 100 * ms, 0, 0},
	}
	for _, c := range cases {
		if got := LeadWithin(c.lead, c.life, c.tick, c.rtt); got != c.want {
			t.Errorf("%s: LeadWithin(%s, %s, %s, %s) = %s, want %s", c.name, c.lead, c.life, c.tick, c.rtt, got, c.want)
		}
	}
}

// TestLeadWithinStockFits: with the lead LeadWithin returns, the most a
// region holds (the watermark plus one chunk, two leads and the round trip
// of demand) is spent, a tick late at worst, before the newest chunk's life
// ends; unless the floor applied, and the lead is never above the one
// configured.
func TestLeadWithinStockFits(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		d := func(label string, hi time.Duration) time.Duration {
			return time.Duration(rapid.Int64Range(0, int64(hi)).Draw(t, label))
		}
		lead, life, tick, rtt := d("lead", time.Minute), d("life", time.Hour), d("tick", time.Second), d("rtt", time.Second)
		got := LeadWithin(lead, life, tick, rtt)
		if got > lead || got < 0 {
			t.Fatalf("LeadWithin = %s outside [0, %s]", got, lead)
		}
		floored := got == min(lead, tick+rtt)
		if !floored && 2*got+rtt+tick > life {
			t.Fatalf("lead %s: a stock of two leads and the round trip (%s) plus a tick outlives a life of %s", got, 2*got+rtt, life)
		}
	})
}

// TestPregrantChunk: a pre-grant is a chunk plus the demand of the gap
// before the window's start (at 40/s, a 300 ms chunk and a 250 ms gap: 12 +
// 10), clamped to MaxChunk; no demand asks for MinChunk.
func TestPregrantChunk(t *testing.T) {
	s := Sizing{MinChunk: 1, MaxChunk: 100, Lead: 200 * time.Millisecond, RTT: 100 * time.Millisecond}
	for _, tt := range []struct {
		rate float64
		gap  time.Duration
		want int64
	}{
		{40, 250 * time.Millisecond, 22},
		{40, 0, 12},
		{400, 250 * time.Millisecond, 100},
		{0, 250 * time.Millisecond, 1},
		{math.NaN(), time.Second, 1},
	} {
		if got := s.PregrantChunk(tt.rate, tt.gap); got != tt.want {
			t.Errorf("PregrantChunk(%v/s, gap %s) = %d, want %d", tt.rate, tt.gap, got, tt.want)
		}
	}
}
