//go:build linux

package jobnet

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/netnsthread"
)

// Create makes the job's network as s describes, or completes and corrects one left by an earlier call
// (an agent that crashed half-way calls it again): the namespace, the interface inside it with exactly the
// job's address, loopback and the interface up, and the default route.
func Create(ctx context.Context, s Spec) error {
	s, err := s.Validate()
	if err != nil {
		return err
	}
	if err := ensureNetns(s.Name); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	job, err := netns.GetFromPath(Path(s.Name))
	if err != nil {
		return fmt.Errorf("job network %s: open namespace: %w", s.Name, err)
	}
	defer job.Close()
	jh, err := netlink.NewHandleAt(job)
	if err != nil {
		return fmt.Errorf("job network %s: netlink in its namespace: %w", s.Name, err)
	}
	defer jh.Close()
	ph, err := parentHandle(s.ParentNetns)
	if err != nil {
		return fmt.Errorf("job network %s: %w", s.Name, err)
	}
	defer ph.Close()

	lk, err := ensureLink(s, ph, jh, job)
	if err != nil {
		return fmt.Errorf("job network %s: %w", s.Name, err)
	}
	if err := ensureAddr(jh, lk, s.Addr); err != nil {
		return fmt.Errorf("job network %s: %w", s.Name, err)
	}
	lo, err := jh.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("job network %s: find lo: %w", s.Name, err)
	}
	if err := jh.LinkSetUp(lo); err != nil {
		return fmt.Errorf("job network %s: bring up lo: %w", s.Name, err)
	}
	if err := jh.LinkSetUp(lk); err != nil {
		return fmt.Errorf("job network %s: bring up %s: %w", s.Name, s.IfName, err)
	}
	if s.Gateway.IsValid() {
		gw := &netlink.Route{LinkIndex: lk.Attrs().Index, Gw: s.Gateway.AsSlice(), Scope: netlink.SCOPE_UNIVERSE}
		if err := jh.RouteReplace(gw); err != nil {
			return fmt.Errorf("job network %s: default route via %v: %w", s.Name, s.Gateway, err)
		}
	}
	return nil
}

// Delete removes the job's network: first every interface in it (so the job's address leaves the wire at
// once, even if a process still holds the namespace), then the namespace's name. A missing network is not
// an error. parentNetns is Spec.ParentNetns, where a half-created interface may have been left.
func Delete(ctx context.Context, name, parentNetns string) error {
	return deleteNet(ctx, name, parentNetns, nil)
}

// deleteNet is Delete. found, if set, runs once the namespace was found (tests: another deleter removes it
// then, as an agent removing a finished job's network may while an operator's cleanup runs).
func deleteNet(ctx context.Context, name, parentNetns string, found func()) error {
	if err := ValidName(name); err != nil {
		return err
	}
	if ph, err := parentHandle(parentNetns); err == nil {
		if lk, err := ph.LinkByName(tempLinkName(name)); err == nil {
			if err := ph.LinkDel(lk); err != nil {
				ph.Close()
				return fmt.Errorf("job network %s: delete half-created interface %s: %w", name, lk.Attrs().Name, err)
			}
		}
		ph.Close()
	} else {
		return fmt.Errorf("job network %s: %w", name, err)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	ok, err := isNetns(Path(name))
	if err != nil {
		return fmt.Errorf("job network %s: %w", name, err)
	}
	if ok {
		if found != nil {
			found()
		}
		// Gone since it was found: removed by another deleter, which is not an error here either.
		if err := deleteLinks(name); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	p := Path(name)
	if err := unix.Unmount(p, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("job network %s: unmount %s: %w", name, p, err)
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("job network %s: remove %s: %w", name, p, err)
	}
	return nil
}

// Withdraw takes the job's addresses off its interfaces: from then on its namespace neither answers for
// them nor sends from them (a socket closed later, by a kill, sends nothing: its packets have no source).
// It is immediate, where Delete waits for the kernel to unregister the interface (20-40 ms); Delete must
// still follow. A missing network is not an error.
func Withdraw(name string) error {
	if err := ValidName(name); err != nil {
		return err
	}
	if ok, err := isNetns(Path(name)); err != nil || !ok {
		return err
	}
	return eachLink(name, func(jh *netlink.Handle, lk netlink.Link) error {
		addrs, err := jh.AddrList(lk, netlink.FAMILY_ALL)
		if err != nil {
			return fmt.Errorf("list addresses of %s: %w", lk.Attrs().Name, err)
		}
		for _, a := range addrs {
			if err := jh.AddrDel(lk, &a); err != nil && !errors.Is(err, unix.EADDRNOTAVAIL) {
				return fmt.Errorf("remove %s from %s: %w", a.IPNet, lk.Attrs().Name, err)
			}
		}
		return nil
	})
}

// Exists reports whether the job's namespace is there (an agent after a restart: is this job's network up?).
func Exists(name string) (bool, error) {
	if err := ValidName(name); err != nil {
		return false, err
	}
	return isNetns(Path(name))
}

// Do runs fn on an OS thread that has joined the job's namespace, with the caller's mount namespace
// (`nsenter --net` semantics: CRIU needs the host's /sys). Processes that fn starts with os/exec are forked
// from that thread and live in the job's namespace.
func Do(name string, fn func() error) error {
	if err := ValidName(name); err != nil {
		return err
	}
	return netnsthread.In(Path(name), fn)
}

// isNetns reports whether path is a mounted namespace file; a plain file left by an interrupted create is not.
func isNetns(path string) (bool, error) {
	var st unix.Statfs_t
	err := unix.Statfs(path, &st)
	if errors.Is(err, unix.ENOENT) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("statfs %s: %w", path, err)
	}
	return st.Type == unix.NSFS_MAGIC, nil
}

// ensureNetns creates the named namespace unless it is already mounted.
func ensureNetns(name string) error {
	p := Path(name)
	ok, err := isNetns(p)
	if err != nil {
		return fmt.Errorf("job network %s: %w", name, err)
	}
	if ok {
		return nil
	}
	// A file without a mount is what a crash between netns.NewNamed's create and mount leaves.
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("job network %s: remove stale %s: %w", name, p, err)
	}
	if err := netnsthread.CreateNamed(name); err != nil {
		return fmt.Errorf("job network %s: %w", name, err)
	}
	return nil
}

func parentHandle(path string) (*netlink.Handle, error) {
	if path == "" {
		path = "/proc/self/ns/net"
	}
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return nil, fmt.Errorf("open parent namespace %s: %w", path, err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return nil, fmt.Errorf("netlink in parent namespace %s: %w", path, err)
	}
	return h, nil
}

// ensureLink returns the job's interface, creating it if it is missing: made directly inside the
// namespace (IFLA_NET_NS_FD), on the parent of the parent's namespace. Made on the parent and then moved
// in, as before, the move cost 10-25 ms of every restore's network preparation: the kernel waits for RCU
// grace periods to take an interface out of a namespace.
func ensureLink(s Spec, ph, jh *netlink.Handle, job netns.NsHandle) (netlink.Link, error) {
	parent, err := ph.LinkByName(s.Parent)
	if err != nil {
		return nil, fmt.Errorf("find parent interface %s: %w", s.Parent, err)
	}
	if lk, err := jh.LinkByName(s.IfName); err == nil {
		if err := checkLink(s, lk, parent); err != nil {
			return nil, err
		}
		return lk, nil
	}
	// An earlier agent made the interface on the parent under a temporary name and crashed before it
	// moved it in.
	if old, err := ph.LinkByName(tempLinkName(s.Name)); err == nil {
		if err := ph.LinkDel(old); err != nil {
			return nil, fmt.Errorf("delete half-created interface %s: %w", old.Attrs().Name, err)
		}
	}
	attrs := netlink.LinkAttrs{Name: s.IfName, ParentIndex: parent.Attrs().Index, Namespace: netlink.NsFd(job)}
	var lk netlink.Link
	switch s.Kind {
	case IPVlan:
		lk = &netlink.IPVlan{LinkAttrs: attrs, Mode: netlink.IPVLAN_MODE_L2}
	case MACVlan:
		lk = &netlink.Macvlan{LinkAttrs: attrs, Mode: netlink.MACVLAN_MODE_BRIDGE}
	}
	if err := ph.LinkAdd(lk); err != nil {
		return nil, fmt.Errorf("create %s interface %s on %s inside the namespace: %w", s.Kind, s.IfName, s.Parent, err)
	}
	return jh.LinkByName(s.IfName)
}

// checkLink refuses an interface an earlier Create left in the namespace that is not the one s asks for:
// another kind, or on another parent (job_network.parent changed since): the job's address would be on
// another network than the one the agent's configuration names.
func checkLink(s Spec, lk, parent netlink.Link) error {
	if lk.Type() != string(s.Kind) {
		return fmt.Errorf("interface %s in the namespace is a %s, want %s: delete the job network first", s.IfName, lk.Type(), s.Kind)
	}
	// IFLA_LINK: the parent's index in its own namespace, where parent was looked up.
	if got, want := lk.Attrs().ParentIndex, parent.Attrs().Index; got != want {
		return fmt.Errorf("interface %s in the namespace is on the interface of index %d, want %s (index %d): delete the job network first", s.IfName, got, s.Parent, want)
	}
	return nil
}

// ensureAddr leaves exactly addr as the interface's IPv4 address.
func ensureAddr(jh *netlink.Handle, lk netlink.Link, addr netip.Prefix) error {
	want, err := netlink.ParseAddr(addr.String())
	if err != nil {
		return fmt.Errorf("parse %s: %w", addr, err)
	}
	have, err := jh.AddrList(lk, netlink.FAMILY_V4)
	if err != nil {
		return fmt.Errorf("list addresses of %s: %w", lk.Attrs().Name, err)
	}
	for _, a := range have {
		if a.IPNet.String() == want.IPNet.String() {
			continue
		}
		if err := jh.AddrDel(lk, &a); err != nil {
			return fmt.Errorf("remove stale address %s: %w", a.IPNet, err)
		}
	}
	if err := jh.AddrReplace(lk, want); err != nil {
		return fmt.Errorf("add %s to %s: %w", addr, lk.Attrs().Name, err)
	}
	return nil
}

// deleteLinks removes every interface but lo from the job's namespace.
func deleteLinks(name string) error {
	return eachLink(name, func(jh *netlink.Handle, lk netlink.Link) error {
		if err := jh.LinkDel(lk); err != nil && !errors.Is(err, unix.ENODEV) {
			return fmt.Errorf("delete %s: %w", lk.Attrs().Name, err)
		}
		return nil
	})
}

// eachLink calls fn with a netlink handle in the job's namespace for every interface in it but lo, until
// fn fails; the error names the job network.
func eachLink(name string, fn func(jh *netlink.Handle, lk netlink.Link) error) error {
	job, err := netns.GetFromPath(Path(name))
	if err != nil {
		return fmt.Errorf("job network %s: open namespace: %w", name, err)
	}
	defer job.Close()
	jh, err := netlink.NewHandleAt(job)
	if err != nil {
		return fmt.Errorf("job network %s: netlink in its namespace: %w", name, err)
	}
	defer jh.Close()
	links, err := jh.LinkList()
	if err != nil {
		return fmt.Errorf("job network %s: list interfaces: %w", name, err)
	}
	for _, lk := range links {
		if lk.Attrs().Name == "lo" {
			continue
		}
		if err := fn(jh, lk); err != nil {
			return fmt.Errorf("job network %s: %w", name, err)
		}
	}
	return nil
}

// Closing counts the TCP sockets in the job's namespace whose close the peer has not acknowledged yet
// (FIN_WAIT1, CLOSING, LAST_ACK): a process that exits leaves them to the kernel, which sends what they
// still hold, then their FIN, and retransmits both until the peer acknowledges. Deleting the namespace
// destroys them silently: a peer that missed the FIN (its host dropped it, as CRIU's network lock does
// during a dump) then waits forever on a connection nobody answers. A missing network has none.
func Closing(name string) (int, error) {
	if err := ValidName(name); err != nil {
		return 0, err
	}
	if ok, err := isNetns(Path(name)); err != nil || !ok {
		return 0, err
	}
	job, err := netns.GetFromPath(Path(name))
	if err != nil {
		return 0, fmt.Errorf("job network %s: open namespace: %w", name, err)
	}
	defer job.Close()
	jh, err := netlink.NewHandleAt(job, unix.NETLINK_INET_DIAG)
	if err != nil {
		return 0, fmt.Errorf("job network %s: sock_diag in its namespace: %w", name, err)
	}
	defer jh.Close()
	n := 0
	for _, family := range []uint8{unix.AF_INET, unix.AF_INET6} {
		socks, err := jh.SocketDiagTCP(family)
		if err != nil {
			return 0, fmt.Errorf("job network %s: list TCP sockets: %w", name, err)
		}
		for _, s := range socks {
			switch s.State {
			case unix.BPF_TCP_FIN_WAIT1, unix.BPF_TCP_CLOSING, unix.BPF_TCP_LAST_ACK:
				n++
			}
		}
	}
	return n, nil
}
