package recovery

import (
	"context"
	"net/netip"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/restore"
)

// HostNetwork is Network on the calling thread's network namespace, on interface Iface whose addresses
// have prefix length Bits.
type HostNetwork struct {
	Iface string
	Bits  int
}

func (n HostNetwork) Guard(ctx context.Context, runID string, conns []ckpt.Conn) error {
	return restore.Guard(ctx, runID, conns)
}

func (n HostNetwork) Unguard(ctx context.Context, runID string) { restore.Unguard(ctx, runID) }

func (n HostNetwork) TakeOver(ip netip.Addr) error {
	return restore.TakeOver(n.Iface, netip.PrefixFrom(ip, n.Bits))
}

func (n HostNetwork) Release(ip netip.Addr) { restore.Release(n.Iface, netip.PrefixFrom(ip, n.Bits)) }

func (n HostNetwork) SetInitCwnd(segments int) error { return restore.SetInitCwnd(n.Iface, segments) }

func (n HostNetwork) LowerPathMTU() (func() error, error) { return restore.LowerPathMTU(n.Iface) }

func (n HostNetwork) Announce(ctx context.Context, ip netip.Addr) error {
	return restore.Announce(ctx, n.Iface, ip)
}
