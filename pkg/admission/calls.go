package admission

import (
	"time"
)

// ScriptCalls returns the store calls Decide would make for req that go to
// the script (gateway-local chunks excluded), without making them. The
// benchmarks use it to run the very same script directly through go-redis.
func (e *Engine) ScriptCalls(req *Request) ([]ScriptCall, error) {
	snap := e.snap.Load()
	items, _, err := e.plan(snap, req, nil, nil)
	if err != nil {
		return nil, err
	}
	id := e.newID()
	member := req.RequestID
	if member == "" {
		member = id
	}
	rs, _ := e.store.(*RedisStore)
	text := rs != nil && rs.cfg.StateForm == StateText
	var out []ScriptCall
	for _, g := range groupItems(nil, items) {
		if g.local {
			continue
		}
		o := e.decideOp(&g, items, req, id, member, time.Time{})
		o.now = 0
		out = append(out, ScriptCall{Keys: o.keys, Args: o.args(text)})
	}
	return out, nil
}
