package allocator

import (
	"context"
	"fmt"

	"connectrpc.com/connect"

	"github.com/allot-dev/allot/fsm"
	"github.com/allot-dev/allot/pkg/bound"
	"github.com/allot-dev/allot/pkg/policy"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

func windowToProto(quota string, w fsm.WindowView, now int64) *allotv1.GetWindowResponse {
	out := &allotv1.GetWindowResponse{
		Quota: quota, WindowIndex: w.Index, WindowStartUnixMs: w.StartUnixMs, WindowEndUnixMs: w.EndUnixMs,
		Limit: w.Limit, Granted: w.Granted, Released: w.Released, Expired: w.Expired, Remaining: w.Remaining,
		NowUnixMs: now, Carried: w.Carried,
	}
	for _, r := range w.Regions {
		out.Regions = append(out.Regions, &allotv1.RegionLedger{
			Region: r.Region, Granted: r.Granted, Released: r.Released, Expired: r.Expired,
			Held: r.Outstanding - r.Expired, DemandPerSecond: r.DemandPerSecond, Grants: int64(r.Grants),
		})
	}
	for _, g := range w.Grants {
		out.Grants = append(out.Grants, &allotv1.GrantRecord{
			GrantId: g.ID, Region: g.Region, Tokens: g.Tokens, Released: g.Released,
			GrantedUnixMs: g.GrantedUnixMs, ExpiresUnixMs: g.ExpiresUnixMs,
		})
	}
	return out
}

// BoundConfig returns the bound calculator's assumptions of this node's
// configuration (the quota fields are filled per quota).
func (c Config) BoundConfig() bound.Config {
	b := bound.DefaultConfig()
	b.QuorumCommit = true // grants are acknowledged only after a quorum commit
	b.ExpiryMargin = c.LeaseMargin
	b.MaxDriftPPM = c.MaxDriftPPM
	b.MaxOneWayDelay = c.MaxOneWayDelay
	b.MaxLeaderSkew = c.MaxLeaderSkew
	b.StoreAsyncFailover = c.StoreAsyncFailover
	b.StoreReplicationLag = c.StoreReplicationLag
	b.Gateways = c.GatewaysPerRegion
	return b
}

// GetBound implements OperatorService.GetBound from the current policy and
// the leader's stated assumptions (answered by the leader after a Raft
// barrier, so it is the bound of the latest policy).
func (s *Server) GetBound(ctx context.Context, req *connect.Request[allotv1.GetBoundRequest]) (*connect.Response[allotv1.GetBoundResponse], error) {
	const method = "GetBound"
	// No quota's name is longer (an instance's included): refusing a longer
	// one here keeps it out of the NotFound message.
	if name := req.Msg.GetQuota(); len(name) > fsm.MaxQuotaNameBytes {
		return nil, s.toConnect(method, fmt.Errorf("quota: %d bytes, at most %d: %w", len(name), fsm.MaxQuotaNameBytes, errInvalid))
	}
	if resp, handled, err := leaderRead(ctx, s, req, func(c *peerClient) func(context.Context, *connect.Request[allotv1.GetBoundRequest]) (*connect.Response[allotv1.GetBoundResponse], error) {
		return c.op.GetBound
	}); handled {
		if err != nil {
			return nil, s.toConnect(method, err)
		}
		return resp, nil
	}
	rec, ok := s.node.fsm.Policy()
	if !ok {
		return nil, s.toConnect(method, fmt.Errorf("no policy has been published yet: %w", errNotFound))
	}
	doc, err := policy.Parse(rec.Document)
	if err != nil {
		return nil, s.toConnect(method, fmt.Errorf("stored policy version %d: %v", rec.Version, err))
	}
	out := &allotv1.GetBoundResponse{PolicyVersion: rec.Version}
	base := s.node.cfg.BoundConfig()
	if name := req.Msg.GetQuota(); name != "" {
		// One pool: a single pool, a template (the bound of each of its
		// instances), or an instance (its template's bound, under its name).
		q, ok := doc.Quota(name)
		if !ok {
			return nil, s.toConnect(method, fmt.Errorf("quota %q: %w", name, fsm.ErrUnknownQuota))
		}
		out.Bounds = append(out.Bounds, boundToProto(bound.Calculate(base.WithQuota(q))))
	} else {
		for _, q := range doc.GlobalQuotas() {
			out.Bounds = append(out.Bounds, boundToProto(bound.Calculate(base.WithQuota(q))))
		}
	}
	s.metrics.Requests.WithLabelValues(method, "ok").Inc()
	return connect.NewResponse(out), nil
}

func boundToProto(b bound.Bound) *allotv1.QuotaBound {
	out := &allotv1.QuotaBound{
		Quota: b.Name, Limit: b.Limit, WindowMs: b.Window.Milliseconds(), Overshoot: b.Total,
		MaxAdmittedPerWindow: b.Ceiling(), StrandedTokens: b.Stranded.Fleet, StrandedAssumption: b.Stranded.Assumption,
		StrandedParkedTokens: b.Stranded.Parked,
	}
	for _, t := range b.Terms {
		out.Terms = append(out.Terms, &allotv1.BoundTerm{Name: t.Name, Tokens: t.Tokens, Assumption: t.Assumption, HowToZero: t.HowToZero})
	}
	return out
}
