package fsm_test

import (
	"errors"
	"fmt"

	"github.com/hashicorp/raft"

	"github.com/allot-dev/allot/fsm"
)

// Example applies a policy and two Acquires the way raft would, and shows
// a grant clamped to the end of its window and an error naming its field.
func Example() {
	f := fsm.New()
	var index uint64
	apply := func(c fsm.Command) any {
		b, err := fsm.Encode(c)
		if err != nil {
			return err
		}
		index++
		return f.Apply(&raft.Log{Index: index, Type: raft.LogCommand, Data: b})
	}
	const start = 1_700_000_040_000 // a minute boundary
	apply(fsm.Command{Type: fsm.CmdPublishPolicy, NowUnixMs: start, Publish: &fsm.Publish{
		ExpectedVersion: 1, Author: "ops@northstar", Reason: "Atlas global plan",
		Quotas: []fsm.QuotaSpec{{Name: "atlas", Limit: 1000, WindowMs: 60_000, ChunkTokens: 100, TTLMs: 15_000, Clamp: true}},
	}})

	res := apply(fsm.Command{Type: fsm.CmdAcquire, NowUnixMs: start + 50_000, Acquire: &fsm.Acquire{
		Region: "eu", RequestID: "eu-1", Wants: []fsm.Want{{Quota: "atlas", DemandPerSecond: 15}},
	}})
	g := res.(*fsm.AcquireResult).Grants[0]
	fmt.Printf("granted %d as %s, ttl %d ms (clamped), pool %d\n", g.Tokens, g.GrantID, g.TTLMs, g.PoolRemaining)

	res = apply(fsm.Command{Type: fsm.CmdAcquire, NowUnixMs: start + 51_000, Acquire: &fsm.Acquire{
		Region: "us", RequestID: "us-1", Wants: []fsm.Want{{Quota: "atlas"}, {Quota: "birch"}},
	}})
	err := res.(error)
	fmt.Println(err, errors.Is(err, fsm.ErrUnknownQuota))
	// Output:
	// granted 100 as 2-0, ttl 10000 ms (clamped), pool 900
	// acquire: wants[1].quota "birch": unknown quota true
}
