package recovery

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/internal/sockdiag"
	"github.com/ftkit/ftkit/jobnet"
	"github.com/ftkit/ftkit/restore"
	"github.com/ftkit/ftkit/tcpflow"
)

// HostNetwork is Network on the calling thread's network namespace, on interface Iface whose addresses
// have prefix length Bits. Routes, if set, keeps the route changes of SetInitCwnd and LowerPathMTU until
// they are put back.
type HostNetwork struct {
	Iface  string
	Bits   int
	Routes RouteKeeper
}

// RouteKeeper keeps on disk, until they are put back, the route changes a recovery made for its restore
// (restore.SetInitCwnd, restore.LowerPathMTU), so that an agent restarted in between puts them back: left
// as they are, every new connection over the routes starts with the restore's burst, and the routes keep
// an MTU one byte low.
type RouteKeeper interface {
	// Keep records edit, in the job network netns ("" for the host's namespace), until done.
	Keep(netns string, edit restore.RouteEdit) (done func())
}

// editRoutes makes the route edit that plan returns, in the job network netns ("" for the calling
// thread's namespace), and returns its put-back (nil if plan changes nothing). keep records the edit from
// before it is made until the put-back succeeded: an agent killed in between finds it at its start. With
// an error from making it, the put-back is returned too, for the routes that were changed.
func editRoutes(keep RouteKeeper, netns string, plan func() (restore.RouteEdit, error)) (func() error, error) {
	var edit restore.RouteEdit
	if err := inNetns(netns, func() (err error) { edit, err = plan(); return err }); err != nil || edit.Empty() {
		return nil, err
	}
	done := func() {}
	if keep != nil {
		done = keep.Keep(netns, edit)
	}
	putBack := func() error {
		err := PutBackEdit(netns, edit)
		if err == nil {
			done()
		}
		return err
	}
	return putBack, inNetns(netns, edit.Apply)
}

// inNetns runs fn on a thread in the job network netns, or on the calling thread for "".
func inNetns(netns string, fn func() error) error {
	if netns == "" {
		return fn()
	}
	return jobnet.Do(netns, fn)
}

// PutBackEdit puts edit back in the job network netns, or in the calling thread's namespace for "". A job
// network deleted since (its restore failed) has nothing left to put back.
func PutBackEdit(netns string, edit restore.RouteEdit) error {
	switch err := inNetns(netns, edit.PutBack); {
	case err == nil || netns == "":
		return err
	case errors.Is(err, fs.ErrNotExist):
		return nil
	default:
		return fmt.Errorf("job network %s: %w", netns, err)
	}
}

func (n HostNetwork) Guard(ctx context.Context, runID string, conns []ckpt.Conn, addrs []netip.Addr) error {
	return restore.Guard(ctx, runID, conns, addrs)
}

func (n HostNetwork) Unguard(ctx context.Context, runID string) error {
	return restore.Unguard(ctx, runID)
}

func (n HostNetwork) TakeOver(ip netip.Addr) error {
	return restore.TakeOver(n.Iface, netip.PrefixFrom(ip, n.Bits))
}

func (n HostNetwork) Release(ip netip.Addr) { restore.Release(n.Iface, netip.PrefixFrom(ip, n.Bits)) }

func (n HostNetwork) SetInitCwnd(segments int) (func() error, error) {
	return editRoutes(n.Routes, "", func() (restore.RouteEdit, error) { return restore.PlanInitCwnd(n.Iface, segments) })
}

func (n HostNetwork) LowerPathMTU() (func() error, error) {
	return editRoutes(n.Routes, "", func() (restore.RouteEdit, error) { return restore.PlanLowerPathMTU(n.Iface) })
}

func (n HostNetwork) ResetPeer(conn tcpflow.Tuple, seq uint32) error {
	return restore.ResetPeer(conn, seq)
}

func (n HostNetwork) DeliverFromPeer(ctx context.Context, conn tcpflow.Tuple, h restore.PeerHeader, payload []byte, base uint32) error {
	return deliver(ctx, conn, h, payload, base)
}

// deliver is restore.DeliverFromPeer with the socket's rcv_nxt read by sock_diag: base, the rcv_nxt it was
// restored with, plus what it received since (a restored socket counts from 0).
func deliver(ctx context.Context, conn tcpflow.Tuple, h restore.PeerHeader, payload []byte, base uint32) error {
	return restore.DeliverFromPeer(ctx, conn, h, payload, func() (uint32, int, error) {
		s, err := sockdiag.Lookup(conn)
		if err == nil && s.TimeWait() {
			err = errors.New("the socket is in TIME_WAIT, where sock_diag tells nothing of what it received")
		}
		return base + uint32(s.Received), s.Unread, err
	}, deliverRetry)
}

func (n HostNetwork) DeliverFIN(ctx context.Context, conn tcpflow.Tuple, h restore.PeerHeader) error {
	return deliverFIN(ctx, conn, h)
}

// deliverFIN is restore.DeliverFIN with the socket's state read by sock_diag. A socket that existed and is
// gone took the FIN: its program read to the end and closed, and the socket went with the peer's ACK.
func deliverFIN(ctx context.Context, conn tcpflow.Tuple, h restore.PeerHeader) error {
	if _, err := sockdiag.Lookup(conn); err != nil {
		return fmt.Errorf("deliver the peer's FIN to %s: %w", conn, err)
	}
	return restore.DeliverFIN(ctx, conn, h, func() (bool, error) {
		s, err := sockdiag.Lookup(conn)
		if errors.Is(err, sockdiag.ErrNoSocket) {
			return true, nil
		}
		return s.FinReceived(), err
	}, deliverRetry)
}

// deliverRetry is how long DeliverFromPeer waits for a socket that took in nothing before injecting again.
const deliverRetry = 50 * time.Millisecond

func (n HostNetwork) Announce(ctx context.Context, ip netip.Addr) error {
	return restore.Announce(ctx, n.Iface, ip)
}

// JobNet is JobNetwork on a job network of package jobnet on this host: every operation runs on a thread
// inside the job's namespace, on the job's interface.
type JobNet struct {
	Spec   jobnet.Spec // validated
	Routes RouteKeeper // as HostNetwork's
}

func (n JobNet) in(fn func() error) error { return jobnet.Do(n.Spec.Name, fn) }

func (n JobNet) iface() string {
	if n.Spec.IfName == "" {
		return jobnet.DefaultIfName
	}
	return n.Spec.IfName
}

func (n JobNet) Create(ctx context.Context) error { return jobnet.Create(ctx, n.Spec) }

func (n JobNet) Delete(ctx context.Context) error {
	return jobnet.Delete(ctx, n.Spec.Name, n.Spec.ParentNetns)
}

func (n JobNet) Addr() netip.Addr { return n.Spec.Addr.Addr() }

func (n JobNet) Guard(ctx context.Context, runID string, conns []ckpt.Conn, addrs []netip.Addr) error {
	return n.in(func() error { return restore.Guard(ctx, runID, conns, addrs) })
}

func (n JobNet) Unguard(ctx context.Context, runID string) error {
	return n.in(func() error { return restore.Unguard(ctx, runID) })
}

func (n JobNet) TakeOver(ip netip.Addr) error {
	return fmt.Errorf("take over %s: a job network holds only its job's address", ip)
}

func (n JobNet) Release(netip.Addr) {}

func (n JobNet) SetInitCwnd(segments int) (func() error, error) {
	return editRoutes(n.Routes, n.Spec.Name, func() (restore.RouteEdit, error) { return restore.PlanInitCwnd(n.iface(), segments) })
}

func (n JobNet) LowerPathMTU() (func() error, error) {
	return editRoutes(n.Routes, n.Spec.Name, func() (restore.RouteEdit, error) { return restore.PlanLowerPathMTU(n.iface()) })
}

func (n JobNet) ResetPeer(conn tcpflow.Tuple, seq uint32) error {
	return n.in(func() error { return restore.ResetPeer(conn, seq) })
}

func (n JobNet) DeliverFromPeer(ctx context.Context, conn tcpflow.Tuple, h restore.PeerHeader, payload []byte, base uint32) error {
	return n.in(func() error { return deliver(ctx, conn, h, payload, base) })
}

func (n JobNet) DeliverFIN(ctx context.Context, conn tcpflow.Tuple, h restore.PeerHeader) error {
	return n.in(func() error { return deliverFIN(ctx, conn, h) })
}

func (n JobNet) Announce(ctx context.Context, ip netip.Addr) error {
	return n.in(func() error { return restore.Announce(ctx, n.iface(), ip) })
}
