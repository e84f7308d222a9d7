package fsm

import (
	"math"
	"slices"
	"strings"

	"github.com/allot-dev/allot/pkg/lease"
)

// maxNeed caps a region's need so that sums of needs stay exact.
const maxNeed = 1 << 52

// needTokens returns floor(rate x remainingMs / 1000), capped at maxNeed.
// Rounding down reserves less than one token too few per region rather
// than one token too many, which would sit idle at the end of the window.
// The expression has no addition, so no architecture may fuse it into an
// FMA: every replica computes the same bits.
func needTokens(rate float64, remainingMs int64) int64 {
	x := math.Floor(rate * float64(remainingMs) / 1000)
	if !(x < maxNeed) {
		return maxNeed
	}
	if x < 0 {
		return 0
	}
	return int64(x)
}

type claim struct {
	region string
	out    int64 // tokens granted minus released in the window
	want   int64 // out + need for the rest of the window
	share  int64
}

// fairCap returns the most tokens region may be granted now from window w
// of a fair_share quota. Demand reports (the requester's current one
// included) give each region a need for the rest of the window,
// need = floor(demand x (window end - now)). When the pool covers every need
// the cap is the pool. Otherwise the window's capacity (the pool plus every region's
// outstanding tokens) is divided max-min fairly (water-filling) over each
// region's claim, outstanding + need, and the requester may take its share
// minus what it already holds. Counting outstanding tokens is what keeps a
// region that grabbed a large chunk early from shrinking a small region's
// share of what is left. The allocator cannot see how much of a region's
// outstanding tokens is still unspent, so under contention a region's unspent
// tokens are counted both as used and as need: its reserve is too large by
// what it holds, about one chunk. Regions are sorted by name and all the
// arithmetic after need is integer, so the cap is deterministic.
func fairCap(q *quota, w *window, region string, now int64) int64 {
	rem := w.remaining()
	left := lease.WindowEnd(w.index, q.spec.WindowMs) - now

	regions := make([]string, 0, len(q.demand)+len(w.regions))
	for r := range q.demand {
		if _, fresh := q.freshDemand(r, now); fresh {
			regions = append(regions, r)
		}
	}
	for r, l := range w.regions {
		if _, fresh := q.freshDemand(r, now); !fresh && l.granted > l.released {
			regions = append(regions, r)
		}
	}
	slices.Sort(regions)

	claims := make([]claim, len(regions))
	var sumNeed int64
	capacity := rem
	me := -1
	for i, r := range regions {
		c := claim{region: r}
		if l := w.regions[r]; l != nil {
			c.out = l.granted - l.released
		}
		var need int64
		if d, fresh := q.freshDemand(r, now); fresh {
			need = needTokens(d.rate, left)
		}
		sumNeed = satAdd(sumNeed, need)
		capacity = satAdd(capacity, c.out)
		c.want = satAdd(c.out, need)
		claims[i] = c
		if r == region {
			me = i
		}
	}
	if me < 0 || sumNeed <= rem {
		return rem
	}
	waterfill(capacity, claims)
	return max(0, claims[me].share-claims[me].out)
}

// waterfill sets the max-min fair share of capacity for each claim: claims
// are served smallest first; once the fair level (what is left divided by
// the claims left) is below a claim, every claim left gets that level, and
// the indivisible remainder goes one token each to the first regions by
// name. claims must be sorted by region and are left in that order.
func waterfill(capacity int64, claims []claim) {
	order := make([]int, len(claims))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int {
		if d := claims[a].want - claims[b].want; d != 0 {
			if d < 0 {
				return -1
			}
			return 1
		}
		return strings.Compare(claims[a].region, claims[b].region)
	})
	left := capacity
	for k, i := range order {
		n := int64(len(order) - k)
		if claims[i].want <= left/n {
			claims[i].share = claims[i].want
			left -= claims[i].want
			continue
		}
		rest := order[k:]
		slices.Sort(rest) // back to region order for the remainder
		level, extra := left/n, left%n
		for j, idx := range rest {
			claims[idx].share = level
			if int64(j) < extra {
				claims[idx].share++
			}
		}
		return
	}
}
