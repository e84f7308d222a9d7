package allocator

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/allot-dev/allot/fsm"
	"github.com/allot-dev/allot/pkg/policy"
)

// TestProposerCapsEntriesByWants: concurrent Acquires are group-committed,
// but an entry stops taking calls at fsm.MaxWants wants, so however many
// large Acquires queue up, one Raft entry carries less than 2 x MaxWants
// wants. Grant ids number the wants of an entry ("<index>-<n>"), which
// shows each entry's size; every Acquire still gets all of its grants.
func TestProposerCapsEntriesByWants(t *testing.T) {
	tc := newTestCluster(t, 3)
	l := tc.leader()
	publishTest(t, []string{tc.addrs[tc.index(l)]}, templatePolicy, 1)
	const calls, perCall = 6, 10_000
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		results = map[int]*fsm.AcquireResult{}
		errs    []error
	)
	for c := range calls {
		wants := make([]fsm.Want, perCall)
		for i := range wants {
			wants[i] = fsm.Want{Quota: policy.InstanceName("standard", []string{fmt.Sprintf("c%dt%d", c, i)}), Tokens: 1}
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			cmd := fsm.Command{Type: fsm.CmdAcquire, Acquire: &fsm.Acquire{Region: "eu", RequestID: fmt.Sprintf("big-%d", c), Wants: wants}}
			res, err := l.Apply(ctx, cmd)
			// A loaded machine may move the leadership of this fast-timeout
			// cluster: retry on the new leader with the same request id
			// (a replay returns the grants first recorded).
			for try := 0; try < 10 && (errors.Is(err, ErrNotLeader) || errors.Is(err, ErrUnknownOutcome)); try++ {
				time.Sleep(200 * time.Millisecond)
				res, err = tc.leader().Apply(ctx, cmd)
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
				return
			}
			results[c] = res.(*fsm.AcquireResult)
		}()
	}
	wg.Wait()
	if len(errs) > 0 {
		t.Fatalf("Acquire failed: %v", errs)
	}
	perEntry := map[string]int{}
	for c, r := range results {
		if len(r.Grants) != perCall {
			t.Fatalf("call %d: %d grants, want %d", c, len(r.Grants), perCall)
		}
		for _, g := range r.Grants {
			index, n, ok := strings.Cut(g.GrantID, "-")
			k, err := strconv.Atoi(n)
			if !ok || err != nil || g.Tokens != 1 {
				t.Fatalf("call %d: grant %+v", c, g)
			}
			if k >= 2*fsm.MaxWants {
				t.Fatalf("grant %s: an entry carried more than 2 x %d wants", g.GrantID, fsm.MaxWants)
			}
			perEntry[index]++
		}
	}
	t.Logf("%d Acquires of %d wants in %d entries: %v", calls, perCall, len(perEntry), perEntry)
}

// TestProposerCommitDelay: under load (the previous entry carried at least
// CommitSiblings calls) the leader holds a batch for up to CommitDelay, so a
// wave of concurrent calls lands in ONE entry instead of a lone first call
// followed by the rest.
func TestProposerCommitDelay(t *testing.T) {
	tc := newTestCluster(t, 3, func(c *Config) { c.CommitDelay, c.CommitSiblings = time.Second, 2 })
	publishTest(t, []string{tc.addrs[tc.index(tc.leader())]}, templatePolicy, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	seq := 0
	// wave sends n Acquires at once and returns the Raft index each landed in.
	wave := func(n int) []string {
		l := tc.leader()
		start := make(chan struct{})
		var wg sync.WaitGroup
		out := make([]string, n)
		errs := make([]error, n)
		for i := range n {
			seq++
			id, tenant := fmt.Sprintf("w-%d", seq), fmt.Sprintf("t%d", seq)
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				out[i], errs[i] = acquireEntry(ctx, l, id, tenant)
			}()
		}
		close(start)
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatalf("wave of %d: %v", n, err)
		}
		return out
	}
	// Load first: a wave whose last entry carried c >= 2 calls.
	c := 0
	for try := 0; try < 5 && c < 2; try++ {
		idx := wave(8)
		last := slices.MaxFunc(idx, func(a, b string) int { return cmpIndex(a, b) })
		c = count(idx, last)
	}
	if c < 2 {
		t.Fatal("no wave of 8 concurrent calls shared an entry")
	}
	// c calls at once: the first is held for companions (one entry, not
	// c), and the hold ends when all c are in, not after the 1 s delay.
	began := time.Now()
	idx := wave(c)
	took := time.Since(began)
	entries := map[string]int{}
	for _, i := range idx {
		entries[i]++
	}
	if len(entries) != 1 {
		t.Fatalf("%d concurrent calls under load landed in %d entries %v, want 1 (held for companions)", c, len(entries), entries)
	}
	if took >= 500*time.Millisecond {
		t.Fatalf("%d calls took %s: the hold ran (most of) the whole 1 s delay though the previous entry's %d calls were all in", c, took, c)
	}
}

// TestProposerHoldsForEveryCaller: callers in a closed loop (each sends its
// next call as soon as the last is answered) all ride every entry once the
// load is steady. A hold that ended when as many calls waited as the
// previous entry carried would leave behind, each round, a caller that had
// come in while that entry was in Raft: 7 calls per entry out of 8 callers,
// or two groups of callers taking turns. The dispatcher proposes through a
// fake Raft round of 20 ms, so that the callers' turnaround (scheduling on a
// busy machine included) is short beside a round, as it is beside fsyncs.
func TestProposerHoldsForEveryCaller(t *testing.T) {
	const callers, rounds, settle = 8, 30, 5
	var (
		mu    sync.Mutex
		sizes []int // calls per entry, in order
	)
	apply := func(cmd fsm.Command) (any, error) {
		time.Sleep(20 * time.Millisecond)
		n := 1
		var res any = &fsm.AcquireResult{}
		if cmd.Type == fsm.CmdBatch {
			n = len(cmd.Batch)
			res = &fsm.BatchResult{Results: make([]any, n)}
		}
		mu.Lock()
		sizes = append(sizes, n)
		mu.Unlock()
		return res, nil
	}
	p := startProposer(apply, time.Second, 2)
	defer p.close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	errs := make([]error, callers)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for c := range callers {
		wg.Go(func() {
			<-start
			for r := range rounds {
				cmd := fsm.Command{Type: fsm.CmdAcquire, Acquire: &fsm.Acquire{Region: "eu", RequestID: fmt.Sprintf("c%d-r%d", c, r)}}
				if _, err := p.propose(ctx, cmd); err != nil {
					errs[c] = fmt.Errorf("round %d: %w", r, err)
					return
				}
			}
		})
	}
	close(start)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	// The first entries gather the callers; the last ones see them finish.
	if len(sizes) < 3*settle {
		t.Fatalf("%d calls went in only %d entries %v", callers*rounds, len(sizes), sizes)
	}
	for i, n := range sizes[settle : len(sizes)-settle] {
		if n != callers {
			t.Fatalf("entry %d carried %d calls of %d closed-loop callers; want every caller in every entry once the load is steady: %v",
				settle+i, n, callers, sizes)
		}
	}
}

// acquireEntry applies, on l, an Acquire of one token of tenant's instance
// of templatePolicy's "standard" template and returns the Raft index of the
// entry it landed in (a grant id is "<index>-<want number>").
func acquireEntry(ctx context.Context, l *Node, requestID, tenant string) (string, error) {
	res, err := l.Apply(ctx, fsm.Command{Type: fsm.CmdAcquire, Acquire: &fsm.Acquire{Region: "eu", RequestID: requestID,
		Wants: []fsm.Want{{Quota: policy.InstanceName("standard", []string{tenant}), Tokens: 1}}}})
	if err != nil {
		return "", err
	}
	g := res.(*fsm.AcquireResult).Grants
	if len(g) != 1 {
		return "", fmt.Errorf("%d grants", len(g))
	}
	i, _, _ := strings.Cut(g[0].GrantID, "-")
	return i, nil
}

func cmpIndex(a, b string) int {
	x, _ := strconv.ParseUint(a, 10, 64)
	y, _ := strconv.ParseUint(b, 10, 64)
	return cmp.Compare(x, y)
}

func count(xs []string, x string) int {
	n := 0
	for _, v := range xs {
		if v == x {
			n++
		}
	}
	return n
}

// TestProposeAfterCloseNeverHangs: every call that comes after close, or
// races it, is answered at once. A select picks among ready cases at
// random, so a call after close used to be queued half the time, after the
// drain, and wait for its whole deadline.
func TestProposeAfterCloseNeverHangs(t *testing.T) {
	cmd := fsm.Command{Type: fsm.CmdRelease, Release: &fsm.Release{Region: "eu", GrantID: "1-0", Tokens: 1, RequestID: "r"}}
	apply := func(c fsm.Command) (any, error) {
		if c.Type != fsm.CmdBatch {
			return &fsm.ReleaseResult{}, nil
		}
		br := &fsm.BatchResult{}
		for range c.Batch {
			br.Results = append(br.Results, &fsm.ReleaseResult{})
		}
		return br, nil
	}
	const deadline = 5 * time.Second
	check := func(t *testing.T, p *proposer, calls int) {
		t.Helper()
		var wg sync.WaitGroup
		errs := make(chan error, calls)
		for range calls {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(context.Background(), deadline)
				defer cancel()
				start := time.Now()
				_, err := p.propose(ctx, cmd)
				if err != nil && !errors.Is(err, ErrNotLeader) || time.Since(start) > deadline/2 {
					errs <- fmt.Errorf("after %s: %v", time.Since(start).Round(time.Millisecond), err)
				}
			}()
		}
		wg.Wait()
		close(errs)
		n := 0
		for err := range errs {
			if n++; n <= 3 {
				t.Errorf("a call after or racing close: %v, want the result or ErrNotLeader at once", err)
			}
		}
		if n > 3 {
			t.Errorf("... %d such calls in all", n)
		}
	}

	t.Run("after close", func(t *testing.T) {
		p := startProposer(apply, 0, 1)
		p.close()
		check(t, p, 500)
	})
	t.Run("racing close", func(t *testing.T) {
		for range 20 {
			p := startProposer(apply, 0, 1)
			var (
				wg  sync.WaitGroup
				bad = make(chan error, 8)
			)
			for range 8 {
				wg.Add(1)
				go func() { // calls until it has seen the proposer closed thrice
					defer wg.Done()
					for closed := 0; closed < 3; {
						ctx, cancel := context.WithTimeout(context.Background(), deadline)
						start := time.Now()
						_, err := p.propose(ctx, cmd)
						cancel()
						if err != nil && !errors.Is(err, ErrNotLeader) || time.Since(start) > deadline/2 {
							bad <- fmt.Errorf("after %s: %v", time.Since(start).Round(time.Millisecond), err)
							return
						}
						if err != nil {
							closed++
						}
					}
				}()
			}
			time.Sleep(time.Millisecond)
			p.close()
			wg.Wait()
			close(bad)
			for err := range bad {
				t.Errorf("a call racing close: %v, want the result or ErrNotLeader at once", err)
			}
		}
	})
}
