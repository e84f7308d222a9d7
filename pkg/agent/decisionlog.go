package agent

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"hash/fnv"
	"math"
	"slices"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/allot-dev/allot/pkg/policy"
)

// decisionLog writes a sample of decisions, off the decision's result (it
// never changes a verdict). The sample is chosen by a hash of the decision
// id, so it is unbiased and needs no random source. Descriptor values are
// logged as salted hashes except for the keys configured to stay in clear
// (tenant, route, auth by default): user ids and addresses never appear.
// Logs are telemetry, not a ledger: they may drop lines.
type decisionLog struct {
	zl        *zap.Logger
	threshold uint64 // log when hash(id) < threshold
	all       bool
	salt      []byte
	clear     []string
}

func newDecisionLog(log *zap.Logger, sample float64, salt string, clear []string) *decisionLog {
	d := &decisionLog{zl: log, salt: []byte(salt), clear: slices.Clone(clear)}
	switch {
	case sample >= 1:
		d.all = true
	case sample > 0:
		d.threshold = uint64(sample * math.MaxUint64)
	}
	return d
}

// sampled reports whether the decision with id is in the sample.
func (d *decisionLog) sampled(id string) bool {
	if d.all {
		return true
	}
	if d.threshold == 0 {
		return false
	}
	h := fnv.New64a()
	_, _ = h.Write([]byte(id))
	return h.Sum64() < d.threshold
}

// hash returns the salted hash of a descriptor value (16 hex digits).
func (d *decisionLog) hash(key, value string) string {
	m := hmac.New(sha256.New, d.salt)
	m.Write([]byte(key))
	m.Write([]byte{0})
	m.Write([]byte(value))
	return hex.EncodeToString(m.Sum(nil)[:8])
}

// entries is the zap encoding of descriptors with principals hashed.
type entries struct {
	d  *decisionLog
	es []policy.Entry
}

// MarshalLogObject implements zapcore.ObjectMarshaler.
func (e entries) MarshalLogObject(enc zapcore.ObjectEncoder) error {
	for _, en := range e.es {
		if slices.Contains(e.d.clear, en.Key) {
			enc.AddString(en.Key, en.Value)
		} else {
			enc.AddString(en.Key, "#"+e.d.hash(en.Key, en.Value))
		}
	}
	return nil
}

func (d *decisionLog) log(v *Verdict, in *Input) {
	if !d.sampled(v.DecisionID) || !d.zl.Core().Enabled(zapcore.InfoLevel) {
		return
	}
	fields := []zap.Field{
		zap.String("decision_id", v.DecisionID),
		zap.Uint64("policy_version", v.PolicyVersion),
		zap.String("verdict", v.verdictName()),
		zap.String("rule", v.Rule),
		zap.String("scope", string(v.Scope)),
		zap.Int64("remaining", v.Remaining),
		zap.String("source", v.Source.String()),
		zap.Object("descriptors", entries{d: d, es: in.Descriptors}),
	}
	if !v.Allowed {
		fields = append(fields, zap.Int64("retry_after", v.RetryAfter))
	}
	if in.Cost > 1 {
		fields = append(fields, zap.Int64("cost", in.Cost))
	}
	if len(v.WouldDeny) > 0 {
		fields = append(fields, zap.Strings("would_deny", v.WouldDeny))
	}
	if v.Waited > 0 {
		fields = append(fields, zap.Duration("waited", v.Waited))
	}
	d.zl.Info("decision", fields...)
}
