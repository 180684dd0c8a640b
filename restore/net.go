//go:build linux

package restore

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// TakeOver adds the failed node's address (with its prefix length) to iface
// in the calling thread's network namespace. It is idempotent. An IPv6
// address skips duplicate address detection, so the restored sockets can
// bind it at once. Guard first: from now on peers' packets for the address
// reach this host.
func TakeOver(iface string, addr netip.Prefix) error {
	link, a, err := linkAddr(iface, addr)
	if err != nil {
		return fmt.Errorf("take over %s: %w", addr, err)
	}
	if err := netlink.AddrReplace(link, a); err != nil {
		return fmt.Errorf("take over %s: add it to %s: %w", addr, iface, err)
	}
	return nil
}

// Release removes an address TakeOver added. An address that is not there
// is not an error.
func Release(iface string, addr netip.Prefix) error {
	link, a, err := linkAddr(iface, addr)
	if err != nil {
		return fmt.Errorf("release %s: %w", addr, err)
	}
	if err := netlink.AddrDel(link, a); err != nil && !errors.Is(err, unix.EADDRNOTAVAIL) {
		return fmt.Errorf("release %s: remove it from %s: %w", addr, iface, err)
	}
	return nil
}

func linkAddr(iface string, addr netip.Prefix) (netlink.Link, *netlink.Addr, error) {
	if !addr.IsValid() {
		return nil, nil, errors.New("invalid address")
	}
	link, err := netlink.LinkByName(iface)
	if err != nil {
		return nil, nil, fmt.Errorf("find interface %s in this network namespace: %w", iface, err)
	}
	ip := addr.Addr().Unmap()
	a := &netlink.Addr{IPNet: &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(addr.Bits(), ip.BitLen())}}
	if ip.Is6() {
		a.Flags = unix.IFA_F_NODAD
	}
	return link, a, nil
}

// SetInitCwnd raises, on every unicast route of the main table that leaves
// through iface (connected and on-link routes, and gateway routes for
// routed peers), the initial congestion window and initial receive window
// to at least segments (RouteReplace; a larger value is kept, so it is
// idempotent). The restored sockets read it when CRIU reconnects them, so
// call it before the restore: Plan.InitCwnd segments must leave before the
// peer's first ACK is accepted. It applies to every new connection over
// these routes, not only the restored ones, so put the routes back
// (RouteEdit.PutBack) once the restored sockets have re-sent what they
// had to (a socket whose congestion control restarts slow start after idle
// takes the route's window again). Left raised, every later connection of
// the host started with a burst of that many segments (tens of thousands
// after a recovery under heavy traffic) into the site's network. A put-back
// while another restore on the host still replays lowers its routes too;
// its sockets keep the window they connected with. With an error, the
// edit is returned too: its put-back puts back what was raised.
// SetInitCwnd is PlanInitCwnd then Apply; a daemon that keeps the edit on
// disk calls the two itself, keeping it in between.
func SetInitCwnd(iface string, segments int) (RouteEdit, error) {
	edit, err := PlanInitCwnd(iface, segments)
	if err != nil {
		return edit, err
	}
	return edit, edit.Apply()
}

// PlanInitCwnd returns SetInitCwnd's edit without making it: the routes
// of iface whose initial windows are below segments, with what they have
// and what they are to be set to.
func PlanInitCwnd(iface string, segments int) (RouteEdit, error) {
	plan := RouteEdit{Iface: iface}
	if segments < 1 {
		return plan, fmt.Errorf("set initcwnd on %s: %d segments: give at least 1", iface, segments)
	}
	link, err := netlink.LinkByName(iface)
	if err != nil {
		return plan, fmt.Errorf("set initcwnd: find interface %s in this network namespace: %w", iface, err)
	}
	routes, err := netlink.RouteList(link, netlink.FAMILY_ALL)
	if err != nil {
		return plan, fmt.Errorf("set initcwnd: list routes of %s: %w", iface, err)
	}
	n := 0
	for _, r := range routes {
		if !mainUnicast(r) {
			continue
		}
		n++
		if r.InitCwnd >= segments && r.InitRwnd >= segments {
			continue
		}
		plan.InitCwnd = append(plan.InitCwnd, RaisedRoute{Route: routeKey(r), Cwnd: r.InitCwnd, Rwnd: r.InitRwnd,
			SetCwnd: max(r.InitCwnd, segments), SetRwnd: max(r.InitRwnd, segments)})
	}
	if n == 0 {
		return plan, fmt.Errorf("set initcwnd: interface %s has no unicast route in the main table (is it up with an address?)", iface)
	}
	return plan, nil
}

// editRoutes lists link's routes and replaces each main-table unicast
// route that edit changes (it returns true); what names the change in errors.
func editRoutes(link netlink.Link, what string, edit func(r *netlink.Route) bool) error {
	iface := link.Attrs().Name
	routes, err := netlink.RouteList(link, netlink.FAMILY_ALL)
	if err != nil {
		return fmt.Errorf("%s: list routes of %s: %w", what, iface, err)
	}
	var errs []error
	for _, r := range routes {
		if !mainUnicast(r) || !edit(&r) {
			continue
		}
		if err := netlink.RouteReplace(&r); err != nil {
			errs = append(errs, fmt.Errorf("%s on route %v of %s: %w", what, r.Dst, iface, err))
		}
	}
	return errors.Join(errs...)
}

// Announce broadcasts gratuitous ARP for ip out of iface (an ARP request
// whose sender and target are ip, sender hardware address iface's, as
// `arping -U` sends), so that peers' neighbour entries for the failed node's
// address move to this host instead of waiting for them to go stale (Linux
// updates an existing entry from such a request even with arp_accept=0). It
// returns once the first is sent; a repeat 100 ms later, in case the first
// was lost, is sent from the same socket without anyone waiting for it (the
// recovery's replay and its re-protection waited 100 ms for it before). Call
// it once the restored sockets exist: a peer that sends here before then
// meets the guard at best. IPv4 only; the packet socket is opened in the
// calling thread's network namespace.
func Announce(ctx context.Context, iface string, ip netip.Addr) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("announce %s: %w", ip, err)
	}
	ip = ip.Unmap()
	if !ip.Is4() {
		return fmt.Errorf("announce %s: only IPv4 is announced (ARP); IPv6 peers rediscover by neighbour solicitation", ip)
	}
	link, err := netlink.LinkByName(iface)
	if err != nil {
		return fmt.Errorf("announce %s: find interface %s in this network namespace: %w", ip, iface, err)
	}
	mac := link.Attrs().HardwareAddr
	if len(mac) != 6 {
		return fmt.Errorf("announce %s: interface %s has no Ethernet address (link type %s)", ip, iface, link.Attrs().EncapType)
	}
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ARP)))
	if err != nil {
		return fmt.Errorf("announce %s: open a packet socket (needs CAP_NET_RAW): %w", ip, err)
	}
	to := &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ARP), Ifindex: link.Attrs().Index, Halen: 6}
	copy(to.Addr[:], []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	pkt := garp(mac, ip.As4())
	if err := unix.Sendto(fd, pkt, 0, to); err != nil {
		unix.Close(fd)
		return fmt.Errorf("announce %s: send gratuitous ARP on %s: %w", ip, iface, err)
	}
	// The socket keeps the namespace it was opened in, so the repeat needs no thread of it. Best effort (an
	// interface gone by then, its job ended, has nobody to announce) and not bound to ctx, which the
	// recovery's end cancels.
	time.AfterFunc(announceRepeat, func() {
		unix.Sendto(fd, pkt, 0, to)
		unix.Close(fd)
	})
	return nil
}

// announceRepeat is how long after the first announcement Announce repeats it.
const announceRepeat = 100 * time.Millisecond

// garp is the ARP payload of a gratuitous request (RFC 5227 announcement).
func garp(mac net.HardwareAddr, ip [4]byte) []byte {
	b := []byte{0, 1, 8, 0, 6, 4, 0, 1} // Ethernet, IPv4, hlen 6, plen 4, request
	b = append(b, mac...)
	b = append(b, ip[:]...)
	b = append(b, 0, 0, 0, 0, 0, 0) // target hardware address: unknown
	return append(b, ip[:]...)
}

// htons converts to network byte order (the hosts ftkit runs on are little-endian).
func htons(v uint16) uint16 { return v<<8 | v>>8 }
