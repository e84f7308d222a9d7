package fsm

import (
	"bytes"
	"fmt"
	"io"
	"runtime"
	"strconv"
	"testing"

	"github.com/hashicorp/raft"
)

// benchSpecs returns n quotas with large pools, so grants never run dry.
func benchSpecs(n int) []QuotaSpec {
	specs := make([]QuotaSpec, n)
	for i := range specs {
		specs[i] = QuotaSpec{Name: fmt.Sprintf("tenant-%06d", i), Limit: MaxLimit, WindowMs: minute, ChunkTokens: 100, TTLMs: 15_000, Clamp: true}
	}
	return specs
}

func benchPublish(b *testing.B, f *FSM, specs []QuotaSpec) {
	data, err := Encode(Command{Type: CmdPublishPolicy, NowUnixMs: t0, Publish: &Publish{ExpectedVersion: 1, Author: "bench", Quotas: specs}})
	if err != nil {
		b.Fatal(err)
	}
	if res, ok := f.Apply(&raft.Log{Index: 1, Type: raft.LogCommand, Data: data}).(error); ok {
		b.Fatal(res)
	}
}

// acquireEntry builds an encoded Acquire for quotas [first, first+batch)
// of specs, stamped now, cheaply enough to do inside the timed loop.
func acquireEntry(buf []byte, now int64, id int, first, batch int) []byte {
	buf = append(buf[:0], FormatV1)
	buf = append(buf, `{"type":1,"now_unix_ms":`...)
	buf = strconv.AppendInt(buf, now, 10)
	buf = append(buf, `,"acquire":{"region":"eu","request_id":"`...)
	buf = strconv.AppendInt(buf, int64(id), 10)
	buf = append(buf, `","wants":[`...)
	for i := range batch {
		if i > 0 {
			buf = append(buf, ',')
		}
		buf = append(buf, `{"quota":"tenant-`...)
		buf = fmt.Appendf(buf, "%06d", first+i)
		buf = append(buf, `","tokens":10,"demand_per_second":12.5}`...)
	}
	return append(buf, "]}}"...)
}

// BenchmarkApplyAcquire measures Apply of one Acquire entry, decoding
// included, for batches of 1 and 100 quotas; ns/grant and allocs/grant are
// per want. Time advances 1 ms per entry, so windows roll and old ones are
// collected as in production.
func BenchmarkApplyAcquire(b *testing.B) {
	for _, batch := range []int{1, 100} {
		for _, strategy := range []Strategy{StrategyDemand, StrategyFairShare} {
			b.Run(fmt.Sprintf("batch=%d/%s", batch, strategy), func(b *testing.B) {
				f := New()
				specs := benchSpecs(1000)
				for i := range specs {
					specs[i].Strategy = strategy
				}
				benchPublish(b, f, specs)
				var buf []byte
				var ms0, ms1 runtime.MemStats
				runtime.ReadMemStats(&ms0)
				b.ResetTimer()
				for i := 0; b.Loop(); i++ {
					buf = acquireEntry(buf, t0+int64(i), i, (i*batch)%(len(specs)-batch), batch)
					res := f.Apply(&raft.Log{Index: uint64(i) + 2, Type: raft.LogCommand, Data: buf})
					if err, ok := res.(error); ok {
						b.Fatal(err)
					}
				}
				b.StopTimer()
				runtime.ReadMemStats(&ms1)
				grants := float64(b.N * batch)
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/grants, "ns/grant")
				b.ReportMetric(float64(ms1.Mallocs-ms0.Mallocs)/grants, "allocs/grant")
			})
		}
	}
}

func heapInUse() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// BenchmarkMemoryPerQuota reports the heap held per quota: idle (spec and
// bookkeeping only) and active (an open window with one grant and a demand
// report, plus the grant's idempotency record).
func BenchmarkMemoryPerQuota(b *testing.B) {
	const n = 100_000
	for b.Loop() {
		specs := benchSpecs(n)
		base := heapInUse()
		f := New()
		benchPublish(b, f, specs)
		specs = nil
		idle := heapInUse()
		var buf []byte
		for i := range n {
			buf = acquireEntry(buf, t0+1, i, i, 1)
			f.Apply(&raft.Log{Index: uint64(i) + 2, Type: raft.LogCommand, Data: buf})
		}
		active := heapInUse()
		b.ReportMetric(float64(idle-base)/n, "B/idle-quota")
		b.ReportMetric(float64(active-base)/n, "B/active-quota")
		runtime.KeepAlive(f)
	}
}

// activeFSM returns an FSM with n quotas, each with an open window holding
// one grant.
func activeFSM(b *testing.B, n int) *FSM {
	f := New()
	benchPublish(b, f, benchSpecs(n))
	var buf []byte
	for i := range n {
		buf = acquireEntry(buf, t0+1, i, i, 1)
		f.Apply(&raft.Log{Index: uint64(i) + 2, Type: raft.LogCommand, Data: buf})
	}
	return f
}

// BenchmarkSnapshot100k measures Snapshot (the part that blocks Apply) and
// Persist for 100,000 active quotas.
func BenchmarkSnapshot100k(b *testing.B) {
	f := activeFSM(b, 100_000)
	b.Run("capture", func(b *testing.B) {
		for b.Loop() {
			s, _ := f.Snapshot()
			s.Release()
		}
	})
	b.Run("persist", func(b *testing.B) {
		s, _ := f.Snapshot()
		var sink countingSink
		for b.Loop() {
			sink.n = 0
			if err := s.Persist(&sink); err != nil {
				b.Fatal(err)
			}
		}
		b.SetBytes(sink.n)
	})
}

// countingSink is a raft.SnapshotSink that only counts bytes, so the
// benchmark measures Persist rather than buffer growth.
type countingSink struct {
	memSink
	n int64
}

func (s *countingSink) Write(p []byte) (int, error) {
	s.n += int64(len(p))
	return len(p), nil
}

// BenchmarkRestore100k measures Restore of a snapshot of 100,000 active
// quotas.
func BenchmarkRestore100k(b *testing.B) {
	data := snapshotBytes(b, activeFSM(b, 100_000))
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		if err := New().Restore(io.NopCloser(bytes.NewReader(data))); err != nil {
			b.Fatal(err)
		}
	}
}
