package allocator

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"io/fs"
	"math/bits"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"time"

	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
)

// The files of a node's data dir.
const (
	raftDBName    = "raft.db"         // BoltDB: the Raft log, term and vote
	markerName    = "allot-node.json" // dataDirMarker
	snapshotsName = "snapshots"       // raft's FileSnapshotStore
	snapStateName = "state.bin"       // a snapshot's data in its directory (FileSnapshotStore's layout)
)

var (
	// ErrRaftStateLost means the data dir shows that this node had Raft
	// state (its marker file, or snapshots) that raft.db no longer holds:
	// raft.db was emptied, deleted or replaced, or snapshots the log relies
	// on are gone. Starting anyway would forget grants the cluster
	// acknowledged and grant the same quota again, so NewNode refuses.
	ErrRaftStateLost = errors.New("raft state lost")
	// ErrRaftDBDamaged means raft.db is not a BoltDB file that can be opened
	// safely (truncated, or its meta pages are invalid).
	ErrRaftDBDamaged = errors.New("raft.db is damaged")
	// ErrClusterRunning means a node asked to bootstrap from an empty data
	// dir while one of its bootstrap peers answers as a cluster that has
	// published a policy: the node lost its data or was never started, and
	// must join that cluster rather than found one.
	ErrClusterRunning = errors.New("the bootstrap peers run a cluster already")
	// ErrForeignState means a node would start Raft on a data dir whose
	// state the cluster does not know as this node's: with -join, the
	// cluster does not list the node (the state is another cluster's, or
	// the node was removed); with -join or -bootstrap, the cluster lists it
	// but runs another cluster id than the data dir's marker (a cluster
	// founded again with the same node ids and addresses).
	ErrForeignState = errors.New("the data dir holds Raft state foreign to the cluster")
)

// recoverySteps is what an operator can do about lost Raft state; the
// messages of ErrRaftStateLost end with it.
const recoverySteps = "either restore the data dir (raft.db, snapshots and " + markerName + ") from a backup of " +
	"this node (the grants made after the backup are forgotten); or, in a cluster of several nodes, remove this " +
	"node (allotctl -addr OTHER_MEMBER member remove ID; with a majority lost there is no leader to ask: skip it), " +
	"empty its data dir and start it with -join OTHER_MEMBER instead of -bootstrap: it catches up from the leader " +
	"(docs/operations.md, \"Recover an allocator node\")"

// dataDirMarker is the marker file of a data dir that holds a node's Raft
// state. It is written once the node has state (it bootstrapped, got its
// first entries from a leader, or was found with state by a build that
// predates the marker), and never removed: a data dir with a marker, or
// with snapshots, whose raft.db holds no state has lost it.
type dataDirMarker struct {
	// NodeID is the Raft server ID of the node whose state this is.
	NodeID string `json:"node_id"`
	// Origin says how the node first got its state: "bootstrap",
	// "replicated" (from a leader, after a join) or "existing" (found at
	// the first start of a build with markers).
	Origin string `json:"origin"`
	// Created is when the marker was written.
	Created time.Time `json:"created"`
	// ClusterID is the id of the cluster whose state this is (fsm.SetCluster),
	// recorded once the node has applied it; empty before (and in markers of
	// builds before cluster ids).
	ClusterID string `json:"cluster_id,omitempty"`
	// Note tells a reader what the file is for.
	Note string `json:"note"`
}

const markerNote = "This data dir holds the Raft state of this allocator node. Keep this file: " +
	"the allocator refuses to start when it is here and raft.db has lost the state."

// readMarker reads the marker of dir; nil when there is none.
func readMarker(dir string) (*dataDirMarker, error) {
	b, err := os.ReadFile(filepath.Join(dir, markerName))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", markerName, err)
	}
	var m dataDirMarker
	if err := json.Unmarshal(b, &m); err != nil || m.NodeID == "" {
		return nil, fmt.Errorf("%s in %s is not a marker this build wrote (%d bytes): it records that the data dir "+
			"holds a node's Raft state; check raft.db, and rewrite the file with {\"node_id\": \"ID\"} only if raft.db is intact",
			markerName, dir, len(b))
	}
	return &m, nil
}

// writeMarker writes m as the marker of dir atomically: a temporary file,
// synced, renamed over the marker, then the directory synced.
func writeMarker(dir string, m dataDirMarker) error {
	m.Note = markerNote
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(dir, markerName+".tmp*")
	if err != nil {
		return fmt.Errorf("write %s: %w", markerName, err)
	}
	_, err = tmp.Write(append(b, '\n'))
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), filepath.Join(dir, markerName))
	}
	if err != nil {
		_ = os.Remove(tmp.Name())
		return fmt.Errorf("write %s: %w", markerName, err)
	}
	if err := syncDir(dir); err != nil {
		return fmt.Errorf("write %s: sync %s: %w", markerName, dir, err)
	}
	return nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	return err
}

// snapshotDirs lists the snapshots of dir as raft's FileSnapshotStore
// keeps them (one directory each; ".tmp" ones are unfinished), readable or
// not: any of them shows the node had state.
func snapshotDirs(dir string) ([]string, error) {
	entries, err := os.ReadDir(filepath.Join(dir, snapshotsName))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list snapshots: %w", err)
	}
	var out []string
	for _, e := range entries {
		if e.IsDir() && !strings.HasSuffix(e.Name(), ".tmp") {
			out = append(out, e.Name())
		}
	}
	return out, nil
}

// dataDir is what NewNode found in a node's data dir.
type dataDir struct {
	path   string
	marker *dataDirMarker // nil: none (a new node, or one from before markers)
	snaps  []string       // snapshot directories
	dbSize int64          // -1: raft.db does not exist
}

// inspectDataDir reads dir's marker and lists its snapshots and raft.db,
// and refuses what must not be opened: the data dir of another node, lost
// state that opening raft.db would hide (BoltDB creates a missing or empty
// file afresh), and a raft.db bbolt would crash on.
func inspectDataDir(dir, nodeID string) (*dataDir, error) {
	d := &dataDir{path: dir, dbSize: -1}
	var err error
	if d.marker, err = readMarker(dir); err != nil {
		return nil, err
	}
	if d.marker != nil && d.marker.NodeID != nodeID {
		return nil, fmt.Errorf("data dir %s holds the Raft state of node %q (%s), not of %q: start that node from it, "+
			"or give this node a data dir of its own: %w", dir, d.marker.NodeID, markerName, nodeID, ErrConfig)
	}
	if d.snaps, err = snapshotDirs(dir); err != nil {
		return nil, err
	}
	dbPath := filepath.Join(dir, raftDBName)
	fi, err := os.Stat(dbPath)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return nil, fmt.Errorf("raft.db: %w", err)
	case !fi.Mode().IsRegular():
		return nil, fmt.Errorf("data dir %s: %w (raft.db is not a regular file)", dir, ErrRaftDBDamaged)
	default:
		d.dbSize = fi.Size()
	}
	if d.dbSize <= 0 && d.hadState() {
		what := "raft.db is missing"
		if d.dbSize == 0 {
			what = "raft.db is empty (0 bytes)"
		}
		return nil, d.lostError(what)
	}
	if d.dbSize > 0 {
		if err := checkBoltFile(dbPath); err != nil {
			return nil, err
		}
	}
	return d, nil
}

// hadState reports whether the data dir shows that the node had Raft state.
func (d *dataDir) hadState() bool { return d.marker != nil || len(d.snaps) > 0 }

// evidence describes what shows that the node had state.
func (d *dataDir) evidence() string {
	var parts []string
	if m := d.marker; m != nil {
		parts = append(parts, fmt.Sprintf("%s records state of node %q since %s (%s)", markerName, m.NodeID, m.Created.UTC().Format(time.RFC3339), m.Origin))
	}
	if n := len(d.snaps); n > 0 {
		parts = append(parts, fmt.Sprintf("%d snapshot(s) in %s: %s", n, snapshotsName, strings.Join(d.snaps, ", ")))
	}
	return strings.Join(parts, "; ")
}

// lostError is the refusal of a data dir whose Raft state is gone.
func (d *dataDir) lostError(what string) error {
	return fmt.Errorf("data dir %s: %s, but this node had Raft state there (%s): %w. The log with the term and vote "+
		"is gone, and with it the grants committed since the last snapshot (or all of them); starting would "+
		"restore at most that snapshot, at a lower term, and grant again tokens that regions may still hold and "+
		"spend: refusing to start. To recover, %s",
		d.path, what, d.evidence(), ErrRaftStateLost, recoverySteps)
}

// raftDBState is the Raft state raft.db holds.
type raftDBState struct {
	has         bool   // a term or a log (raft.HasExistingState without snapshots)
	first, last uint64 // log indexes; 0, 0: empty
}

// openRaftDB opens raft.db (checked by checkBoltFile) and reads its state.
// A fault or a panic of bbolt while it opens or reads the file becomes
// an ErrRaftDBDamaged error rather than kill the process; the store is
// then left open, as closing it could block on the transaction that
// panicked.
func openRaftDB(path string) (store *raftboltdb.BoltStore, st raftDBState, err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			store, st = nil, raftDBState{}
			err = fmt.Errorf("data dir %s: %w (reading it failed: %v): refusing to start. To recover, %s",
				filepath.Dir(path), ErrRaftDBDamaged, r, recoverySteps)
		}
	}()
	store, err = raftboltdb.New(raftboltdb.Options{Path: path})
	if err != nil {
		return nil, st, fmt.Errorf("open raft.db: %w", err)
	}
	st.has, err = raft.HasExistingState(store, store, raft.NewInmemSnapshotStore())
	if err == nil {
		st.first, err = store.FirstIndex()
	}
	if err == nil {
		st.last, err = store.LastIndex()
	}
	if err != nil {
		_ = store.Close()
		return nil, st, fmt.Errorf("read raft.db: %w", err)
	}
	return store, st, nil
}

// checkState refuses a raft.db that lost what the data dir shows the node
// had, given the snapshots raft can read (newest first): no state at all,
// no log and no snapshot, or a log that starts after the newest snapshot.
func (d *dataDir) checkState(st raftDBState, snaps []*raft.SnapshotMeta) error {
	var snapIndex uint64
	if len(snaps) > 0 {
		snapIndex = snaps[0].Index
	}
	switch {
	case !st.has && d.hadState():
		return d.lostError("raft.db holds no Raft state (no term, no log)")
	case d.marker != nil && st.last == 0 && snapIndex == 0:
		return d.lostError("raft.db holds no log and there is no readable snapshot")
	case st.first > 1 && snapIndex+1 < st.first:
		latest := "none readable"
		if snapIndex > 0 {
			latest = fmt.Sprintf("the newest readable one ends at index %d", snapIndex)
		}
		return fmt.Errorf("data dir %s: the Raft log starts at index %d, and no snapshot holds the entries before it "+
			"(%s): %w. Snapshots were removed or damaged; starting would apply the log to an empty state and "+
			"forget the grants before it: refusing to start. To recover, %s",
			d.path, st.first, latest, ErrRaftStateLost, recoverySteps)
	}
	return nil
}

// hasEntries reports whether the node has a log or a snapshot: what the
// marker records.
func hasEntries(st raftDBState, snaps []*raft.SnapshotMeta) bool {
	return st.last > 0 || len(snaps) > 0
}

// bbolt's file format (go.etcd.io/bbolt v1.3.5, page.go and db.go): every
// page starts with a header (id uint64, flags uint16, count uint16,
// overflow uint32); pages 0 and 1 are meta pages, whose meta follows the
// header: magic, version, pageSize, flags (uint32 each), the root bucket
// (root pgid, sequence), the freelist pgid, the high-water pgid, the txid
// and a checksum, the FNV-64a of the meta's bytes before it. Integers are
// in the machine's byte order.
const (
	boltMagic            = 0xED0CDAED
	boltVersion          = 2
	boltPageHeaderSize   = 16
	boltMetaSize         = 64
	boltChecksumOffset   = 56
	boltBranchPageFlag   = 0x01
	boltLeafPageFlag     = 0x02
	boltFreelistPageFlag = 0x10
	boltNoFreelist       = ^uint64(0)
	boltMinPages         = 4 // two meta pages, a freelist and the root leaf
)

// boltMeta is the meta of one meta page.
type boltMeta struct {
	pageSize                 uint32
	root, freelist, pgid, tx uint64
}

// parseBoltMeta decodes and validates the meta of the meta page p, as
// bbolt's meta.validate does (a zero checksum passes there too).
func parseBoltMeta(p []byte) (boltMeta, error) {
	if len(p) < boltPageHeaderSize+boltMetaSize {
		return boltMeta{}, errors.New("short page")
	}
	b := p[boltPageHeaderSize : boltPageHeaderSize+boltMetaSize]
	ne := binary.NativeEndian
	if ne.Uint32(b[0:]) != boltMagic {
		return boltMeta{}, errors.New("no bbolt magic")
	}
	if v := ne.Uint32(b[4:]); v != boltVersion {
		return boltMeta{}, fmt.Errorf("version %d, want %d", v, boltVersion)
	}
	if sum := ne.Uint64(b[boltChecksumOffset:]); sum != 0 {
		h := fnv.New64a()
		_, _ = h.Write(b[:boltChecksumOffset])
		if h.Sum64() != sum {
			return boltMeta{}, errors.New("checksum mismatch")
		}
	}
	return boltMeta{
		pageSize: ne.Uint32(b[8:]),
		root:     ne.Uint64(b[16:]),
		freelist: ne.Uint64(b[32:]),
		pgid:     ne.Uint64(b[40:]),
		tx:       ne.Uint64(b[48:]),
	}, nil
}

// boltPage is the header of one page.
type boltPage struct {
	id       uint64
	flags    uint16
	count    uint16
	overflow uint32
}

func parseBoltPage(b []byte) boltPage {
	ne := binary.NativeEndian
	return boltPage{id: ne.Uint64(b[0:]), flags: ne.Uint16(b[8:]), count: ne.Uint16(b[10:]), overflow: ne.Uint32(b[12:])}
}

// checkBoltFile checks, before bbolt maps it, that the BoltDB file at path
// is whole enough to open: bbolt v1.3.5 trusts its meta page and reads
// the pages it names through the memory map, so a truncated file kills
// the process with SIGBUS or SIGSEGV. The file's size must be a multiple
// of its page size and at least four pages; the meta page bbolt would
// use (the valid one with the higher txid) must name a high-water mark
// within the file, a root page and a freelist below it, and the freelist
// must list only pages below it.
func checkBoltFile(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("open raft.db: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("open raft.db: %w", err)
	}
	size := fi.Size()
	damaged := func(format string, args ...any) error {
		return fmt.Errorf("data dir %s: %w (%s): refusing to start. To recover, %s",
			filepath.Dir(path), ErrRaftDBDamaged, fmt.Sprintf(format, args...), recoverySteps)
	}
	read := func(off int64, n int) ([]byte, error) {
		b := make([]byte, n)
		if _, err := f.ReadAt(b, off); err != nil && !errors.Is(err, io.EOF) {
			return nil, err
		}
		return b, nil
	}
	// bbolt reads the page size from meta page 0 and falls back to the
	// machine's page size when that page is invalid.
	const firstRead = 0x1000
	if size < firstRead {
		return damaged("%d bytes, shorter than a meta page", size)
	}
	p0, err := read(0, firstRead)
	if err != nil {
		return fmt.Errorf("read raft.db: %w", err)
	}
	m0, err0 := parseBoltMeta(p0)
	pageSize := int64(os.Getpagesize())
	if err0 == nil {
		pageSize = int64(m0.pageSize)
		if pageSize < boltPageHeaderSize+boltMetaSize || bits.OnesCount64(uint64(pageSize)) != 1 {
			return damaged("meta page 0 gives a page size of %d bytes", pageSize)
		}
	}
	if size%pageSize != 0 {
		return damaged("%d bytes, not a whole number of %d-byte pages: truncated", size, pageSize)
	}
	if size < boltMinPages*pageSize {
		return damaged("%d bytes, fewer than %d pages of %d bytes", size, boltMinPages, pageSize)
	}
	p1, err := read(pageSize, boltPageHeaderSize+boltMetaSize)
	if err != nil {
		return fmt.Errorf("read raft.db: %w", err)
	}
	m1, err1 := parseBoltMeta(p1)
	// bbolt's DB.meta: the meta with the higher txid if valid, else the other.
	a, b, errA, errB, idA, idB := m0, m1, err0, err1, 0, 1
	if m1.tx > m0.tx {
		a, b, errA, errB, idA, idB = m1, m0, err1, err0, 1, 0
	}
	m, id := a, idA
	switch {
	case errA == nil:
	case errB == nil:
		m, id = b, idB
	default:
		return damaged("neither meta page is valid: page 0: %v; page 1: %v", err0, err1)
	}
	pages := uint64(size / pageSize)
	if int64(m.pageSize) != pageSize {
		return damaged("meta page %d gives a page size of %d bytes, the file uses %d", id, m.pageSize, pageSize)
	}
	if m.pgid < boltMinPages || m.pgid > pages {
		return damaged("meta page %d (txid %d) counts %d pages, the file holds %d: truncated", id, m.tx, m.pgid, pages)
	}
	page := func(what string, pgid uint64, flag uint16) (boltPage, error) {
		if pgid < 2 || pgid >= m.pgid {
			return boltPage{}, damaged("meta page %d (txid %d) puts the %s at page %d, outside pages 2-%d", id, m.tx, what, pgid, m.pgid-1)
		}
		b, err := read(int64(pgid)*pageSize, boltPageHeaderSize)
		if err != nil {
			return boltPage{}, fmt.Errorf("read raft.db: %w", err)
		}
		p := parseBoltPage(b)
		if p.id != pgid || p.flags&flag == 0 || pgid+uint64(p.overflow) >= m.pgid {
			return boltPage{}, damaged("page %d is not the %s meta page %d (txid %d) names (id %d, flags %#x, %d overflow pages)",
				pgid, what, id, m.tx, p.id, p.flags, p.overflow)
		}
		return p, nil
	}
	if _, err := page("root", m.root, boltBranchPageFlag|boltLeafPageFlag); err != nil {
		return err
	}
	if m.freelist == boltNoFreelist {
		return nil
	}
	fp, err := page("freelist", m.freelist, boltFreelistPageFlag)
	if err != nil {
		return err
	}
	// The freelist's page ids follow the header; a count of 0xFFFF means
	// the count is the first of them.
	span := (1 + int64(fp.overflow)) * pageSize
	body, err := read(int64(m.freelist)*pageSize+boltPageHeaderSize, int(span-boltPageHeaderSize))
	if err != nil {
		return fmt.Errorf("read raft.db: %w", err)
	}
	ids, count := body, uint64(fp.count)
	if fp.count == 0xFFFF {
		count = binary.NativeEndian.Uint64(body)
		ids = body[8:]
	}
	if count > uint64(len(ids)/8) {
		return damaged("the freelist at page %d counts %d pages, more than its %d bytes hold", m.freelist, count, len(ids))
	}
	for i := range count {
		if pg := binary.NativeEndian.Uint64(ids[8*i:]); pg < 2 || pg >= m.pgid {
			return damaged("the freelist at page %d lists page %d, outside pages 2-%d", m.freelist, pg, m.pgid-1)
		}
	}
	return nil
}

// mark writes the data dir's marker for node id, which got its state by
// origin.
func (d *dataDir) mark(id, origin string) error {
	m := dataDirMarker{NodeID: id, Origin: origin, Created: time.Now().UTC()}
	if err := writeMarker(d.path, m); err != nil {
		return err
	}
	d.marker = &m
	return nil
}

// setClusterID records the cluster's id in the data dir's marker, which
// must exist; the rest of the marker stays as it was.
func (d *dataDir) setClusterID(id string) error {
	m := *d.marker
	m.ClusterID = id
	if err := writeMarker(d.path, m); err != nil {
		return err
	}
	d.marker = &m
	return nil
}
