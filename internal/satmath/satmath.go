// Package satmath is integer arithmetic that saturates instead of
// overflowing, for token and time amounts computed from configuration that
// may be extreme (a day's window in nanoseconds times a rate).
package satmath

import (
	"math"
	"math/bits"
)

// MulDivCeil returns ceil(a*b/d) for non-negative a, b and positive d,
// computed in 128 bits and saturating at MaxInt64; 0 for other arguments.
func MulDivCeil(a, b, d int64) int64 {
	if a <= 0 || b <= 0 || d <= 0 {
		return 0
	}
	hi, lo := bits.Mul64(uint64(a), uint64(b))
	if hi >= uint64(d) {
		return math.MaxInt64
	}
	q, r := bits.Div64(hi, lo, uint64(d))
	if r != 0 {
		q++
	}
	if q > math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(q)
}
