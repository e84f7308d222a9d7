package fsm

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"testing"
)

// TestPolicyDigests checks that every record, the history's included, carries
// the SHA-256 of its own document, that a restored replica recomputes it,
// and that snapshots do not hold it (the records are those of builds
// without digests, which refuse unknown fields).
func TestPolicyDigests(t *testing.T) {
	h := newHarness(t)
	docs := []string{"first document", "second document"}
	var want []string
	for i, doc := range docs {
		res := h.apply(Command{Type: CmdPublishPolicy, NowUnixMs: t0 + int64(i), Publish: &Publish{
			ExpectedVersion: uint64(i + 1), Author: "alice", Reason: "test", Document: []byte(doc), Quotas: []QuotaSpec{atlas(StrategyDemand)},
		}})
		pr, ok := res.(*PublishResult)
		if !ok {
			t.Fatalf("publish: %v", res)
		}
		sum := sha256.Sum256([]byte(doc))
		want = append(want, hex.EncodeToString(sum[:]))
		if pr.Policy.Digest != want[i] {
			t.Fatalf("publish %d: digest %q, want %q", i+1, pr.Policy.Digest, want[i])
		}
	}
	check := func(name string, f *FSM) {
		t.Helper()
		hist := f.PolicyHistory()
		if len(hist) != len(docs) {
			t.Fatalf("%s: %d versions", name, len(hist))
		}
		for i, p := range hist {
			if p.Digest != want[i] {
				t.Errorf("%s: history version %d digest %q, want %q", name, p.Version, p.Digest, want[i])
			}
			if v, _ := f.PolicyVersion(p.Version); v.Digest != want[i] {
				t.Errorf("%s: PolicyVersion(%d) digest %q, want %q", name, p.Version, v.Digest, want[i])
			}
		}
		if cur, _ := f.Policy(); cur.Digest != want[len(want)-1] {
			t.Errorf("%s: current digest %q", name, cur.Digest)
		}
	}
	check("applied", h.f)
	snap := snapshotBytes(t, h.f)
	if bytes.Contains(snap, []byte("digest")) {
		t.Fatalf("the snapshot format changed:\n%s", snap)
	}
	f := New()
	if err := restore(f, snap); err != nil {
		t.Fatal(err)
	}
	check("restored", f)
}
