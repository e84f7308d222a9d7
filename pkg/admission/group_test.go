package admission

import (
	"slices"
	"testing"
)

// TestGroupItems: items are grouped by hash tag in evaluation order, a
// gateway-local chunk is a group of its own, every item lands in exactly
// one group, and more items than the stack buffers hold work the same.
func TestGroupItems(t *testing.T) {
	local, store := &spec{local: true}, &spec{}
	mk := func(tags ...string) []item {
		items := make([]item, len(tags))
		for i, tag := range tags {
			items[i] = item{sp: store, tag: tag}
			if tag == "local" {
				items[i] = item{sp: local}
			}
		}
		return items
	}
	type want struct {
		tag   string
		local bool
		idx   []int
	}
	for _, tc := range []struct {
		name string
		tags []string
		want []want
	}{
		{"one", []string{"t:a"}, []want{{"t:a", false, []int{0}}}},
		{"one local", []string{"local"}, []want{{"", true, []int{0}}}},
		{"one tag", []string{"t:a", "t:a", "t:a"}, []want{{"t:a", false, []int{0, 1, 2}}}},
		{"local first", []string{"local", "t:a", "t:a"}, []want{{"", true, []int{0}}, {"t:a", false, []int{1, 2}}}},
		{"interleaved", []string{"g:x", "t:a", "g:x", "local", "t:a", "local"},
			[]want{{"g:x", false, []int{0, 2}}, {"t:a", false, []int{1, 4}}, {"", true, []int{3}}, {"", true, []int{5}}}},
		{"more than 8", []string{"t:a", "t:b", "t:a", "t:b", "t:a", "t:b", "t:a", "t:b", "t:a", "local", "t:c"},
			[]want{{"t:a", false, []int{0, 2, 4, 6, 8}}, {"t:b", false, []int{1, 3, 5, 7}}, {"", true, []int{9}}, {"t:c", false, []int{10}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var buf [2]group
			gs := groupItems(buf[:0], mk(tc.tags...))
			if len(gs) != len(tc.want) {
				t.Fatalf("%d groups, want %d: %+v", len(gs), len(tc.want), gs)
			}
			for i, w := range tc.want {
				g := gs[i]
				if g.tag != w.tag || g.local != w.local || !slices.Equal(g.idx, w.idx) {
					t.Errorf("group %d: tag %q local %v idx %v, want %q %v %v", i, g.tag, g.local, g.idx, w.tag, w.local, w.idx)
				}
			}
		})
	}
}
