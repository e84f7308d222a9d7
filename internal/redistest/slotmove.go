package redistest

import (
	"context"
	"fmt"
	"net"
)

// SlotMove is a cluster slot caught halfway through a move from one master
// to another, as `redis-cli --cluster reshard` leaves it between its steps:
// MIGRATING on Src, IMPORTING on Dst, some of its keys already on Dst. A
// command on several of the slot's keys, some moved and some not, is then
// refused by Src with TRYAGAIN.
type SlotMove struct {
	Src, Dst     *Server
	Slot         int64
	srcID, dstID string
}

// StartMove begins moving key's slot from the master that serves it to
// another one, and migrates the given keys of that slot.
func (c *Cluster) StartMove(ctx context.Context, key string, migrate ...string) (*SlotMove, error) {
	m := &SlotMove{}
	for _, n := range c.Nodes {
		if _, err := n.do(ctx, "EXISTS", key); err == nil {
			m.Src = n // the others answer MOVED
		} else if m.Dst == nil {
			m.Dst = n
		}
	}
	if m.Src == nil || m.Dst == nil {
		return nil, fmt.Errorf("redistest: no master serves %q, or no other master", key)
	}
	slot, err := m.Src.do(ctx, "CLUSTER", "KEYSLOT", key)
	if err != nil {
		return nil, err
	}
	m.Slot = slot.(int64)
	if m.srcID, err = m.Src.myID(ctx); err != nil {
		return nil, err
	}
	if m.dstID, err = m.Dst.myID(ctx); err != nil {
		return nil, err
	}
	if _, err := m.Dst.do(ctx, "CLUSTER", "SETSLOT", m.Slot, "IMPORTING", m.srcID); err != nil {
		return nil, err
	}
	if _, err := m.Src.do(ctx, "CLUSTER", "SETSLOT", m.Slot, "MIGRATING", m.dstID); err != nil {
		return nil, err
	}
	return m, m.Migrate(ctx, migrate...)
}

// Migrate moves keys of the slot from Src to Dst.
func (m *SlotMove) Migrate(ctx context.Context, keys ...string) error {
	host, port, err := net.SplitHostPort(m.Dst.Addr())
	if err != nil {
		return err
	}
	for _, k := range keys {
		if _, err := m.Src.do(ctx, "MIGRATE", host, port, k, 0, 5000); err != nil {
			return err
		}
	}
	return nil
}

// Finish migrates the slot's remaining keys and gives the slot to Dst on
// both masters; the third learns it from them.
func (m *SlotMove) Finish(ctx context.Context, rest ...string) error {
	if err := m.Migrate(ctx, rest...); err != nil {
		return err
	}
	for _, n := range []*Server{m.Dst, m.Src} {
		if _, err := n.do(ctx, "CLUSTER", "SETSLOT", m.Slot, "NODE", m.dstID); err != nil {
			return err
		}
	}
	return nil
}

// do runs one command on s alone (a cluster node answers MOVED for another
// node's keys).
func (s *Server) do(ctx context.Context, args ...any) (any, error) {
	c := s.Client()
	defer c.Close()
	v, err := c.Do(ctx, args...).Result()
	if err != nil {
		return nil, fmt.Errorf("redistest: %v on %s: %w", args, s.Addr(), err)
	}
	return v, nil
}

func (s *Server) myID(ctx context.Context) (string, error) {
	v, err := s.do(ctx, "CLUSTER", "MYID")
	if err != nil {
		return "", err
	}
	id, _ := v.(string)
	return id, nil
}
