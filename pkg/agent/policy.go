package agent

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"connectrpc.com/connect"
	"go.uber.org/zap"

	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/pkg/policy"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// lkgFile is the name of the last-known-good policy in Config.DataDir.
const lkgFile = "policy.json"

// lkg is the persisted last-known-good policy: the allocator's record as
// received, so that it is checked again (digest, parse) when loaded.
//
// Document is the document's bytes in base64 (a JSON string), so that they
// come back exactly as published whatever they hold: the digest is over
// those bytes. Earlier builds wrote the document's JSON itself there, which
// encoding/json re-escaped (<, > and & as \u003c, \u003e and \u0026), so a
// document with those characters failed its own digest when loaded; such a
// file still loads (see decodeLKG).
//
// Sum covers what the digest does not: the version, with the digest (which
// covers the document). Without it a damaged version byte loaded as another
// version: a lower one put the record in force under a number it was never
// published as, and a higher one made the agent reject the allocator's
// next versions as older. Files of earlier builds have no sum and load
// without that check.
type lkg struct {
	Version  uint64          `json:"version"`
	Digest   string          `json:"digest"`
	Document json.RawMessage `json:"document"`
	SavedMs  int64           `json:"saved_unix_ms"`
	Sum      string          `json:"sum,omitempty"`
}

// lkgSum is the Sum of a last-known-good file of version and digest.
func lkgSum(version uint64, digest string) string {
	s := sha256.Sum256(fmt.Appendf(nil, "allot last-known-good policy\x00%d\x00%s", version, digest))
	return hex.EncodeToString(s[:])
}

// record is a policy version checked and parsed.
type record struct {
	version uint64
	digest  string
	raw     []byte
	doc     *policy.Document
}

// checkRecord verifies a published policy record: its digest is the
// SHA-256 of the document, and the document parses and validates.
func checkRecord(version uint64, digest string, document []byte) (*record, error) {
	if version == 0 {
		return nil, fmt.Errorf("version: 0 is not a published version: %w", ErrPolicyRejected)
	}
	sum := sha256.Sum256(document)
	if got := hex.EncodeToString(sum[:]); digest == "" || got != digest {
		return nil, fmt.Errorf("digest: document hashes to %.12s, record says %.12q: %w", got, digest, ErrPolicyRejected)
	}
	doc, err := policy.Parse(document)
	if err != nil {
		return nil, fmt.Errorf("document: %w: %w", ErrPolicyRejected, err)
	}
	return &record{version: version, digest: digest, raw: document, doc: doc}, nil
}

// loadLKG reads the last-known-good policy from dir; it returns nil, nil
// when there is none.
func loadLKG(dir string) (*record, error) {
	if dir == "" {
		return nil, nil
	}
	b, err := os.ReadFile(filepath.Join(dir, lkgFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("last-known-good policy: %w", err)
	}
	rec, err := decodeLKG(b)
	if err != nil {
		return nil, fmt.Errorf("last-known-good policy %s: %w", filepath.Join(dir, lkgFile), err)
	}
	return rec, nil
}

// decodeLKG checks and parses the contents of a last-known-good file: its
// sum when it has one, then the document in base64, or in the earlier
// form, its JSON itself. The earlier form was written re-escaped (see lkg):
// when its bytes do not match the digest, they are tried with <, > and &
// restored, which the digest then confirms or refutes.
func decodeLKG(b []byte) (*record, error) {
	var f lkg
	if err := json.Unmarshal(b, &f); err != nil {
		return nil, err
	}
	if f.Sum != "" && f.Sum != lkgSum(f.Version, f.Digest) {
		// (No sum at all: a file of an earlier build.)
		return nil, fmt.Errorf("version %d and digest %.12q do not match the file's sum (a damaged file): %w", f.Version, f.Digest, ErrPolicyRejected)
	}
	doc := []byte(f.Document)
	if len(doc) > 0 && doc[0] == '"' {
		var raw []byte
		if err := json.Unmarshal(doc, &raw); err != nil {
			return nil, fmt.Errorf("document: %w", err)
		}
		return checkRecord(f.Version, f.Digest, raw)
	}
	rec, err := checkRecord(f.Version, f.Digest, doc)
	if err != nil && bytes.Contains(doc, []byte(`\u00`)) {
		if r, rerr := checkRecord(f.Version, f.Digest, []byte(htmlUnescaper.Replace(string(doc)))); rerr == nil {
			return r, nil
		}
	}
	return rec, err
}

// htmlUnescaper undoes encoding/json's HTML escaping of a document it
// re-encoded.
var htmlUnescaper = strings.NewReplacer(`\u003c`, "<", `\u003e`, ">", `\u0026`, "&")

// saveLKG writes rec to dir atomically: a temporary file, fsync, rename,
// fsync of the directory. A crash leaves the old file or the new one.
func saveLKG(dir string, rec *record, now time.Time) error {
	if dir == "" {
		return nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	doc, err := json.Marshal(rec.raw) // base64
	if err != nil {
		return err
	}
	b, err := json.Marshal(lkg{Version: rec.version, Digest: rec.digest, Document: doc, SavedMs: now.UnixMilli(),
		Sum: lkgSum(rec.version, rec.digest)})
	if err != nil {
		return err
	}
	// What is renamed into place must load: a file that fails its own
	// digest would leave a restarted agent without a policy.
	if _, err := decodeLKG(b); err != nil {
		return fmt.Errorf("last-known-good policy would not load back: %w", err)
	}
	tmp, err := os.CreateTemp(dir, lkgFile+".*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), filepath.Join(dir, lkgFile)); err != nil {
		return err
	}
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// watcher follows the allocator's policy: it reads the current version and
// hands it to sync, then streams the versions after the one sync returns,
// and hands each to apply. It reconnects with backoff (through another
// endpoint when the client's failover picks one).
type watcher struct {
	client  *allocator.Client
	log     *zap.Logger
	backoff time.Duration
	max     time.Duration
	// sync takes the allocator's current record as GetPolicy, a leader
	// read, answered it (nil: none published yet); it returns the version
	// to watch after, and whether the first record streamed is to be
	// adopted (Agent.syncRecord).
	sync func(*allotv1.PolicyRecord) (after uint64, adopt bool)
	// apply takes a record of the stream: a newer version, or rejected.
	apply func(*allotv1.PolicyRecord)
	// adopt takes a record of the stream whatever its version, and
	// reports whether it is in force.
	adopt func(*allotv1.PolicyRecord) bool
}

// Run follows the policy until ctx ends.
func (w *watcher) Run(ctx context.Context) error {
	pause := w.backoff
	for {
		lasted, err := w.once(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if lasted >= w.max {
			// The stream had been up for a while: this break is a new one
			// (a leader change, a restart), not more of the same outage, so
			// the pause starts again from the first. once always ends with
			// an error (a stream that ends is one), so without this the
			// pause would stay at its maximum after a few breaks over days;
			// a stream that keeps breaking at once still backs off.
			pause = w.backoff
		}
		w.log.Warn("policy watch interrupted; retrying", zap.Error(err), zap.Duration("in", pause))
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(pause):
		}
		pause = min(2*pause, w.max)
	}
}

// once reads the current policy (unary, with failover, which also moves
// the client to a live endpoint) and then streams newer versions until the
// stream ends. It reports how long the stream was open (0 when it did not
// open).
func (w *watcher) once(ctx context.Context) (lasted time.Duration, err error) {
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	cur, err := w.client.Operator().GetPolicy(cctx, &allotv1.GetPolicyRequest{})
	cancel()
	var (
		after uint64
		adopt bool
	)
	switch {
	case err == nil && cur.GetPolicy() == nil:
		// Not to be taken for "none published" (sync acts on that).
		return 0, errors.New("get policy: an answer without a record")
	case err == nil:
		after, adopt = w.sync(cur.GetPolicy())
	case connect.CodeOf(err) == connect.CodeNotFound:
		// nothing published yet: the watch will bring the first version
		after, adopt = w.sync(nil)
	default:
		return 0, fmt.Errorf("get policy: %w", err)
	}
	stream, err := w.client.Operator().WatchPolicy(ctx, after)
	if err != nil {
		return 0, fmt.Errorf("watch policy: %w", err)
	}
	defer stream.Close()
	opened := time.Now()
	for stream.Receive() {
		if adopt {
			adopt = !w.adopt(stream.Msg().GetPolicy())
			continue
		}
		w.apply(stream.Msg().GetPolicy())
	}
	if err := stream.Err(); err != nil {
		return time.Since(opened), fmt.Errorf("watch policy: %w", err)
	}
	return time.Since(opened), errors.New("watch policy: stream ended")
}
