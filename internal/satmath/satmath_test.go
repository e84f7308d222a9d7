package satmath

import (
	"math"
	"testing"
)

func TestMulDivCeil(t *testing.T) {
	for _, tt := range []struct{ a, b, d, want int64 }{
		{7, 3, 2, 11},                        // 21/2 rounded up
		{6, 3, 2, 9},                         // exact
		{0, 5, 3, 0},                         // zero
		{-1, 5, 3, 0},                        // negative: 0
		{5, 5, 0, 0},                         // no divisor: 0
		{1 << 62, 1 << 62, 1, math.MaxInt64}, // saturates
		{1 << 62, 1 << 62, 1 << 62, 1 << 62}, // the 128-bit product divides back
		{math.MaxInt64, 2, 2, math.MaxInt64}, // exactly MaxInt64
	} {
		if got := MulDivCeil(tt.a, tt.b, tt.d); got != tt.want {
			t.Errorf("MulDivCeil(%d, %d, %d) = %d, want %d", tt.a, tt.b, tt.d, got, tt.want)
		}
	}
}
