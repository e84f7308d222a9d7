package fsm

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"slices"
	"strconv"
	"strings"

	"github.com/hashicorp/raft"
)

// Snapshot formats: the "format" field of a snapshot's header.
const (
	// SnapshotFormatV1 is the format of snapshots written by builds before
	// the integrity trailer. Restore still reads them.
	SnapshotFormatV1 = 1
	// SnapshotFormatV2 is the format of snapshots written by Persist: the
	// records of format 1, then the integrity trailer.
	SnapshotFormatV2 = 2
)

// ErrBadSnapshot means Restore was given bytes that are not a consistent
// snapshot of a supported format, or whose integrity trailer does not
// match them.
var ErrBadSnapshot = errors.New("bad snapshot")

// A snapshot is a stream of JSON values, one per line: a snapshotHeader,
// then header.Policies PolicyRecords (ascending versions, the last one
// current), header.Quotas snapQuotas (by name; only quotas with windows or
// demand reports), header.Instances snapQuotas of the live instances of
// templates (by name), header.Carries snapCarries (by name, TemplateKeys
// and expiry; only visible ones) and header.Idempotency snapIdems (in
// insertion order). Fields added after
// the first release are optional (omitempty), so older snapshots restore.
// Values hold no maps, so encoding/json writes them the same way every time.
// One value per record keeps the decoder's buffer small when restoring a
// large state.
//
// A snapshot holds only the logical state: windows older than the previous
// one and stale demand reports, which may linger in memory until collected,
// are left out, so a restored replica and one that replayed the log write
// the same bytes.
//
// Integrity: the records can be damaged in ways their checks cannot see (a
// digit of a count, a time or an id), and a snapshot reaches Restore by
// paths that check nothing (InstallSnapshot streams the leader's), so the
// snapshot carries its own check. Format 2, which Persist writes, begins
// with the exact bytes of sealedPrefix (the header, format first) and ends
// with a trailer line of trailerLen bytes,
//
//	{"length":"00000000000000030875","crc32c":"1a2b3c4d"}
//
// the number of bytes before the trailer (20 decimal digits) and their
// CRC-32C (Castagnoli, 8 lowercase hex digits). Format 1, written by older
// builds, is the same records with format 1 and no trailer. Restore tells
// them apart by the first bytes: a snapshot that begins with sealedPrefix
// must end with a trailer that matches it exactly, so one cut anywhere, or
// whose trailer was damaged, is refused; any other is read as format 1,
// whose header must then say format 1. No single-bit flip turns the one
// prefix into the other, and a format 2 snapshot read as format 1 would
// still fail, on its header or its trailer (trailing data).
type snapshotHeader struct {
	Format         int    `json:"format"`
	NowUnixMs      int64  `json:"now_unix_ms"`
	TokensGranted  int64  `json:"tokens_granted"`
	LastGrantIndex uint64 `json:"last_grant_index"`
	Policies       int    `json:"policies"`
	Quotas         int    `json:"quotas"`
	Instances      int    `json:"instances,omitempty"`
	Carries        int    `json:"carries,omitempty"`
	Idempotency    int    `json:"idempotency"`
	// Members is the member table, sorted by ID.
	Members []snapMember `json:"members"`
	// ClusterID is the cluster's id (SetCluster), absent until one is
	// recorded: builds before it cannot restore a snapshot that has one.
	ClusterID string `json:"cluster_id,omitempty"`
}

type snapMember struct {
	ID         string `json:"id"`
	APIAddress string `json:"api_address"`
}

// snapshotDoc is a captured state, ready to be written.
type snapshotDoc struct {
	header      snapshotHeader
	policies    []*PolicyRecord
	quotas      []snapQuota
	instances   []snapQuota
	carries     []snapCarry
	idempotency []snapIdem
}

// snapCarry is a visible carry step; they are sorted by name, then keys,
// then expiry. Snapshots of builds before steps hold at most one per name
// and keys, live at the snapshot's time.
type snapCarry struct {
	Name          string `json:"name"`
	Tokens        int64  `json:"tokens"`
	ExpiresUnixMs int64  `json:"expires_unix_ms"`
	TemplateKeys  int    `json:"template_keys,omitempty"`
}

type snapQuota struct {
	Name    string       `json:"name"`
	Windows []snapWindow `json:"windows,omitempty"` // ascending index
	Demand  []snapDemand `json:"demand,omitempty"`  // by region
}

type snapWindow struct {
	Index   int64       `json:"index"`
	Limit   int64       `json:"limit"`
	Carried int64       `json:"carried,omitempty"`
	Grants  []snapGrant `json:"grants"` // in grant order
}

type snapGrant struct {
	ID            string `json:"id"`
	Region        string `json:"region"`
	Tokens        int64  `json:"tokens"`
	Released      int64  `json:"released"`
	GrantedUnixMs int64  `json:"granted_unix_ms"`
	ExpiresUnixMs int64  `json:"expires_unix_ms"`
}

type snapDemand struct {
	Region         string  `json:"region"`
	PerSecond      float64 `json:"per_second"`
	ReportedUnixMs int64   `json:"reported_unix_ms"`
}

type snapIdem struct {
	Kind      idemKind       `json:"kind"`
	Region    string         `json:"region"`
	RequestID string         `json:"request_id"`
	AtUnixMs  int64          `json:"at_unix_ms"`
	Acquire   *AcquireResult `json:"acquire,omitempty"`
	Release   *ReleaseResult `json:"release,omitempty"`
}

// Snapshot copies the state under a read lock; Persist encodes the copy.
// Policy records and recorded results are immutable and shared, not copied.
func (f *FSM) Snapshot() (raft.FSMSnapshot, error) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return &fsmSnapshot{doc: f.s.snapshot()}, nil
}

func (s *state) snapshot() *snapshotDoc {
	d := &snapshotDoc{
		policies:    slices.Clone(s.history),
		quotas:      make([]snapQuota, 0, len(s.names)),
		idempotency: make([]snapIdem, 0, len(s.idem)),
	}
	for _, name := range s.names {
		if sq, ok := s.snapQuota(s.quotas[name]); ok {
			d.quotas = append(d.quotas, sq)
		}
	}
	var live []*quota
	for _, name := range s.templates {
		for _, i := range s.quotas[name].instanceList() {
			if i.alive(s.now) {
				live = append(live, i)
			}
		}
	}
	slices.SortFunc(live, func(a, b *quota) int { return strings.Compare(a.name, b.name) })
	d.instances = make([]snapQuota, 0, len(live))
	for _, i := range live {
		if sq, ok := s.snapQuota(i); ok {
			d.instances = append(d.instances, sq)
		}
	}
	for name, cs := range s.carries {
		for _, c := range cs {
			if c.visible(s.now) {
				d.carries = append(d.carries, snapCarry{Name: name, Tokens: c.tokens, ExpiresUnixMs: c.expires, TemplateKeys: c.keys})
			}
		}
	}
	slices.SortFunc(d.carries, compareSnapCarry)
	for _, r := range s.idemQ[s.idemHead:] {
		if r.dead || s.now-r.at > 2*s.maxWindowMs {
			continue
		}
		d.idempotency = append(d.idempotency, snapIdem{Kind: r.key.kind, Region: r.key.region, RequestID: r.key.requestID, AtUnixMs: r.at, Acquire: r.acquire, Release: r.release})
	}
	members := make([]snapMember, 0, len(s.members))
	for id, addr := range s.members {
		members = append(members, snapMember{ID: id, APIAddress: addr})
	}
	slices.SortFunc(members, func(a, b snapMember) int { return strings.Compare(a.ID, b.ID) })
	d.header = snapshotHeader{
		Format:         SnapshotFormatV2,
		NowUnixMs:      s.now,
		TokensGranted:  s.tokensGranted,
		LastGrantIndex: s.lastGrantIndex,
		Policies:       len(d.policies),
		Quotas:         len(d.quotas),
		Instances:      len(d.instances),
		Carries:        len(d.carries),
		Idempotency:    len(d.idempotency),
		Members:        members,
		ClusterID:      s.clusterID,
	}
	return d
}

// snapQuota captures q's visible windows and fresh demand reports; it
// reports false when there are none.
func (s *state) snapQuota(q *quota) (snapQuota, bool) {
	sq := snapQuota{Name: q.name}
	for _, w := range q.windows {
		if !q.visible(w.index, s.now) {
			continue
		}
		sw := snapWindow{Index: w.index, Limit: w.limit, Carried: w.carried, Grants: make([]snapGrant, len(w.grants))}
		for i, g := range w.grants {
			sw.Grants[i] = snapGrant{ID: g.id, Region: g.region, Tokens: g.tokens, Released: g.released, GrantedUnixMs: g.grantedAt, ExpiresUnixMs: g.expires}
		}
		sq.Windows = append(sq.Windows, sw)
	}
	for r := range q.demand {
		if dm, fresh := q.freshDemand(r, s.now); fresh {
			sq.Demand = append(sq.Demand, snapDemand{Region: r, PerSecond: dm.rate, ReportedUnixMs: dm.at})
		}
	}
	slices.SortFunc(sq.Demand, func(a, b snapDemand) int { return strings.Compare(a.Region, b.Region) })
	return sq, len(sq.Windows) > 0 || len(sq.Demand) > 0
}

type fsmSnapshot struct {
	doc *snapshotDoc
}

// Persist writes the snapshot (format 2: the records, then the integrity
// trailer) and closes the sink, or cancels it on error.
func (fs *fsmSnapshot) Persist(sink raft.SnapshotSink) error {
	if err := fs.write(sink); err != nil {
		_ = sink.Cancel() // the write error is the one worth returning
		return fmt.Errorf("persist snapshot: %w", err)
	}
	if err := sink.Close(); err != nil {
		return fmt.Errorf("persist snapshot: close sink: %w", err)
	}
	return nil
}

func (fs *fsmSnapshot) write(w io.Writer) error {
	bw := bufio.NewWriterSize(w, 1<<16)
	sw := &sealWriter{w: bw}
	if err := fs.encode(json.NewEncoder(sw)); err != nil {
		return err
	}
	if _, err := bw.Write(appendTrailer(nil, sw.n, sw.crc)); err != nil {
		return err
	}
	return bw.Flush()
}

// encode writes the records of the snapshot, one per line.
func (fs *fsmSnapshot) encode(enc *json.Encoder) error {
	d := fs.doc
	if err := enc.Encode(d.header); err != nil {
		return err
	}
	for _, p := range d.policies {
		if err := enc.Encode(p); err != nil {
			return err
		}
	}
	for i := range d.quotas {
		if err := enc.Encode(&d.quotas[i]); err != nil {
			return err
		}
	}
	for i := range d.instances {
		if err := enc.Encode(&d.instances[i]); err != nil {
			return err
		}
	}
	for i := range d.carries {
		if err := enc.Encode(&d.carries[i]); err != nil {
			return err
		}
	}
	for i := range d.idempotency {
		if err := enc.Encode(&d.idempotency[i]); err != nil {
			return err
		}
	}
	return nil
}

// Release does nothing: the snapshot holds no resources.
func (fs *fsmSnapshot) Release() {}

// Restore replaces the whole state with a snapshot written by Persist (or
// by an older build, format 1) and closes rc. A snapshot that cannot be
// decoded, is inconsistent or does not match its integrity trailer returns
// an error wrapping ErrBadSnapshot and leaves the state as it was: the
// state is replaced only once the whole snapshot was read and checked.
func (f *FSM) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	s, err := readSnapshot(bufio.NewReaderSize(rc, 1<<16))
	if err != nil {
		return fmt.Errorf("restore: %w: %w", ErrBadSnapshot, err)
	}
	f.mu.Lock()
	f.s = s
	f.mu.Unlock()
	return nil
}

// SnapshotMembers reads the member table (Raft server ID to API address)
// and the cluster id from the header of a snapshot Persist wrote (either
// format), without reading or checking the rest: a hint of whom to ask,
// not state. It reads at most the header's first MB.
func SnapshotMembers(r io.Reader) (members map[string]string, clusterID string, err error) {
	var h snapshotHeader
	if err := json.NewDecoder(io.LimitReader(r, 1<<20)).Decode(&h); err != nil {
		return nil, "", fmt.Errorf("snapshot header: %w", err)
	}
	members = make(map[string]string, len(h.Members))
	for _, m := range h.Members {
		members[m.ID] = m.APIAddress
	}
	return members, h.ClusterID, nil
}

// readSnapshot decodes a snapshot of either format from br, whose buffer
// must hold more than trailerLen bytes.
func readSnapshot(br *bufio.Reader) (*state, error) {
	p, err := br.Peek(len(sealedPrefix))
	if err != nil && err != io.EOF {
		return nil, err
	}
	if string(p) != sealedPrefix {
		return decodeStream(br, SnapshotFormatV1)
	}
	sr := &sealedReader{r: br}
	s, err := decodeStream(sr, SnapshotFormatV2)
	// The trailer is checked even when the records were refused: damage is
	// the likelier cause, and the clearer error.
	if serr := sr.verify(); serr != nil {
		return nil, serr
	}
	return s, err
}

// decodeStream decodes the records of a snapshot of the given format,
// which must be all of r.
func decodeStream(r io.Reader, format int) (*state, error) {
	dec := json.NewDecoder(r)
	dec.DisallowUnknownFields()
	s, err := decodeSnapshot(dec, format)
	if err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("trailing data")
	}
	return s, nil
}

// decodeSnapshot rebuilds a state from the records of a snapshot of the
// given format, checking every invariant Apply maintains.
func decodeSnapshot(dec *json.Decoder, format int) (*state, error) {
	var h snapshotHeader
	if err := dec.Decode(&h); err != nil {
		return nil, fmt.Errorf("header: %w", err)
	}
	switch {
	case h.Format != SnapshotFormatV1 && h.Format != SnapshotFormatV2:
		return nil, fmt.Errorf("format %d unsupported", h.Format)
	case h.Format != format && format == SnapshotFormatV1:
		// Persist writes the header of format 2 as sealedPrefix.
		return nil, fmt.Errorf("format %d, but the snapshot does not begin with %s as format %[1]d does: damaged?", h.Format, sealedPrefix)
	case h.Format != format:
		return nil, fmt.Errorf("format %d in a snapshot that begins as format %d", h.Format, format)
	case h.NowUnixMs < 0 || h.NowUnixMs > MaxNowUnixMs:
		return nil, fmt.Errorf("now_unix_ms %d out of range", h.NowUnixMs)
	case h.TokensGranted < 0:
		return nil, fmt.Errorf("tokens_granted %d negative", h.TokensGranted)
	case h.Policies < 0 || h.Policies > HistoryVersions:
		return nil, fmt.Errorf("policies: %d versions, want 0 to %d", h.Policies, HistoryVersions)
	case h.Quotas < 0 || h.Quotas > MaxQuotas:
		return nil, fmt.Errorf("quotas: %d out of range", h.Quotas)
	case h.Instances < 0:
		return nil, fmt.Errorf("instances: %d out of range", h.Instances)
	case h.Carries < 0:
		return nil, fmt.Errorf("carries: %d out of range", h.Carries)
	case h.Idempotency < 0 || h.Idempotency > MaxIdempotencyRecords:
		return nil, fmt.Errorf("idempotency: %d records out of range", h.Idempotency)
	}
	s := newState()
	s.now, s.tokensGranted, s.lastGrantIndex = h.NowUnixMs, h.TokensGranted, h.LastGrantIndex
	if len(h.Members) > MaxMembers {
		return nil, fmt.Errorf("members: %d, at most %d", len(h.Members), MaxMembers)
	}
	for i, m := range h.Members {
		if i > 0 && m.ID <= h.Members[i-1].ID {
			return nil, fmt.Errorf("members[%d]: out of order", i)
		}
		if checkName("id", m.ID, MaxMemberIDBytes) != nil || checkName("api_address", m.APIAddress, MaxAPIAddressBytes) != nil {
			return nil, fmt.Errorf("members[%d]: out of range", i)
		}
		s.members[m.ID] = m.APIAddress
	}
	if h.ClusterID != "" {
		if err := checkClusterID(h.ClusterID); err != nil {
			return nil, err
		}
		s.clusterID = h.ClusterID
	}

	for i := range h.Policies {
		p := new(PolicyRecord)
		if err := dec.Decode(p); err != nil {
			return nil, fmt.Errorf("policies[%d]: %w", i, err)
		}
		if err := s.restorePolicy(p); err != nil {
			return nil, fmt.Errorf("policies[%d]: %w", i, err)
		}
	}
	if p := s.current(); p != nil {
		s.names = make([]string, len(p.Quotas))
		for i := range p.Quotas {
			spec := &p.Quotas[i]
			s.quotas[spec.Name] = &quota{name: spec.Name, spec: spec}
			s.names[i] = spec.Name
			s.maxWindowMs = max(s.maxWindowMs, spec.WindowMs)
			if spec.TemplateKeys > 0 {
				s.templates = append(s.templates, spec.Name)
			}
		}
	}

	prev := ""
	for i := range h.Quotas {
		var sq snapQuota
		if err := dec.Decode(&sq); err != nil {
			return nil, fmt.Errorf("quotas[%d]: %w", i, err)
		}
		if i > 0 && sq.Name <= prev {
			return nil, fmt.Errorf("quotas[%d]: %q out of order", i, sq.Name)
		}
		prev = sq.Name
		q, ok := s.quotas[sq.Name]
		if !ok {
			return nil, fmt.Errorf("quotas[%d]: %q not in the current policy", i, sq.Name)
		}
		if q.isTemplate() {
			return nil, fmt.Errorf("quotas[%d]: %q is a template, which has no windows", i, sq.Name)
		}
		if err := s.restoreQuota(q, sq); err != nil {
			return nil, fmt.Errorf("quotas[%d] %q: %w", i, sq.Name, err)
		}
	}
	if err := s.restoreInstances(dec, h.Instances); err != nil {
		return nil, err
	}
	if err := s.restoreCarries(dec, h.Carries); err != nil {
		return nil, err
	}

	var prevAt int64
	for i := range h.Idempotency {
		var si snapIdem
		if err := dec.Decode(&si); err != nil {
			return nil, fmt.Errorf("idempotency[%d]: %w", i, err)
		}
		if i > 0 && si.AtUnixMs < prevAt {
			return nil, fmt.Errorf("idempotency[%d]: out of order", i)
		}
		prevAt = si.AtUnixMs
		if err := s.restoreIdem(si); err != nil {
			return nil, fmt.Errorf("idempotency[%d]: %w", i, err)
		}
	}
	if s.idemGrants > MaxIdempotencyGrants {
		return nil, errors.New("idempotency: over the retention limits")
	}
	var held int64
	for _, ref := range s.grants {
		held += ref.g.tokens // order does not matter for a sum
	}
	if held > s.tokensGranted {
		return nil, fmt.Errorf("tokens_granted %d below the %d tokens of held grants", s.tokensGranted, held)
	}
	return s, nil
}

// restorePolicy checks p as Apply would have checked its Publish and
// appends it to the history.
func (s *state) restorePolicy(p *PolicyRecord) error {
	prev := p.Version - 1
	if cur := s.current(); cur != nil {
		prev = cur.Version
		if p.PublishedUnixMs < cur.PublishedUnixMs {
			return fmt.Errorf("published_unix_ms %d before the previous version's", p.PublishedUnixMs)
		}
	}
	if p.Version == 0 {
		return errors.New("version 0")
	}
	if p.PublishedUnixMs < 0 || p.PublishedUnixMs > s.now {
		return fmt.Errorf("published_unix_ms %d out of range", p.PublishedUnixMs)
	}
	pub := Publish{ExpectedVersion: p.Version, Author: p.Author, Reason: p.Reason, Document: p.Document, Quotas: p.Quotas}
	specs, err := validatePublish(&pub, prev)
	if err != nil {
		return err
	}
	for j := range specs { // stored specs must already be normalized
		if !specEqual(specs[j], p.Quotas[j]) {
			return fmt.Errorf("quotas[%d]: not in canonical form", j)
		}
	}
	p.Digest = documentDigest(p.Document) // not in the snapshot
	var maxW int64
	for _, q := range p.Quotas {
		maxW = max(maxW, q.WindowMs)
	}
	s.history = append(s.history, p)
	s.historyWindowMs = append(s.historyWindowMs, maxW)
	return nil
}

// validGrantID reports whether id has the form grantID writes, for a log
// index no later than last.
func validGrantID(id string, last uint64) bool {
	idx, want, ok := strings.Cut(id, "-")
	if !ok || len(id) > MaxGrantIDBytes {
		return false
	}
	i, err := strconv.ParseUint(idx, 10, 64)
	if err != nil || i > last || strconv.FormatUint(i, 10) != idx {
		return false
	}
	w, err := strconv.Atoi(want)
	// A batch entry numbers the wants of all its Acquires in one sequence.
	return err == nil && w >= 0 && w < MaxWants*MaxBatch && strconv.Itoa(w) == want
}

func specEqual(a, b QuotaSpec) bool {
	if !slices.Equal(a.Regions, b.Regions) || (a.Regions == nil) != (b.Regions == nil) {
		return false
	}
	return a.Name == b.Name && a.Limit == b.Limit && a.WindowMs == b.WindowMs &&
		a.ChunkTokens == b.ChunkTokens && a.TTLMs == b.TTLMs && a.Clamp == b.Clamp &&
		a.Strategy == b.Strategy && a.FallbackPerRegion == b.FallbackPerRegion && a.MaxHeldPerRegion == b.MaxHeldPerRegion &&
		a.TemplateKeys == b.TemplateKeys
}

func (s *state) restoreQuota(q *quota, sq snapQuota) error {
	cur := q.currentIndex(s.now)
	for i, sw := range sq.Windows {
		if sw.Index > cur+1 || !q.visible(sw.Index, s.now) {
			return fmt.Errorf("windows[%d]: index %d is not the previous, current or next window", i, sw.Index)
		}
		if i > 0 && sw.Index <= sq.Windows[i-1].Index {
			return fmt.Errorf("windows[%d]: out of order", i)
		}
		if sw.Limit < 1 || sw.Limit > MaxLimit {
			return fmt.Errorf("windows[%d]: limit %d out of range", i, sw.Limit)
		}
		if sw.Carried < 0 || sw.Carried > MaxLimit {
			return fmt.Errorf("windows[%d]: carried %d out of range", i, sw.Carried)
		}
		w := &window{index: sw.Index, limit: sw.Limit, carried: sw.Carried}
		for j, sg := range sw.Grants {
			switch {
			case !validGrantID(sg.ID, s.lastGrantIndex):
				return fmt.Errorf("windows[%d].grants[%d]: id %q is not <index>-<want> with index <= last_grant_index", i, j, sg.ID)
			case s.grants[sg.ID] != nil:
				return fmt.Errorf("windows[%d].grants[%d]: id %q repeated", i, j, sg.ID)
			case sg.Region == "" || len(sg.Region) > MaxRegionBytes:
				return fmt.Errorf("windows[%d].grants[%d]: bad region", i, j)
			case sg.Tokens < 1 || sg.Tokens > MaxLimit || sg.Released < 0 || sg.Released > sg.Tokens:
				return fmt.Errorf("windows[%d].grants[%d]: tokens %d released %d out of range", i, j, sg.Tokens, sg.Released)
			case sg.GrantedUnixMs > s.now || sg.ExpiresUnixMs < sg.GrantedUnixMs:
				return fmt.Errorf("windows[%d].grants[%d]: times out of range", i, j)
			}
			g := &grant{id: sg.ID, region: sg.Region, tokens: sg.Tokens, released: sg.Released, grantedAt: sg.GrantedUnixMs, expires: sg.ExpiresUnixMs}
			w.add(g)
			// What is outstanding never exceeds a limit (every grant is
			// capped by the pool), whatever the running totals: released
			// tokens granted again count twice in granted.
			if w.granted-w.released > MaxLimit {
				return fmt.Errorf("windows[%d]: %d tokens outstanding, beyond any limit", i, w.granted-w.released)
			}
			s.grants[g.id] = &grantRef{q: q, w: w, g: g}
		}
		q.windows = append(q.windows, w)
		s.windows++
	}
	for i, sd := range sq.Demand {
		if i > 0 && sd.Region <= sq.Demand[i-1].Region {
			return fmt.Errorf("demand[%d]: out of order", i)
		}
		if sd.Region == "" || len(sd.Region) > MaxRegionBytes || !(sd.PerSecond >= 0) || sd.ReportedUnixMs > s.now {
			return fmt.Errorf("demand[%d]: out of range", i)
		}
		if q.demand == nil {
			q.demand = map[string]demand{}
		}
		q.demand[sd.Region] = demand{rate: sd.PerSecond, at: sd.ReportedUnixMs}
		if _, fresh := q.freshDemand(sd.Region, s.now); !fresh {
			return fmt.Errorf("demand[%d]: stale report", i)
		}
	}
	if len(q.windows) == 0 && len(q.demand) == 0 {
		return errors.New("neither windows nor demand")
	}
	return nil
}

// restoreInstances reads n instances of the current policy's templates, in
// name order, and rebuilds each template's list in order of death.
func (s *state) restoreInstances(dec *json.Decoder, n int) error {
	prev := ""
	for i := range n {
		var sq snapQuota
		if err := dec.Decode(&sq); err != nil {
			return fmt.Errorf("instances[%d]: %w", i, err)
		}
		if i > 0 && sq.Name <= prev {
			return fmt.Errorf("instances[%d]: %q out of order", i, sq.Name)
		}
		prev = sq.Name
		if len(sq.Name) > MaxQuotaNameBytes {
			return fmt.Errorf("instances[%d]: name of %d bytes, at most %d", i, len(sq.Name), MaxQuotaNameBytes)
		}
		q, t, err := s.lookupQuota(sq.Name, s.now)
		switch {
		case err != nil:
			return fmt.Errorf("instances[%d] %w", i, err)
		case t == nil || q != nil: // a single pool, or a name seen before
			return fmt.Errorf("instances[%d]: %q is not a new instance of a template", i, sq.Name)
		case len(t.instances) >= s.maxInstances:
			return fmt.Errorf("instances[%d]: template %q over %d instances", i, t.name, s.maxInstances)
		}
		in := s.newInstance(t, sq.Name)
		if err := s.restoreQuota(in, sq); err != nil {
			return fmt.Errorf("instances[%d] %q: %w", i, sq.Name, err)
		}
		if in.death = in.computeDeath(); !in.alive(s.now) {
			return fmt.Errorf("instances[%d] %q: holds nothing visible", i, sq.Name)
		}
	}
	for _, name := range s.templates {
		t := s.quotas[name]
		t.relink(t.instanceList(), s.now)
	}
	return nil
}

// restoreCarries reads n visible carry steps, in name, keys and expiry
// order.
func (s *state) restoreCarries(dec *json.Decoder, n int) error {
	var prev snapCarry
	for i := range n {
		var sc snapCarry
		if err := dec.Decode(&sc); err != nil {
			return fmt.Errorf("carries[%d]: %w", i, err)
		}
		switch {
		case i > 0 && compareSnapCarry(sc, prev) <= 0:
			return fmt.Errorf("carries[%d]: %q out of order or repeated", i, sc.Name)
		case checkName("name", sc.Name, MaxQuotaNameBytes) != nil:
			return fmt.Errorf("carries[%d]: bad name", i)
		case sc.Tokens < 1 || sc.Tokens > MaxLimit:
			return fmt.Errorf("carries[%d]: tokens %d out of range", i, sc.Tokens)
		// A grant expires at most a TTL after the start of the window
		// after the one it was made in; no window reaches back further
		// than MaxWindowMs.
		case !(carry{expires: sc.ExpiresUnixMs}).visible(s.now) || sc.ExpiresUnixMs > s.now+2*MaxWindowMs:
			return fmt.Errorf("carries[%d]: expires_unix_ms %d out of range", i, sc.ExpiresUnixMs)
		case sc.TemplateKeys < 0 || sc.TemplateKeys > MaxTemplateKeys:
			return fmt.Errorf("carries[%d]: template_keys %d out of range", i, sc.TemplateKeys)
		}
		prev = sc
		s.carries[sc.Name] = append(s.carries[sc.Name], carry{keys: sc.TemplateKeys, tokens: sc.Tokens, expires: sc.ExpiresUnixMs})
	}
	return nil
}

func (s *state) restoreIdem(si snapIdem) error {
	if err := checkName("region", si.Region, MaxRegionBytes); err != nil {
		return err
	}
	if err := checkName("request_id", si.RequestID, MaxRequestIDBytes); err != nil {
		return err
	}
	switch {
	case si.Kind == idemAcquire && si.Acquire != nil && si.Release == nil:
		if len(si.Acquire.Grants) < 1 || len(si.Acquire.Grants) > MaxWants {
			return errors.New("acquire result: bad grant count")
		}
	case si.Kind == idemRelease && si.Release != nil && si.Acquire == nil:
	default:
		return fmt.Errorf("kind %d does not match its result", si.Kind)
	}
	if si.AtUnixMs > s.now || s.now-si.AtUnixMs > 2*s.maxWindowMs {
		return fmt.Errorf("at_unix_ms %d outside retention", si.AtUnixMs)
	}
	r := &idemRecord{key: idemKey{kind: si.Kind, region: si.Region, requestID: si.RequestID}, at: si.AtUnixMs, acquire: si.Acquire, release: si.Release}
	if r.acquire != nil && r.acquire.Replayed || r.release != nil && r.release.Replayed {
		return errors.New("recorded result marked replayed")
	}
	if _, dup := s.idem[r.key]; dup {
		return errors.New("request id repeated")
	}
	if len(s.idem) >= MaxIdempotencyRecords {
		return errors.New("over the retention limits")
	}
	s.record(r)
	return nil
}

// compareSnapCarry orders a snapshot's carries by name, then TemplateKeys,
// then expiry.
func compareSnapCarry(a, b snapCarry) int {
	return cmp.Or(strings.Compare(a.Name, b.Name), cmp.Compare(a.TemplateKeys, b.TemplateKeys), cmp.Compare(a.ExpiresUnixMs, b.ExpiresUnixMs))
}

// sealedPrefix is how every snapshot of format 2 begins: its header, the
// format first (snapshotHeader's first field).
const sealedPrefix = `{"format":2,`

// trailerLen is the length of the integrity trailer: the last line of a
// snapshot of format 2.
const trailerLen = len(`{"length":"`) + 20 + len(`","crc32c":"`) + 8 + len(`"}`+"\n")

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// appendTrailer appends the integrity trailer of n bytes whose CRC-32C is
// crc to b.
func appendTrailer(b []byte, n int64, crc uint32) []byte {
	return fmt.Appendf(b, `{"length":"%020d","crc32c":"%08x"}`+"\n", n, crc)
}

// parseTrailer reads a trailer written by appendTrailer, and reports
// whether b has its form.
func parseTrailer(b []byte) (n int64, crc uint32, ok bool) {
	rest, ok1 := bytes.CutPrefix(b, []byte(`{"length":"`))
	digits, rest, ok2 := bytes.Cut(rest, []byte(`","crc32c":"`))
	hex, ok3 := bytes.CutSuffix(rest, []byte(`"}`+"\n"))
	if !ok1 || !ok2 || !ok3 || len(digits) != 20 || len(hex) != 8 ||
		bytes.ContainsFunc(digits, func(r rune) bool { return r < '0' || r > '9' }) ||
		bytes.ContainsFunc(hex, func(r rune) bool { return (r < '0' || r > '9') && (r < 'a' || r > 'f') }) {
		return 0, 0, false
	}
	n, err1 := strconv.ParseInt(string(digits), 10, 64)
	c, err2 := strconv.ParseUint(string(hex), 16, 32)
	return n, uint32(c), err1 == nil && err2 == nil
}

// sealWriter counts the bytes written through it and their CRC-32C.
type sealWriter struct {
	w   io.Writer
	n   int64
	crc uint32
}

func (s *sealWriter) Write(p []byte) (int, error) {
	n, err := s.w.Write(p)
	s.n += int64(n)
	s.crc = crc32.Update(s.crc, castagnoli, p[:n])
	return n, err
}

// sealedReader reads a snapshot of format 2 but for its last trailerLen
// bytes, the trailer, which it keeps back, and counts the bytes it passes
// on and their CRC-32C. It keeps no more than r's buffer.
type sealedReader struct {
	r    *bufio.Reader
	n    int64
	crc  uint32
	tail []byte // at the end: the last bytes, up to trailerLen
	done bool
}

func (s *sealedReader) Read(p []byte) (int, error) {
	if s.done {
		return 0, io.EOF
	}
	if len(p) == 0 {
		return 0, nil
	}
	// Peek returns fewer bytes than asked only with an error, never
	// ErrBufferFull: the buffer holds more than trailerLen bytes.
	b, err := s.r.Peek(min(len(p), s.r.Size()-trailerLen) + trailerLen)
	if len(b) > trailerLen {
		n := copy(p, b[:len(b)-trailerLen])
		s.n += int64(n)
		s.crc = crc32.Update(s.crc, castagnoli, p[:n])
		_, _ = s.r.Discard(n) // buffered: cannot fail
		return n, nil
	}
	if err == io.EOF {
		s.done, s.tail = true, bytes.Clone(b)
	}
	return 0, err
}

// verify reads the rest of the snapshot and checks it against its trailer.
func (s *sealedReader) verify() error {
	if _, err := io.Copy(io.Discard, s); err != nil {
		return err
	}
	if bytes.Equal(s.tail, appendTrailer(nil, s.n, s.crc)) {
		return nil
	}
	n, crc, ok := parseTrailer(s.tail)
	if !ok {
		return errors.New("integrity check failed: the snapshot does not end with an integrity trailer (truncated or damaged)")
	}
	return fmt.Errorf("integrity check failed: the trailer records %d bytes with CRC-32C %08x, but the %d bytes before it have CRC-32C %08x", n, crc, s.n, s.crc)
}
