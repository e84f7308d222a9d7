package history

import "testing"

// TestRecorderKeepsOrderAcrossBlocks: events recorded one by one and in
// batches larger than a block come back whole and in recording order, and
// a snapshot does not change when more is recorded after it.
func TestRecorderKeepsOrderAcrossBlocks(t *testing.T) {
	var r Recorder
	next := int64(0)
	batch := func(n int) []Event {
		evs := make([]Event, n)
		for i := range evs {
			evs[i].At = next
			next++
		}
		return evs
	}
	r.Record(batch(1)...)
	r.Record(batch(eventBlock - 2)...)
	r.Record(batch(3)...) // crosses the first block's end
	r.Record(batch(2*eventBlock + 5)...)
	for range 100 {
		r.Record(batch(1)...)
	}
	r.Record() // nothing
	h := r.Snapshot()
	if int64(len(h.Events)) != next {
		t.Fatalf("%d events back, recorded %d", len(h.Events), next)
	}
	for i, e := range h.Events {
		if e.At != int64(i) {
			t.Fatalf("event %d is the one recorded as %d", i, e.At)
		}
	}
	for i, b := range r.events {
		if cap(b) != eventBlock || (i < len(r.events)-1 && len(b) != eventBlock) {
			t.Fatalf("block %d: len %d cap %d, want full blocks of %d before the last", i, len(b), cap(b), eventBlock)
		}
	}
	r.Record(batch(7)...)
	if len(h.Events) != int(next)-7 || len(r.Snapshot().Events) != int(next) {
		t.Fatalf("snapshot of %d events changed, or the new one has %d of %d", len(h.Events), len(r.Snapshot().Events), next)
	}
}
