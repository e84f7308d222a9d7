package admission

import (
	"encoding/binary"
	"math"
	"slices"
	"strings"
	"testing"
)

// packDecision encodes a decision as decision_reply in script.lua does.
func packDecision(id string, nums ...float64) string {
	b := binary.LittleEndian.AppendUint16(nil, uint16(len(id)))
	b = append(b, id...)
	for _, f := range nums {
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(f))
	}
	return string(b)
}

func TestParseDecision(t *testing.T) {
	var o op
	s := packDecision("d-42", 0, 1, 0, 17, 250, -1, 1, 1<<53, 0, 9007)
	if err := parseDecision(s, &o); err != nil {
		t.Fatal(err)
	}
	if want := []int64{0, 1, 0, 17, 250, -1, 1, 1 << 53, 0, 9007}; o.outID != "d-42" || !slices.Equal(o.out, want) {
		t.Fatalf("parsed id %q numbers %v; want d-42 and %v", o.outID, o.out, want)
	}
	// A reused op keeps its slice: a second parse allocates nothing.
	if n := testing.AllocsPerRun(100, func() { _ = parseDecision(s, &o) }); n != 0 {
		t.Errorf("parseDecision into a reused op allocates %v times, want 0", n)
	}

	bad := map[string]string{
		"empty":                   "",
		"one byte":                "\x01",
		"id longer than reply":    packDecision("abc")[:4],
		"numbers cut short":       packDecision("id", 1, 2)[:15],
		"a fraction":              packDecision("id", 0, 0.5),
		"not a number":            packDecision("id", math.NaN()),
		"an infinity":             packDecision("id", math.Inf(-1)),
		"beyond exact integers":   packDecision("id", 1<<60),
		"id length beyond a byte": "\xff\xff" + strings.Repeat("x", 10),
	}
	for name, s := range bad {
		if err := parseDecision(s, &op{}); err == nil {
			t.Errorf("%s: parsed without an error", name)
		}
	}
}
