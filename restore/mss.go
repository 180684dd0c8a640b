//go:build linux

package restore

import (
	"fmt"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Why restored sockets need a nudge to send full-size segments.
//
// CRIU connects a socket in repair mode (TCP_REPAIR) and only then sets its
// MSS (TCP_REPAIR_OPTIONS, TCPOPT_MAXSEG: mss_clamp), because the kernel
// takes options only on an established socket. The connect computed the
// sending MSS (mss_cache, tcp_sync_mss) from the route's MTU and the
// mss_clamp it had then, TCP_MSS_DEFAULT 536, and a repaired connect skips
// the SYN-ACK processing that would recompute it; setting mss_clamp later
// does not. So a restored socket sends 524-byte segments (536 less the
// timestamp option) on a 1500-byte link for the rest of its life. The kernel
// recomputes mss_cache, from the restored mss_clamp, only when the socket's
// route MTU differs from the one it last saw (icsk_pmtu_cookie,
// tcp_current_mss). LowerPathMTU arranges that: the sockets connect while
// the route's MTU is one byte lower, and once the route is put back their
// next send sees a different MTU and resyncs to the full segment size.

// minMTU is the least MTU LowerPathMTU leaves on a route (IPv6's minimum
// link MTU; IPv4's 68 is lower).
const minMTU = 1280

// LowerPathMTU lowers by one byte the MTU of every unicast route of the main
// table that leaves through iface (the route's own MTU metric, or iface's
// MTU), pinning its advertised MSS to what it was, and returns what it
// lowered, whose PutBack puts each route's MTU and advmss metrics back
// (idempotent; a route whose MTU or advmss changed since, by an operator or
// anything else, is left as it is now; with an error, what was lowered is
// returned too). A route already lowered by a LowerPathMTU whose put-back has
// not run (an overlapping restore on this host, or an agent that died in
// between) is not lowered again, and this put-back restores it too: the
// first put-back resyncs the sockets both restores made, except those
// restored after it ran, which keep 524-byte segments. Call it before CRIU restores
// the sockets and put the routes back once the restore returned (or failed):
// the restored sockets then send segments of their snapshot's MSS instead of
// 524 bytes (see above). New connections opened on the host in between get
// the same one-byte-lower MTU and resync the same way. Like SetInitCwnd it
// acts on the calling thread's network namespace.
func LowerPathMTU(iface string) (RouteEdit, error) {
	edit, err := PlanLowerPathMTU(iface)
	if err != nil {
		return edit, err
	}
	if err := edit.Apply(); err != nil {
		return edit, fmt.Errorf("lower path MTU (restored sockets will send 524-byte segments): %w", err)
	}
	return edit, nil
}

// PlanLowerPathMTU returns LowerPathMTU's edit without making it: the
// routes of iface to lower, with their metrics and those to set, and those
// found lowered already.
func PlanLowerPathMTU(iface string) (RouteEdit, error) {
	plan := RouteEdit{Iface: iface}
	link, err := netlink.LinkByName(iface)
	if err != nil {
		return plan, fmt.Errorf("lower path MTU: find interface %s in this network namespace: %w", iface, err)
	}
	linkMTU := link.Attrs().MTU
	routes, err := netlink.RouteList(link, netlink.FAMILY_ALL)
	if err != nil {
		return plan, fmt.Errorf("lower path MTU: list routes of %s: %w", iface, err)
	}
	for _, r := range routes {
		if !mainUnicast(r) {
			continue
		}
		if r.MTU != 0 && r.AdvMSS == r.MTU+1-advMSSOverhead(r) {
			// Lowered already: by a restore still under way, or by one whose agent died before its
			// put-back. Not lowered again; whichever put-back runs first restores it (the MTU it had
			// is inferred: the link's means none of its own).
			m := LoweredRoute{Route: routeKey(r), MTU: r.MTU + 1, SetMTU: r.MTU, SetAdvMSS: r.AdvMSS}
			if m.MTU == linkMTU {
				m.MTU = 0
			}
			plan.MTU = append(plan.MTU, m)
			continue
		}
		mtu := r.MTU
		if mtu == 0 {
			mtu = linkMTU
		}
		if mtu-1 < minMTU {
			continue // a link this small gains nothing from a larger MSS worth breaking IPv6 for
		}
		advMSS := r.AdvMSS
		if advMSS == 0 {
			advMSS = mtu - advMSSOverhead(r)
		}
		plan.MTU = append(plan.MTU, LoweredRoute{Route: routeKey(r), MTU: r.MTU, AdvMSS: r.AdvMSS, SetMTU: mtu - 1, SetAdvMSS: advMSS})
	}
	if len(plan.MTU) == 0 {
		return plan, fmt.Errorf("lower path MTU: interface %s has no unicast route in the main table with an MTU above %d", iface, minMTU)
	}
	return plan, nil
}

func mainUnicast(r netlink.Route) bool {
	return r.Type == unix.RTN_UNICAST && (r.Table == 0 || r.Table == unix.RT_TABLE_MAIN)
}

// advMSSOverhead is the IP and TCP header bytes the kernel subtracts from a
// route's MTU for its default advmss (ipv4_default_advmss, ip6_default_advmss).
func advMSSOverhead(r netlink.Route) int {
	if r.Family == unix.AF_INET6 {
		return 60
	}
	return 40
}

// routeKey names a route across a RouteReplace (which keeps these fields).
func routeKey(r netlink.Route) string {
	return fmt.Sprintf("%d %v %v %d %d", r.Family, r.Dst, r.Gw, r.Priority, r.Table)
}
