package admission

import (
	"context"
	"encoding/binary"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
)

// packDecision encodes a decision as decision_reply in script.lua does when
// a number is beyond 32 bits: 8-byte doubles.
func packDecision(id string, nums ...float64) string {
	b := append([]byte{8}, 0, 0)
	binary.LittleEndian.PutUint16(b[1:], uint16(len(id)))
	b = append(b, id...)
	for _, f := range nums {
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(f))
	}
	return string(b)
}

// packDecision32 encodes a decision as decision_reply does when every
// number fits in 32 bits.
func packDecision32(id string, nums ...int32) string {
	b := append([]byte{4}, 0, 0)
	binary.LittleEndian.PutUint16(b[1:], uint16(len(id)))
	b = append(b, id...)
	for _, n := range nums {
		b = binary.LittleEndian.AppendUint32(b, uint32(n))
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

	// 32-bit numbers, and no id: the decision is the caller's own.
	o.id = "d-43"
	if err := parseDecision(packDecision32("", 0, 1, 1, -1, 2147483647, -2147483648), &o); err != nil {
		t.Fatal(err)
	}
	if want := []int64{0, 1, 1, -1, 2147483647, -2147483648}; o.outID != "d-43" || !slices.Equal(o.out, want) {
		t.Fatalf("parsed id %q numbers %v; want d-43 (the op's own) and %v", o.outID, o.out, want)
	}

	bad := map[string]string{
		"empty":                    "",
		"two bytes":                "\x08\x00",
		"unknown width":            "\x02\x00\x00",
		"id longer than reply":     packDecision("abc")[:5],
		"numbers cut short":        packDecision("id", 1, 2)[:16],
		"32-bit numbers cut short": packDecision32("", 1, 2)[:9],
		"a fraction":               packDecision("id", 0, 0.5),
		"not a number":             packDecision("id", math.NaN()),
		"an infinity":              packDecision("id", math.Inf(-1)),
		"beyond exact integers":    packDecision("id", 1<<60),
		"id length beyond a byte":  "\x08\xff\xff" + strings.Repeat("x", 10),
	}
	for name, s := range bad {
		if err := parseDecision(s, &op{}); err == nil {
			t.Errorf("%s: parsed without an error", name)
		}
		if err := parseDecision([]byte(s), &op{}); err == nil {
			t.Errorf("%s, from a buffer: parsed without an error", name)
		}
	}

	// From a buffer (a reply read in place, see RedisStore.zeroCopy): the
	// same decision, with the id copied out, since the buffer is reused.
	buf := []byte(packDecision("d-42", 0, 1, 0, 17, 250, -1))
	var ob op
	if err := parseDecision(buf, &ob); err != nil {
		t.Fatal(err)
	}
	clear(buf)
	if want := []int64{0, 1, 0, 17, 250, -1}; ob.outID != "d-42" || !slices.Equal(ob.out, want) {
		t.Fatalf("from a buffer overwritten since: id %q numbers %v; want d-42 and %v", ob.outID, ob.out, want)
	}
	own := []byte(packDecision32("", 0, 1, 1, -1, 2147483647, -2147483648))
	if n := testing.AllocsPerRun(100, func() { _ = parseDecision(own, &ob) }); n != 0 {
		t.Errorf("parseDecision of a buffer without an id allocates %v times, want 0", n)
	}
}

// FuzzParseDecision: a reply parses the same from a string and from a
// buffer, and never panics.
func FuzzParseDecision(f *testing.F) {
	f.Add(packDecision("d-42", 0, 1, 0, 17, 250, -1))
	f.Add(packDecision32("", 0, 1, 1, -1, 2147483647, -2147483648))
	f.Add("\x08\xff\xff")
	f.Fuzz(func(t *testing.T, s string) {
		var a, b op
		ea, eb := parseDecision(s, &a), parseDecision([]byte(s), &b)
		if (ea == nil) != (eb == nil) || a.outID != b.outID || !slices.Equal(a.out, b.out) {
			t.Fatalf("%q: from a string %v %q %v, from a buffer %v %q %v", s, ea, a.outID, a.out, eb, b.outID, b.out)
		}
	})
}

// TestCommandsReusedOnlyOffCluster: a Cluster client memoizes a command's
// slot in it, so a store on one never reuses commands; other clients do.
func TestCommandsReusedOnlyOffCluster(t *testing.T) {
	cluster := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{"127.0.0.1:1"}})
	defer cluster.Close()
	single := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer single.Close()
	for _, tt := range []struct {
		client redis.UniversalClient
		reuse  bool
	}{{cluster, false}, {single, true}} {
		s, err := NewRedisStore(tt.client, DefaultRedisConfig())
		if err != nil {
			t.Fatal(err)
		}
		args := []any{"evalsha", "sha", 1, "k", "d"}
		c1, r1 := s.command(context.Background(), args)
		if (r1 != nil) != tt.reuse || s.reuse != tt.reuse {
			t.Errorf("%T: reuse %v, want %v", tt.client, s.reuse, tt.reuse)
		}
		if r1 != nil {
			s.evals[len(r1.args)].Put(r1)
			args[3] = "k2"
			// The pool may hand r1 back or not (the race detector drops
			// some of its puts); either way the command carries the new key.
			c2, r2 := s.command(context.Background(), args)
			if got := c2.Args()[3]; got != "k2" || (r2 == r1 && c2 != c1) {
				t.Errorf("command %p after %p: key %v; want k2", c2, c1, got)
			}
		}
		s.Close()
	}
}
